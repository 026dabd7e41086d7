package verify

import (
	"os/exec"
	"strings"
	"testing"
)

// quickStartCommands returns the shell commands of docs/deployment.md's
// "Quick start", continuation lines joined, each split into words (they use
// no quoting); comments and lines that are not commands are left out.
func quickStartCommands(t *testing.T) [][]string {
	t.Helper()
	doc := string(readRepoFile(t, "docs/deployment.md"))
	start := strings.Index(doc, "## Quick start")
	if start < 0 {
		t.Fatal(`docs/deployment.md has no "## Quick start" section`)
	}
	section := doc[start:]
	if end := strings.Index(section[2:], "\n## "); end >= 0 {
		section = section[:end+2]
	}
	var cmds [][]string
	for _, block := range strings.Split(section, "```sh\n")[1:] {
		block = block[:strings.Index(block, "```")]
		for _, line := range strings.Split(strings.ReplaceAll(block, "\\\n", " "), "\n") {
			if i := strings.Index(line, " #"); i >= 0 {
				line = line[:i]
			}
			if f := strings.Fields(line); len(f) > 0 && !strings.HasPrefix(f[0], "#") {
				cmds = append(cmds, f)
			}
		}
	}
	return cmds
}

// helmIn runs helm with the quick start's arguments from the repository
// root, where its relative chart path points.
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

// TestQuickStartCommands runs the Helm commands of the quick start: the
// install (as helm template with the same arguments, since no cluster is
// here) renders objects that decode strictly, PodMonitors with the
// kube-prometheus-stack release label among them; the sidecar patch,
// applied the way kubectl's strategic merge does to a plain SGLang
// Deployment with settings of its own, adds the sidecar and keeps them.
func TestQuickStartCommands(t *testing.T) {
	var install, patch []string
	for _, c := range quickStartCommands(t) {
		switch {
		case len(c) > 1 && c[0] == "helm" && c[1] == "install":
			install = c
		case len(c) > 1 && c[0] == "helm" && c[1] == "template" && patch == nil:
			patch = c
		}
	}
	if install == nil || patch == nil {
		t.Fatal("the quick start lacks a helm install or a helm template command")
	}
	docs, err := splitDocs("quick start install", helmIn(t, append(append([]string{"template"}, install[2:]...), "--api-versions", "monitoring.coreos.com/v1")))
	if err != nil {
		t.Fatal(err)
	}
	objs := decodeAll(t, docs)
	if len(objs.podMonitors) == 0 || len(objs.prometheusRules) == 0 {
		t.Errorf("the quick start's install renders %d PodMonitors and %d PrometheusRules", len(objs.podMonitors), len(objs.prometheusRules))
	}
	for _, pm := range objs.podMonitors {
		if pm.Labels["release"] == "" {
			t.Errorf("PodMonitor %s lacks the release label kube-prometheus-stack selects", pm.Name)
		}
	}
	args := patch[1:]
	for i, a := range args {
		if a == ">" {
			args = args[:i]
			break
		}
	}
	docs, err = splitDocs("quick start sidecar patch", helmIn(t, args))
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) == 0 {
		t.Fatal("the quick start's patch command renders nothing")
	}
	for _, d := range docs {
		if d.kind != "Deployment" {
			continue
		}
		got := patchPlainSGLang(t, strings.TrimPrefix(d.name, "sglang-"), d.json)
		c, ok := findSidecar(t, d.name, got.Spec.Template.Spec)
		if !ok || c.StartupProbe != nil {
			t.Errorf("%s: the quick start's patch adds no sidecar, or one that holds SGLang's start", d.name)
		}
		checkKeepsWorkloadSettings(t, "quick start "+d.name, got)
	}
}
