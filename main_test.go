package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/deploy"
	"github.com/sglang-watchdog/sglang-watchdog/internal/runconfig"
)

// TestSidecarArgsAreAcceptedFlags parses every Kubernetes sidecar's
// arguments (manifests, Helm chart renders, examples) with the real flag
// set, so that none can carry a flag the binary would refuse at start.
func TestSidecarArgsAreAcceptedFlags(t *testing.T) {
	all, err := deploy.SidecarArgs()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) == 0 {
		t.Fatal("no sidecar found in the manifests")
	}
	for file, args := range all {
		var o options
		cmd, err := newApp(&o).Parse(args)
		if err != nil {
			t.Errorf("%s: the binary rejects the sidecar's args: %v", file, err)
			continue
		}
		if cmd != "run" {
			t.Errorf("%s: args select command %q, want the watchdog (run)", file, cmd)
		}
		// The verdict lookups' URL template and networks, as the binary
		// checks them at start (the HTTP client file lives in the pod).
		d := o.decode
		d.PrefillHTTPConfig = ""
		if _, err := runconfig.VerdictClient(d); err != nil {
			t.Errorf("%s: the binary rejects the sidecar's verdict lookups: %v", file, err)
		}
	}
}

// TestDocsDocumentEveryFlagAndMetric keeps the references from drifting:
// every flag of every command is named in docs/configuration.md, and every
// series of the exporter's golden exposition in docs/metrics.md.
func TestDocsDocumentEveryFlagAndMetric(t *testing.T) {
	doc, err := os.ReadFile("docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	var o options
	model := newApp(&o).Model()
	check := func(where, name string) {
		if !strings.Contains(string(doc), "--"+name) {
			t.Errorf("docs/configuration.md does not document %s flag --%s", where, name)
		}
	}
	for _, f := range model.Flags {
		if !f.Hidden && f.Name != "help" && f.Name != "version" {
			check("global", f.Name)
		}
	}
	for _, c := range model.Commands {
		for _, f := range c.Flags {
			if f.Name == "web.systemd-socket" {
				continue
			}
			check(c.Name, f.Name)
		}
	}
	metrics, err := os.ReadFile("docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	golden, err := os.ReadFile("collector/testdata/exporter.golden.prom")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`(?m)^# HELP (sglang_watchdog_\w+)`).FindAllStringSubmatch(string(golden), -1) {
		if !strings.Contains(string(metrics), "`"+m[1]+"`") {
			t.Errorf("docs/metrics.md does not document metric %s", m[1])
		}
	}
}

// TestFlagsFromEnvironment checks the SGLANG_WATCHDOG_* variables that a
// sidecar is configured with, including a repeatable flag, and that the
// command line wins.
func TestFlagsFromEnvironment(t *testing.T) {
	t.Setenv("SGLANG_WATCHDOG_PLUGIN_URL", "http://127.0.0.1:28100\nhttp://127.0.0.1:28101")
	t.Setenv("SGLANG_WATCHDOG_FORCE_FAIL_MODE", "auto")
	t.Setenv("SGLANG_WATCHDOG_WATCHDOG_DEADLINE", "90s")
	var o options
	if _, err := newApp(&o).Parse([]string{"run", "--watchdog.deadline=2m"}); err != nil {
		t.Fatal(err)
	}
	if len(o.pluginURLs) != 2 || o.pluginURLs[1] != "http://127.0.0.1:28101" {
		t.Errorf("plugin URLs from the environment: %q", o.pluginURLs)
	}
	if o.watch.Mode != "auto" {
		t.Errorf("mode from the environment: %q", o.watch.Mode)
	}
	if o.watch.Deadline.String() != "2m0s" {
		t.Errorf("deadline %s: the command line must win over the environment", o.watch.Deadline)
	}
}

// TestDocsStandAlone: the project's files (docs, code, comments, tests,
// test data, the plugin) state SGLang's facts with SGLang's file and
// release, and point at nothing outside the repository. The one exception
// is a test input: the folder of SGLang's source tarballs beside the
// checkout (../shared/sglang-src), which the conformance suite runs on.
func TestDocsStandAlone(t *testing.T) {
	var files []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			// Git's own files, release builds (.build) and Python's caches
			// are not the project's text.
			if path != "." && (strings.HasPrefix(d.Name(), ".") && d.Name() != ".ci" || d.Name() == "__pycache__") {
				return filepath.SkipDir
			}
			return nil
		}
		if path != "main_test.go" {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 100 {
		t.Fatalf("found %d files; is the test running from the repository root?", len(files))
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := strings.ReplaceAll(string(b), "../shared/sglang-src", "")
		for _, bad := range []string{"sglang-facts", "../shared", "/work/shared", "facts §"} {
			if strings.Contains(text, bad) {
				t.Errorf("%s points outside the repository (%q): state the fact with its SGLang file and release", f, bad)
			}
		}
	}
}

// TestForceFailDefaultURLIsPluginDefault: force-fail without --plugin.url
// talks to rank 0 of a plugin on its default port, so the two defaults must
// move together (the plugin's moved from 30100 to 28100 in issue 19).
func TestForceFailDefaultURLIsPluginDefault(t *testing.T) {
	src, err := os.ReadFile("sglang_plugin/sglang_watchdog_plugin/config.py")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^DEFAULT_BASE_PORT = (\d+)$`).FindSubmatch(src)
	if m == nil {
		t.Fatal("config.py has no DEFAULT_BASE_PORT line")
	}
	var o options
	if _, err := newApp(&o).Parse([]string{"force-fail", "--rid=x"}); err != nil {
		t.Fatal(err)
	}
	if want := "http://127.0.0.1:" + string(m[1]); len(o.ffURLs) != 1 || o.ffURLs[0] != want {
		t.Errorf("force-fail's default --plugin.url is %q; the plugin's default port gives %q", o.ffURLs, want)
	}
}

// TestTopLevelHelpShowsRunFlags: `sglang-watchdog --help` lists every flag
// of run, the default command an operator starts, besides the global flags
// and the commands.
func TestTopLevelHelpShowsRunFlags(t *testing.T) {
	var out, errb strings.Builder
	if code := run([]string{"--help"}, &out, &errb); code != 0 {
		t.Fatalf("--help exited %d: %s", code, errb.String())
	}
	help := out.String()
	var o options
	for _, c := range newApp(&o).Model().Commands {
		if !c.Default {
			continue
		}
		for _, f := range c.Flags {
			if !f.Hidden && !strings.Contains(help, "--"+f.Name+"=") && !strings.Contains(help, "--[no-]"+f.Name+" ") {
				t.Errorf("--help does not list %s's flag --%s", c.Name, f.Name)
			}
		}
	}
	for _, want := range []string{"--log.level=info", "Commands:", "force-fail --rid=RID"} {
		if !strings.Contains(help, want) {
			t.Errorf("--help lacks %q", want)
		}
	}
}
