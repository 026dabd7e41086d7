package deploy

import (
	"os/exec"
	"strings"
	"testing"
)

// TestMakefileTargets: the conventional targets exist and run the project's
// scripts (make -n prints the commands without running them), and the image
// is built from promu's snapshot, not by a build of its own.
func TestMakefileTargets(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not found")
	}
	for target, want := range map[string][]string{
		"build":            {"bash scripts/build.sh"},
		"test":             {"bash scripts/test.sh"},
		"lint":             {"bash scripts/lint.sh"},
		"release-snapshot": {"bash scripts/release-snapshot.sh .build"},
		"image":            {"bash scripts/release-snapshot.sh .build", "docker buildx build", "--platform linux/amd64,linux/arm64"},
		"generate":         {"go generate ./mixin/", "go run ./deploy/kubernetes/gen"},
	} {
		out, err := exec.Command("make", "-n", "-C", repoRoot, target).CombinedOutput()
		if err != nil {
			t.Errorf("make -n %s: %v\n%s", target, err, out)
			continue
		}
		for _, w := range want {
			if !strings.Contains(string(out), w) {
				t.Errorf("make %s does not run %q:\n%s", target, w, out)
			}
		}
	}
	// Without a vulnerability database, vulncheck fails and says why.
	out, err := exec.Command("make", "-s", "-C", repoRoot, "vulncheck", "GOVULNDB=").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "set GOVULNDB=file:///") {
		t.Errorf("make vulncheck without GOVULNDB: %v\n%s", err, out)
	}
}
