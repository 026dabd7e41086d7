// Package mixin renders the sglang-watchdog monitoring mixin: the jsonnet in
// this directory (mixin.libsonnet, config.libsonnet, alerts/, dashboards/) is
// the source of the rule files under alerts/ and of dashboards/sglang-watchdog.json,
// which are its output with the default _config.
//
// From the repository root, `go generate ./mixin/` regenerates the dashboard
// base (dashboards/sglang-watchdog.json here, from the Go generator in
// ../dashboards) and renders the defaults; `go run ./mixin/render -config
// my-config.libsonnet -out DIR` renders with your own _config. The package
// test fails while a committed file differs from its rendering.
package mixin

//go:generate go run ../dashboards/gen -out dashboards/sglang-watchdog.json
//go:generate go run ./render -out ..

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"github.com/google/go-jsonnet"
)

// GenerateCommand regenerates every file the mixin renders, from the
// repository root.
const GenerateCommand = "go generate ./mixin/"

// Dir returns the absolute path of the mixin's source directory.
func Dir() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("mixin: cannot locate the source file of package mixin")
	}
	dir := filepath.Dir(file)
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("mixin: source path %q is not absolute (built with -trimpath?)", dir)
	}
	return dir, nil
}

// Render evaluates render.jsonnet with the _config overrides in configFile (a
// jsonnet object such as { scrapeInterval: '30s' }; "" for the defaults) and
// returns the rendered files by path relative to the output directory
// (alerts/*.rules.yml, dashboards/*.json).
func Render(configFile string) (map[string]string, error) {
	dir, err := Dir()
	if err != nil {
		return nil, err
	}
	vm := jsonnet.MakeVM()
	vm.Importer(&jsonnet.FileImporter{JPaths: []string{dir}})
	vm.StringOutput = true
	if configFile != "" {
		abs, err := filepath.Abs(configFile)
		if err != nil {
			return nil, err
		}
		if _, err := os.Stat(abs); err != nil {
			return nil, fmt.Errorf("mixin config: %w", err)
		}
		vm.TLACode("config", "import "+jsonnetString(abs))
	}
	files, err := vm.EvaluateFileMulti(filepath.Join(dir, "render.jsonnet"))
	if err != nil {
		return nil, fmt.Errorf("rendering the mixin: %w", err)
	}
	return files, nil
}

// Write renders the mixin and writes its files under outDir, creating the
// folders it needs. It returns the paths written, sorted.
func Write(configFile, outDir string) ([]string, error) {
	files, err := Render(configFile)
	if err != nil {
		return nil, err
	}
	var written []string
	for _, name := range sortedKeys(files) {
		p := filepath.Join(outDir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return nil, err
		}
		if err := os.WriteFile(p, []byte(files[name]), 0o644); err != nil {
			return nil, err
		}
		written = append(written, p)
	}
	return written, nil
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// jsonnetString quotes s as a jsonnet string literal.
func jsonnetString(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}
