// Command gen writes deploy/kubernetes/monitoring/prometheusrule-*.yaml, one
// prometheus-operator PrometheusRule per rule file of alerts/, and the Helm
// chart's copies of alerts/*.rules.yml and dashboards/sglang-watchdog.json
// (deploy/helm/sglang-watchdog/files/).
//
// Run it from anywhere inside the repository:
//
//	go run ./deploy/kubernetes/gen
//
// It also removes generated files whose source no longer exists.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/sglang-watchdog/sglang-watchdog/deploy/helm"
	"github.com/sglang-watchdog/sglang-watchdog/deploy/kubernetes/promrule"
)

const modulePath = "github.com/sglang-watchdog/sglang-watchdog"

func main() {
	dir := flag.String("dir", "", "deploy/kubernetes directory to write into (default: found from the module root)")
	flag.Parse()
	if err := run(*dir); err != nil {
		fmt.Fprintln(os.Stderr, "gen:", err)
		os.Exit(1)
	}
	if *dir == "" {
		if err := writeChartFiles(); err != nil {
			fmt.Fprintln(os.Stderr, "gen:", err)
			os.Exit(1)
		}
	}
}

// writeChartFiles refreshes the chart's generated copies under
// deploy/helm/sglang-watchdog/files.
func writeChartFiles() error {
	root, err := moduleRoot()
	if err != nil {
		return err
	}
	files, err := helm.Files(root)
	if err != nil {
		return err
	}
	chart := filepath.Join(root, filepath.FromSlash(helm.ChartDir))
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		if err := writeIfChanged(filepath.Join(chart, filepath.FromSlash(p)), path.Join(helm.ChartDir, p), files[p]); err != nil {
			return err
		}
	}
	return filepath.WalkDir(filepath.Join(chart, "files"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(chart, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if _, keep := files[rel]; keep || !helm.IsGenerated(rel) {
			return nil
		}
		if err := os.Remove(p); err != nil {
			return err
		}
		fmt.Printf("removed   %s\n", path.Join(helm.ChartDir, rel))
		return nil
	})
}

func writeIfChanged(dst, name string, data []byte) error {
	if old, err := os.ReadFile(dst); err == nil && bytes.Equal(old, data) {
		fmt.Printf("unchanged %s\n", name)
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(dst, data, 0o644); err != nil {
		return err
	}
	fmt.Printf("wrote     %s\n", name)
	return nil
}

func run(dir string) error {
	if dir == "" {
		root, err := moduleRoot()
		if err != nil {
			return err
		}
		dir = filepath.Join(root, "deploy", "kubernetes")
	}
	files, err := promrule.RenderAll()
	if err != nil {
		return err
	}
	outDir := filepath.Join(dir, filepath.FromSlash(promrule.Dir))
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return err
	}
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		if err := writeIfChanged(filepath.Join(dir, filepath.FromSlash(p)), p, files[p]); err != nil {
			return err
		}
	}
	// Remove manifests of rule files that are gone.
	stale, err := filepath.Glob(filepath.Join(outDir, promrule.FilePrefix+"*.yaml"))
	if err != nil {
		return err
	}
	for _, f := range stale {
		rel := filepath.ToSlash(filepath.Join(promrule.Dir, filepath.Base(f)))
		if _, keep := files[rel]; keep {
			continue
		}
		if err := os.Remove(f); err != nil {
			return err
		}
		fmt.Printf("removed   %s\n", rel)
	}
	return nil
}

// moduleRoot walks up from the working directory to this module's go.mod.
func moduleRoot() (string, error) {
	d, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(d, "go.mod"))
		if err == nil && isThisModule(data) {
			return d, nil
		}
		parent := filepath.Dir(d)
		if parent == d {
			return "", errors.New("not inside the " + modulePath + " module; run from the repository or pass -dir")
		}
		d = parent
	}
}

func isThisModule(gomod []byte) bool {
	for _, line := range strings.Split(string(gomod), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == "module" && strings.Trim(f[1], `"`) == modulePath {
			return true
		}
	}
	return false
}
