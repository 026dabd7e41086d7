package deploy

import (
	"embed"
	"fmt"
	"io/fs"
	"regexp"
	"sort"

	"sigs.k8s.io/yaml"

	"github.com/sglang-watchdog/sglang-watchdog/deploy/kubernetes"
)

// rendered holds the packaging that runs the watchdog outside
// deploy/kubernetes: the Helm chart's sidecar renders (committed goldens,
// kept current by deploy/verify) and the LeaderWorkerSet and RoleBasedGroup
// examples.
//
//go:embed helm/testdata/*.yaml examples/*/*.yaml
var rendered embed.FS

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*(#.*)?$`)

// SidecarArgs returns the args of every sglang-watchdog container the
// project ships, keyed by "<file relative to deploy/>#<document>/<n>": the
// manifests of deploy/kubernetes, the chart's renders and the examples.
// The main package's tests parse each with the real flag set.
func SidecarArgs() (map[string][]string, error) {
	out := map[string][]string{}
	manifests, err := kubernetes.SidecarArgs()
	if err != nil {
		return nil, err
	}
	for f, args := range manifests {
		out["kubernetes/"+f] = args
	}
	files, err := fs.Glob(rendered, "*/*/*.yaml")
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		data, err := rendered.ReadFile(f)
		if err != nil {
			return nil, err
		}
		var found int
		for i, part := range docSeparator.Split(string(data), -1) {
			var obj any
			if err := yaml.Unmarshal([]byte(part), &obj); err != nil {
				return nil, fmt.Errorf("%s#%d: %w", f, i, err)
			}
			for n, args := range sidecarArgs(obj) {
				out[fmt.Sprintf("%s#%d/%d", f, i, n)] = args
				found++
			}
		}
		if found == 0 {
			return nil, fmt.Errorf("%s runs no %s container", f, kubernetes.SidecarName)
		}
	}
	return out, nil
}

// sidecarArgs walks a decoded document and returns the args of every
// init container named sglang-watchdog, wherever its pod template sits
// (Deployment, LeaderWorkerSet leader or worker, RoleBasedGroup role).
func sidecarArgs(v any) [][]string {
	var out [][]string
	switch v := v.(type) {
	case map[string]any:
		if list, ok := v["initContainers"].([]any); ok {
			for _, c := range list {
				c, ok := c.(map[string]any)
				if !ok || c["name"] != kubernetes.SidecarName {
					continue
				}
				args := []string{}
				if raw, ok := c["args"].([]any); ok {
					for _, a := range raw {
						args = append(args, fmt.Sprint(a))
					}
				}
				out = append(out, args)
			}
		}
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if k != "initContainers" {
				out = append(out, sidecarArgs(v[k])...)
			}
		}
	case []any:
		for _, x := range v {
			out = append(out, sidecarArgs(x)...)
		}
	}
	return out
}
