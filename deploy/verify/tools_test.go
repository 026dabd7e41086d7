package verify

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// toolPath finds a packaging tool that scripts/deps-release.sh builds: $NAME
// (upper case) if set, else its cache path, with the version from
// scripts/release-tools.sh. Without it the test is skipped, except in CI
// (CI set), where a missing tool is a failure.
func toolPath(t *testing.T, name string) string {
	t.Helper()
	if p := os.Getenv(strings.ToUpper(name)); p != "" {
		return p
	}
	src := string(readRepoFile(t, "scripts/release-tools.sh"))
	m := regexp.MustCompile(`(?m)^` + strings.ToUpper(name) + `_VERSION=(\S+)$`).FindStringSubmatch(src)
	if m == nil {
		t.Fatalf("scripts/release-tools.sh has no %s_VERSION", strings.ToUpper(name))
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			t.Fatal(err)
		}
		cache = filepath.Join(home, ".cache")
	}
	p := filepath.Join(cache, "sglang-watchdog", "bin", name+"-"+m[1], name)
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s %s not found at %s; scripts/deps.sh builds it", name, m[1], p)
		}
		t.Skipf("%s %s not found at %s; run scripts/deps.sh", name, m[1], p)
	}
	return p
}

// run runs a tool and returns its standard output; the error carries its
// standard error.
func run(bin string, args ...string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s: %w\n%s", filepath.Base(bin), strings.Join(args, " "), err, stderr.Bytes())
	}
	return stdout.Bytes(), nil
}
