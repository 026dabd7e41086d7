// Package prombin finds the Prometheus, promtool and Alertmanager binaries
// that the tests run: Debian's packages (Prometheus 2.x, Alertmanager 0.25)
// on PATH, and the Prometheus 3.x and current Alertmanager that
// scripts/deps.sh builds from the Go module proxy into a cache folder keyed
// by version. A missing binary is an error that says how to get it: the tests
// that need one fail rather than skip.
package prombin

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// Module versions that scripts/deps.sh builds (keep both in step).
const (
	// PrometheusVersion of github.com/prometheus/prometheus: Prometheus 3.x.
	PrometheusVersion = "v0.316.0"
	// AlertmanagerVersion of github.com/prometheus/alertmanager.
	AlertmanagerVersion = "v0.35.0"
)

// Stack is one set of server binaries.
type Stack struct {
	// Name tells the stacks apart in test names: "debian" or "prometheus3".
	Name         string
	Prometheus   string
	Promtool     string
	Alertmanager string
}

// CacheDir is where scripts/deps.sh puts the binaries it builds:
// ${XDG_CACHE_HOME:-$HOME/.cache}/sglang-watchdog/bin.
func CacheDir() (string, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("prombin: %w", err)
	}
	return filepath.Join(dir, "sglang-watchdog", "bin"), nil
}

// Debian returns Debian's Prometheus 2.x, promtool and Alertmanager from PATH.
func Debian() (Stack, error) {
	s := Stack{Name: "debian"}
	for _, b := range []struct {
		dst  *string
		name string
	}{{&s.Prometheus, "prometheus"}, {&s.Promtool, "promtool"}, {&s.Alertmanager, "prometheus-alertmanager"}} {
		p, err := exec.LookPath(b.name)
		if err != nil {
			return s, fmt.Errorf("%s not found on PATH: run `bash scripts/deps.sh` (installs Debian's prometheus and prometheus-alertmanager)", b.name)
		}
		*b.dst = p
	}
	return s, nil
}

// Prometheus3 returns the Prometheus 3.x, promtool and Alertmanager that
// scripts/deps.sh built.
func Prometheus3() (Stack, error) {
	s := Stack{Name: "prometheus3"}
	dir, err := CacheDir()
	if err != nil {
		return s, err
	}
	// Built with -tags remove_all_sd: static and file service discovery only.
	prom := filepath.Join(dir, "prometheus-"+PrometheusVersion+"-nosd")
	s.Prometheus = filepath.Join(prom, "prometheus")
	s.Promtool = filepath.Join(prom, "promtool")
	s.Alertmanager = filepath.Join(dir, "alertmanager-"+AlertmanagerVersion, "alertmanager")
	for _, p := range []string{s.Prometheus, s.Promtool, s.Alertmanager} {
		if _, err := os.Stat(p); err != nil {
			return s, fmt.Errorf("%s is missing: run `bash scripts/deps.sh` (builds Prometheus %s and Alertmanager %s)", p, PrometheusVersion, AlertmanagerVersion)
		}
	}
	return s, nil
}

// All returns both stacks, Debian's first.
func All() ([]Stack, error) {
	d, err := Debian()
	if err != nil {
		return nil, err
	}
	p3, err := Prometheus3()
	if err != nil {
		return nil, err
	}
	return []Stack{d, p3}, nil
}
