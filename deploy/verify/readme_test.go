package verify

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
)

// readmeHelmCommands returns the shell commands of README.md's "Install
// with Helm" section, continuation lines joined, each split into words (they
// use no quoting).
func readmeHelmCommands(t *testing.T) [][]string {
	t.Helper()
	readme := string(readRepoFile(t, "README.md"))
	start := strings.Index(readme, "## Install with Helm")
	if start < 0 {
		t.Fatal(`README.md has no "## Install with Helm" section`)
	}
	section := readme[start:]
	if end := strings.Index(section[2:], "\n## "); end >= 0 {
		section = section[:end+2]
	}
	var cmds [][]string
	for _, block := range strings.Split(section, "```sh\n")[1:] {
		block = block[:strings.Index(block, "```")]
		for _, line := range strings.Split(strings.ReplaceAll(block, "\\\n", " "), "\n") {
			if f := strings.Fields(line); len(f) > 0 {
				cmds = append(cmds, f)
			}
		}
	}
	return cmds
}

// helmIn runs helm with the README's arguments from the repository root,
// where the README's relative chart path points.
func helmIn(t *testing.T, args []string) []byte {
	t.Helper()
	cmd := exec.Command(toolPath(t, "helm"), args...)
	cmd.Dir = repoRoot
	out, err := cmd.Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, msg)
	}
	return out
}

// TestReadmeHelmCommands runs the commands README.md shows: the install
// (as helm template with the same arguments, since no cluster is here)
// renders objects that decode strictly, and the sidecar patch, applied the
// way kubectl's strategic merge does to the plain SGLang prefill Deployment,
// gives the shipped manifest.
func TestReadmeHelmCommands(t *testing.T) {
	cmds := readmeHelmCommands(t)
	var install, patch []string
	for _, c := range cmds {
		switch {
		case len(c) > 1 && c[0] == "helm" && c[1] == "install":
			install = c
		case len(c) > 1 && c[0] == "helm" && c[1] == "template":
			patch = c
		}
	}
	if install == nil || patch == nil {
		t.Fatalf("README's Helm section lacks a helm install or a helm template command: %q", cmds)
	}

	// helm install sees the cluster's kinds; helm template is told them.
	docs, err := splitDocs("README install", helmIn(t, append(append([]string{"template"}, install[2:]...), operatorAPIs...)))
	if err != nil {
		t.Fatal(err)
	}
	objs := decodeAll(t, docs)
	if len(objs.podMonitors) == 0 || len(objs.prometheusRules) == 0 {
		t.Errorf("the README's install renders %d PodMonitors and %d PrometheusRules", len(objs.podMonitors), len(objs.prometheusRules))
	}

	args := patch[1:]
	for i, a := range args {
		if a == ">" {
			args = args[:i]
			break
		}
	}
	docs, err = splitDocs("README sidecar patch", helmIn(t, args))
	if err != nil {
		t.Fatal(err)
	}
	want := manifestDeployment(t, "prefill")
	var got appsv1.Deployment
	for _, d := range docs {
		if d.name != want.Name {
			t.Errorf("the README's patch command renders %s too", d.name)
			continue
		}
		original, err := json.Marshal(plainSGLang(want))
		if err != nil {
			t.Fatal(err)
		}
		merged, err := strategicpatch.StrategicMergePatch(original, d.json, appsv1.Deployment{})
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(merged, &got); err != nil {
			t.Fatal(err)
		}
	}
	for i := range got.Spec.Template.Spec.InitContainers {
		got.Spec.Template.Spec.InitContainers[i].ImagePullPolicy = "" // set by the chart, defaulted in the manifests
	}
	if a, b := asJSON(t, sortedMounts(got)), asJSON(t, sortedMounts(want)); a != b {
		t.Errorf("the README's patch does not give the shipped prefill manifest:\npatched:  %s\nmanifest: %s", a, b)
	}
}
