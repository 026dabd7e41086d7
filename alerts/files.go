package alerts

import (
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
)

// FS holds the rule files (*.rules.yml), embedded at build time.
//
//go:embed *.rules.yml
var FS embed.FS

// RunbookBaseURL is where every alert's runbook_url points; the fragment is the
// alert name in lower case, which is the GitHub anchor of its runbook heading.
const RunbookBaseURL = "https://github.com/sglang-watchdog/sglang-watchdog/blob/v0.1.0/docs/runbook.md"

// WatchdogJobSelector is the label matcher that watchdog.rules.yml uses to select
// the watchdog's scrape job (in SGLangWatchdogDown and SGLangWatchdogAbsent only):
// the mixin's default _config.watchdogSelector. Generators that retarget the
// rules replace this exact string (or render the mixin with their own selector).
const WatchdogJobSelector = `job=~"sglang-watchdog.*"`

// Names returns the base names of the embedded rule files, sorted.
func Names() []string {
	names, err := fs.Glob(FS, "*.rules.yml")
	if err != nil {
		// The pattern is a constant and valid; Glob only fails on a bad pattern.
		panic(err)
	}
	sort.Strings(names)
	return names
}

// Dir returns the absolute path of this package's directory in the source tree.
// It fails when the binary was built with -trimpath or the source tree is gone.
func Dir() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("alerts: cannot locate the source file of package alerts")
	}
	dir := filepath.Dir(file)
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("alerts: source path %q is not absolute (built with -trimpath?); use alerts.FS instead", dir)
	}
	return dir, nil
}

// RuleFiles returns the absolute paths of the rule files, sorted by name. The
// files are the ones embedded in FS, found in the source tree; an error means the
// source tree is not available and FS should be used instead.
func RuleFiles() ([]string, error) {
	dir, err := Dir()
	if err != nil {
		return nil, err
	}
	names := Names()
	paths := make([]string, 0, len(names))
	for _, name := range names {
		p := filepath.Join(dir, name)
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("alerts: rule file %s: %w", name, err)
		}
		paths = append(paths, p)
	}
	return paths, nil
}
