// Package kubernetes holds the example Kubernetes manifests that run
// sglang-watchdog as a native sidecar next to SGLang prefill and decode
// servers (prefill/, decode/), and the PrometheusRule manifests generated
// from alerts/ (monitoring/, see package promrule).
//
// The YAML files are embedded so that tests elsewhere can check them: the
// main package's tests parse SidecarArgs (through deploy.SidecarArgs, which
// adds the chart's renders and the examples) with the real flag set.
package kubernetes

//go:generate go run ./gen

import (
	"bytes"
	"embed"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// SidecarName is the name of the watchdog container in every manifest.
const SidecarName = "sglang-watchdog"

// TokenPath is where the plugin token Secret is mounted in both containers
// of a prefill pod.
const TokenPath = "/var/run/secrets/sglang-watchdog/token"

//go:embed prefill/*.yaml decode/*.yaml monitoring/*.yaml
var manifestFS embed.FS

// manifestFiles returns the paths of all embedded manifests, relative to
// deploy/kubernetes, sorted.
func manifestFiles() ([]string, error) {
	var out []string
	err := fs.WalkDir(manifestFS, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".yaml") {
			out = append(out, p)
		}
		return nil
	})
	sort.Strings(out)
	return out, err
}

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*(#.*)?$`)

// Document is one YAML document of a manifest stream, converted to JSON.
type Document struct {
	Source     string // the file or render it came from
	Index      int    // 0-based position in the stream
	JSON       []byte
	APIVersion string
	Kind       string
	Name       string
}

func (d Document) String() string {
	return fmt.Sprintf("%s#%d (%s %s %s)", d.Source, d.Index, d.APIVersion, d.Kind, d.Name)
}

// SplitDocuments splits a YAML stream into its documents and converts each
// to JSON; duplicate keys are errors, documents that hold only comments are
// skipped, and every document must name its apiVersion and kind. The Helm
// chart's and kustomize's tests (deploy/verify) split their renders with it.
func SplitDocuments(source string, data []byte) ([]Document, error) {
	var out []Document
	for i, part := range docSeparator.Split(string(data), -1) {
		j, err := yaml.YAMLToJSONStrict([]byte(part))
		if err != nil {
			return nil, fmt.Errorf("%s#%d: %w", source, i, err)
		}
		j = bytes.TrimSpace(j)
		if len(j) == 0 || string(j) == "null" {
			continue
		}
		var tm struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(j, &tm); err != nil {
			return nil, fmt.Errorf("%s#%d: %w", source, i, err)
		}
		if tm.APIVersion == "" || tm.Kind == "" {
			return nil, fmt.Errorf("%s#%d: apiVersion and kind are required", source, i)
		}
		out = append(out, Document{Source: source, Index: i, JSON: j, APIVersion: tm.APIVersion, Kind: tm.Kind, Name: tm.Metadata.Name})
	}
	return out, nil
}

// documents splits an embedded manifest file into its documents.
func documents(file string) ([]Document, error) {
	data, err := manifestFS.ReadFile(file)
	if err != nil {
		return nil, err
	}
	return SplitDocuments(file, data)
}

// decodeStrict decodes a document into obj, rejecting unknown and duplicate
// fields.
func decodeStrict(d Document, obj any) error {
	if err := yaml.UnmarshalStrict(d.JSON, obj); err != nil {
		return fmt.Errorf("%s: %w", d, err)
	}
	return nil
}

// SidecarArgs returns, for every manifest file that runs the watchdog, the
// args of its sglang-watchdog container, keyed by the file's path relative
// to deploy/kubernetes (e.g. "prefill/deployment.yaml").
func SidecarArgs() (map[string][]string, error) {
	files, err := manifestFiles()
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, f := range files {
		docs, err := documents(f)
		if err != nil {
			return nil, err
		}
		for _, d := range docs {
			if d.APIVersion != "apps/v1" || d.Kind != "Deployment" {
				continue
			}
			var dep appsv1.Deployment
			if err := decodeStrict(d, &dep); err != nil {
				return nil, err
			}
			spec := dep.Spec.Template.Spec
			all := make([]corev1.Container, 0, len(spec.InitContainers)+len(spec.Containers))
			all = append(all, spec.InitContainers...)
			all = append(all, spec.Containers...)
			for _, c := range all {
				if c.Name != SidecarName {
					continue
				}
				if _, dup := out[f]; dup {
					return nil, fmt.Errorf("%s: more than one %s container", f, SidecarName)
				}
				out[f] = append([]string{}, c.Args...)
			}
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no manifest runs a %s container", SidecarName)
	}
	return out, nil
}
