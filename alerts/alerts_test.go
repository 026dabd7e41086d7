package alerts

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	yaml "go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/internal/prombin"
)

// promtools returns Debian's promtool 2.x and the promtool 3.x that
// scripts/deps.sh builds, failing the test when either is missing: the rule
// tests are part of the suite, never silently skipped, and the rules must mean
// the same on both versions.
func promtools(t *testing.T) []prombin.Stack {
	t.Helper()
	stacks, err := prombin.All()
	if err != nil {
		t.Fatal(err)
	}
	return stacks
}

func runPromtool(t *testing.T, promtool, dir string, args ...string) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), promtool, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", promtool, strings.Join(args, " "), err, out)
	}
	t.Logf("%s %s:\n%s", promtool, strings.Join(args, " "), out)
}

func ruleFiles(t *testing.T) []string {
	t.Helper()
	files, err := RuleFiles()
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 2 {
		t.Fatalf("RuleFiles() = %v, want watchdog.rules.yml and sglang-raw.rules.yml at least", files)
	}
	return files
}

func testFiles(t *testing.T) []string {
	t.Helper()
	dir, err := Dir()
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join(dir, "*_test.yml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no promtool test files (*_test.yml) in %s", dir)
	}
	sort.Strings(files)
	return files
}

func TestPromtoolCheckRules(t *testing.T) {
	files := ruleFiles(t)
	for _, s := range promtools(t) {
		t.Run(s.Name, func(t *testing.T) {
			runPromtool(t, s.Promtool, filepath.Dir(files[0]), append([]string{"check", "rules"}, files...)...)
		})
	}
}

func TestPromtoolTestRules(t *testing.T) {
	for _, s := range promtools(t) {
		for _, f := range testFiles(t) {
			t.Run(s.Name+"/"+filepath.Base(f), func(t *testing.T) {
				runPromtool(t, s.Promtool, filepath.Dir(f), "test", "rules", f)
			})
		}
	}
}

func TestRuleFilesMatchEmbed(t *testing.T) {
	files := ruleFiles(t)
	names := Names()
	if len(files) != len(names) {
		t.Fatalf("RuleFiles() has %d files, FS has %d", len(files), len(names))
	}
	for i, f := range files {
		if !filepath.IsAbs(f) {
			t.Errorf("%s is not absolute", f)
		}
		if filepath.Base(f) != names[i] {
			t.Errorf("RuleFiles()[%d] = %s, want %s", i, f, names[i])
		}
		onDisk, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		embedded, err := FS.ReadFile(names[i])
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(onDisk, embedded) {
			t.Errorf("%s differs from its embedded copy", f)
		}
	}
}

type rule struct {
	Alert       string            `yaml:"alert"`
	Record      string            `yaml:"record"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []rule `yaml:"rules"`
	} `yaml:"groups"`
}

type alertRule struct {
	rule
	file  string // base name of the rule file
	group string
}

func loadAlerts(t *testing.T) []alertRule {
	t.Helper()
	var all []alertRule
	for _, name := range Names() {
		data, err := FS.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		var rf ruleFile
		if err := yaml.Unmarshal(data, &rf); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(rf.Groups) == 0 {
			t.Errorf("%s: no rule groups", name)
		}
		for _, g := range rf.Groups {
			for _, r := range g.Rules {
				if r.Alert == "" {
					continue
				}
				all = append(all, alertRule{rule: r, file: name, group: g.Name})
			}
		}
	}
	if len(all) == 0 {
		t.Fatal("no alerting rules found")
	}
	return all
}

var (
	alertNameRE  = regexp.MustCompile(`^SGLang[A-Z][A-Za-z0-9]*$`)
	severities   = map[string]bool{"critical": true, "warning": true, "info": true}
	templateRE   = regexp.MustCompile(`\{\{.*?\}\}`)
	watchdogFile = "watchdog.rules.yml"
	rawFile      = "sglang-raw.rules.yml"
)

func TestAlertConventions(t *testing.T) {
	// An alert may have one rule per severity (a stuck request pages in
	// auto mode and warns in the others), in one file, never two rules
	// of the same severity.
	seen := map[string]string{}
	for _, a := range loadAlerts(t) {
		t.Run(a.Alert, func(t *testing.T) {
			key := a.Alert + "/" + a.Labels["severity"]
			if prev, dup := seen[key]; dup {
				t.Errorf("alert name with severity %q also defined in %s", a.Labels["severity"], prev)
			}
			if prev, dup := seen[a.Alert]; dup && prev != a.file {
				t.Errorf("alert name also defined in %s", prev)
			}
			seen[key], seen[a.Alert] = a.file, a.file

			if !alertNameRE.MatchString(a.Alert) {
				t.Errorf("name is not CamelCase with the SGLang prefix (want %s)", alertNameRE)
			}
			switch a.file {
			case watchdogFile:
				if !strings.HasPrefix(a.Alert, "SGLangWatchdog") || a.group != "sglang-watchdog" {
					t.Errorf("alerts in %s must be named SGLangWatchdog... in group sglang-watchdog (group %q)", a.file, a.group)
				}
			case rawFile:
				if strings.HasPrefix(a.Alert, "SGLangWatchdog") || a.group != "sglang-raw" {
					t.Errorf("alerts in %s must not be named SGLangWatchdog... and live in group sglang-raw (group %q)", a.file, a.group)
				}
				if strings.Contains(a.Expr, "sglang_watchdog_") {
					t.Errorf("%s is for users without the watchdog but uses a watchdog metric", a.file)
				}
			}

			if sev := a.Labels["severity"]; !severities[sev] {
				t.Errorf("severity %q, want one of critical, warning, info", sev)
			}
			for _, k := range []string{"summary", "description", "runbook_url"} {
				if strings.TrimSpace(a.Annotations[k]) == "" {
					t.Errorf("annotation %s is missing", k)
				}
			}
			if s := a.Annotations["summary"]; strings.Contains(s, "{{") || !strings.HasSuffix(s, ".") {
				t.Errorf("summary %q must be a static sentence ending with a period", s)
			}
			// An absent() alert has no labels, and its value is always 1.
			if d := a.Annotations["description"]; !templateRE.MatchString(d) && !strings.HasPrefix(strings.TrimSpace(a.Expr), "absent(") {
				t.Errorf("description %q is not templated with labels or the value", d)
			}
			if want := RunbookBaseURL + "#" + strings.ToLower(a.Alert); a.Annotations["runbook_url"] != want {
				t.Errorf("runbook_url = %q, want %q", a.Annotations["runbook_url"], want)
			}
		})
	}
}

// TestRawRuleGuards checks the two promtool gotchas statically, in addition to the
// promtool cases that exercise them: every min_over_time window over a gauge comes
// with a count_over_time full-window guard over the same selector and window, and
// every unless between expressions names its matching labels.
func TestRawRuleGuards(t *testing.T) {
	minRE := regexp.MustCompile(`min_over_time\(([^\[]+)\[([^\]]+)\]\)`)
	setOpRE := regexp.MustCompile(`\b(and|unless)\b(\s*)(\S*)`)
	for _, a := range loadAlerts(t) {
		for _, m := range minRE.FindAllStringSubmatch(a.Expr, -1) {
			guard := regexp.MustCompile(`count_over_time\(` + regexp.QuoteMeta(m[1]) + `\[` + regexp.QuoteMeta(m[2]) + `\]\)\s*>=\s*\d+`)
			if !guard.MatchString(a.Expr) {
				t.Errorf("%s: min_over_time(%s[%s]) has no count_over_time(...) >= N full-window guard", a.Alert, m[1], m[2])
			}
		}
		for _, m := range setOpRE.FindAllStringSubmatch(a.Expr, -1) {
			// "and" between the conditions on one gauge shares its label set; any
			// and/unless that brings in another family must say on (...).
			if m[1] == "unless" && m[3] != "on" {
				t.Errorf("%s: %q without on (...): SGLang families carry different label sets", a.Alert, m[0])
			}
		}
	}
}

func TestWatchdogJobSelector(t *testing.T) {
	data, err := FS.ReadFile(watchdogFile)
	if err != nil {
		t.Fatal(err)
	}
	upRE := regexp.MustCompile(`\bup\{([^}]*)\}`)
	n := 0
	for _, a := range loadAlerts(t) {
		for _, m := range upRE.FindAllStringSubmatch(a.Expr, -1) {
			n++
			if m[1] != WatchdogJobSelector {
				t.Errorf("%s selects up{%s}, want up{%s} (alerts.WatchdogJobSelector)", a.Alert, m[1], WatchdogJobSelector)
			}
		}
	}
	if n == 0 {
		t.Errorf("no rule selects up{%s}", WatchdogJobSelector)
	}
	if !strings.Contains(string(data), WatchdogJobSelector) {
		t.Errorf("%s header does not document %s", watchdogFile, WatchdogJobSelector)
	}
}

// githubAnchors returns the anchors GitHub generates for the Markdown headings.
func githubAnchors(markdown string) map[string]bool {
	anchors := map[string]bool{}
	count := map[string]int{}
	inFence := false
	sc := bufio.NewScanner(strings.NewReader(markdown))
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "```") || strings.HasPrefix(trimmed, "~~~") {
			inFence = !inFence
			continue
		}
		if inFence || !strings.HasPrefix(line, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(line, "#"))
		if text == strings.TrimSpace(line) { // "#foo" is not a heading
			continue
		}
		anchor := githubSlug(text)
		if n := count[anchor]; n > 0 {
			anchors[anchor+"-"+strconv.Itoa(n)] = true
		} else {
			anchors[anchor] = true
		}
		count[anchor]++
	}
	return anchors
}

func githubSlug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9'):
			b.WriteRune(r)
		case r > 127: // GitHub keeps non-ASCII letters
			b.WriteRune(r)
		}
	}
	return b.String()
}

func TestGithubSlug(t *testing.T) {
	for in, want := range map[string]string{
		"SGLangWatchdogRequestStuck":        "sglangwatchdogrequeststuck",
		"Force-failing a request by hand":   "force-failing-a-request-by-hand",
		"When a restart is the only remedy": "when-a-restart-is-the-only-remedy",
		"`inflight` (the CLI)":              "inflight-the-cli",
	} {
		if got := githubSlug(in); got != want {
			t.Errorf("githubSlug(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestRunbookAnchors(t *testing.T) {
	dir, err := Dir()
	if err != nil {
		t.Fatal(err)
	}
	runbook := filepath.Join(dir, "..", "docs", "runbook.md")
	data, err := os.ReadFile(runbook)
	if err != nil {
		t.Fatalf("runbook: %v", err)
	}
	anchors := githubAnchors(string(data))
	// The runbook's own links between sections must resolve as well.
	for _, m := range regexp.MustCompile(`\]\(#([^)]+)\)`).FindAllStringSubmatch(string(data), -1) {
		if !anchors[m[1]] {
			t.Errorf("docs/runbook.md links to #%s, which is not a heading", m[1])
		}
	}
	for _, a := range loadAlerts(t) {
		u := a.Annotations["runbook_url"]
		i := strings.LastIndex(u, "#")
		if i < 0 {
			t.Errorf("%s: runbook_url %q has no anchor", a.Alert, u)
			continue
		}
		if !anchors[u[i+1:]] {
			t.Errorf("%s: anchor #%s is not a heading of docs/runbook.md (add \"## %s\")", a.Alert, u[i+1:], a.Alert)
		}
	}
}

type promtoolTestFile struct {
	RuleFiles []string `yaml:"rule_files"`
	Tests     []struct {
		Name          string `yaml:"name"`
		AlertRuleTest []struct {
			EvalTime  string `yaml:"eval_time"`
			Alertname string `yaml:"alertname"`
			ExpAlerts []struct {
				ExpLabels      map[string]string `yaml:"exp_labels"`
				ExpAnnotations map[string]string `yaml:"exp_annotations"`
			} `yaml:"exp_alerts"`
		} `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

// TestEveryAlertHasPromtoolCases requires, for every alert, a promtool case where
// it fires (with its annotations spelled out) and one where it stays silent, in a
// test file that loads the alert's rule file.
func TestEveryAlertHasPromtoolCases(t *testing.T) {
	type cover struct{ fires, silent bool }
	covered := map[string]*cover{} // key: rule file + "/" + alert name
	for _, f := range testFiles(t) {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var tf promtoolTestFile
		if err := yaml.Unmarshal(data, &tf); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, rf := range tf.RuleFiles {
			for _, tc := range tf.Tests {
				for _, art := range tc.AlertRuleTest {
					key := filepath.Base(rf) + "/" + art.Alertname
					c := covered[key]
					if c == nil {
						c = &cover{}
						covered[key] = c
					}
					if len(art.ExpAlerts) == 0 {
						c.silent = true
						continue
					}
					c.fires = true
					for _, e := range art.ExpAlerts {
						if e.ExpLabels["severity"] == "" || e.ExpAnnotations["runbook_url"] == "" {
							t.Errorf("%s: test %q at %s expects %s without its severity label or annotations",
								filepath.Base(f), tc.Name, art.EvalTime, art.Alertname)
						}
					}
				}
			}
		}
	}
	for _, a := range loadAlerts(t) {
		c := covered[a.file+"/"+a.Alert]
		switch {
		case c == nil:
			t.Errorf("%s (%s) has no promtool test case", a.Alert, a.file)
		case !c.fires:
			t.Errorf("%s (%s) has no promtool case where it fires", a.Alert, a.file)
		case !c.silent:
			t.Errorf("%s (%s) has no promtool case where it stays silent", a.Alert, a.file)
		}
	}
}
