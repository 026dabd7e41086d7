package helm

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/deploy/kubernetes/promrule"
)

const repoRoot = "../.."

// TestChartFilesUpToDate fails while the chart's copies of the rules and
// the dashboard differ from their sources, or a copy has no source.
func TestChartFilesUpToDate(t *testing.T) {
	want, err := Files(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	chart := filepath.Join(repoRoot, filepath.FromSlash(ChartDir))
	for rel, b := range want {
		got, err := os.ReadFile(filepath.Join(chart, filepath.FromSlash(rel)))
		if err != nil {
			t.Errorf("%s/%s is missing; regenerate with: %s", ChartDir, rel, promrule.Command)
			continue
		}
		if !bytes.Equal(got, b) {
			t.Errorf("%s/%s is stale; regenerate with: %s", ChartDir, rel, promrule.Command)
		}
	}
	err = filepath.WalkDir(filepath.Join(chart, "files"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(chart, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if _, ok := want[rel]; !ok && IsGenerated(rel) {
			t.Errorf("%s/%s has no source any more; regenerate with: %s", ChartDir, rel, promrule.Command)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestFilesCarryEveryRuleFile(t *testing.T) {
	files, err := Files(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	names, err := promrule.RuleFiles()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		b, ok := files[RulesDir+"/"+n]
		if !ok {
			t.Errorf("no chart copy of alerts/%s", n)
			continue
		}
		// The copy is still the same rule file.
		if _, err := promrule.ParseRuleFile(b); err != nil {
			t.Errorf("chart copy of alerts/%s: %v", n, err)
		}
	}
	if len(files[DashboardFile]) == 0 {
		t.Errorf("no dashboard in the chart files")
	}
}
