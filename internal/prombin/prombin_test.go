package prombin

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// scripts/deps.sh builds the versions this package looks for.
func TestDepsScriptBuildsTheseVersions(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "scripts", "deps.sh"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"PROMETHEUS_VERSION=" + PrometheusVersion, "ALERTMANAGER_VERSION=" + AlertmanagerVersion} {
		if !strings.Contains(string(data), want) {
			t.Errorf("scripts/deps.sh does not set %s", want)
		}
	}
}

func TestAllFindsBothStacks(t *testing.T) {
	stacks, err := All()
	if err != nil {
		t.Fatal(err)
	}
	if len(stacks) != 2 || stacks[0].Name != "debian" || stacks[1].Name != "prometheus3" {
		t.Fatalf("All() = %+v", stacks)
	}
}
