package mixin

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-jsonnet"
	yaml "go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/alerts"
	"github.com/sglang-watchdog/sglang-watchdog/dashboards"
	"github.com/sglang-watchdog/sglang-watchdog/internal/prombin"
)

// ExampleConfig is the _config override file the README's render command uses.
const ExampleConfig = "mixin/example-config.libsonnet"

func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := Dir()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Dir(dir)
}

func render(t *testing.T, config string) map[string]string {
	t.Helper()
	files, err := Render(config)
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// The rule files and the dashboard in the repository are the mixin rendered
// with its defaults, and nothing else is there.
func TestCommittedFilesAreRendered(t *testing.T) {
	root := repoRoot(t)
	files := render(t, "")
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Errorf("%s: %v; run `%s`", name, err, GenerateCommand)
			continue
		}
		if string(got) != want {
			t.Errorf("%s is stale: run `%s` and commit the result (never edit it by hand)", name, GenerateCommand)
		}
	}
	for _, pattern := range []string{"alerts/*.rules.yml", "dashboards/*.json"} {
		on, err := filepath.Glob(filepath.Join(root, pattern))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range on {
			rel, _ := filepath.Rel(root, p)
			if _, ok := files[filepath.ToSlash(rel)]; !ok {
				t.Errorf("%s is not rendered by the mixin: add it to mixin/ or remove it", rel)
			}
		}
	}
	if len(files) != 3 {
		t.Errorf("rendered %d files, want two rule files and one dashboard: %v", len(files), keys(files))
	}
}

// With the default _config the rendered dashboard is the Go generator's base
// dashboard, so the dashboards package's tests hold for the shipped file.
func TestDefaultDashboardIsTheBase(t *testing.T) {
	files := render(t, "")
	base, err := dashboards.JSON()
	if err != nil {
		t.Fatal(err)
	}
	var want, got any
	if err := json.Unmarshal(base, &want); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(files["dashboards/sglang-watchdog.json"]), &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Error("the default rendering differs from the Go generator's dashboard: a _config default in config.libsonnet no longer matches the dashboards package")
	}
}

// The defaults in config.libsonnet are the constants the Go code and the
// other generators use.
func TestDefaultsMatchGo(t *testing.T) {
	cfg := evalConfig(t, "")
	for _, c := range []struct{ key, got, want string }{
		{"watchdogSelector", cfg.WatchdogSelector, alerts.WatchdogJobSelector},
		{"runbookURLPattern", cfg.RunbookURLPattern, alerts.RunbookBaseURL + "#%s"},
		{"dashboardUID", cfg.DashboardUID, dashboards.UID},
		{"dashboardTitle", cfg.DashboardTitle, dashboards.Title},
		{"clusterLabel", cfg.ClusterLabel, "cluster"},
		{"sglangSelector", cfg.SGLangSelector, ""},
	} {
		if c.got != c.want {
			t.Errorf("_config.%s = %q, want %q", c.key, c.got, c.want)
		}
	}
	if cfg.ShowMultiCluster {
		t.Error("_config.showMultiCluster defaults to true; the base dashboard hides the cluster variable")
	}
}

type config struct {
	WatchdogSelector  string   `json:"watchdogSelector"`
	SGLangSelector    string   `json:"sglangSelector"`
	ClusterLabel      string   `json:"clusterLabel"`
	ShowMultiCluster  bool     `json:"showMultiCluster"`
	ScrapeInterval    string   `json:"scrapeInterval"`
	RunbookURLPattern string   `json:"runbookURLPattern"`
	DashboardUID      string   `json:"dashboardUID"`
	DashboardTitle    string   `json:"dashboardTitle"`
	DashboardTags     []string `json:"dashboardTags"`
}

func evalConfig(t *testing.T, override string) config {
	t.Helper()
	dir, err := Dir()
	if err != nil {
		t.Fatal(err)
	}
	vm := jsonnet.MakeVM()
	vm.Importer(&jsonnet.FileImporter{JPaths: []string{dir}})
	snippet := "((import 'mixin.libsonnet') + { _config+:: " + override + " })._config"
	if override == "" {
		snippet = "(import 'mixin.libsonnet')._config"
	}
	out, err := vm.EvaluateAnonymousSnippet("config.jsonnet", snippet)
	if err != nil {
		t.Fatal(err)
	}
	var c config
	if err := json.Unmarshal([]byte(out), &c); err != nil {
		t.Fatal(err)
	}
	return c
}

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// seriesRE finds the series a rule selects: the watchdog's metrics, up,
// and SGLang's own, each with its matchers if any.
var seriesRE = regexp.MustCompile(`\b(sglang_watchdog_[a-z_]+|sglang:[a-z_]+|up)\b(\{[^}]*\})?`)

// TestRulesLint holds the rules to what mixtool's lint and the
// kubernetes-mixin conventions ask, on the example config (which sets both
// selectors): every series a rule selects carries its group's job selector,
// descriptions name the pod as namespace/pod rather than an instance (a
// pod IP), every alert has a severity, summary, description and runbook,
// and SGLangWatchdogAbsent's description is a template.
func TestRulesLint(t *testing.T) {
	files := render(t, filepath.Join(repoRoot(t), ExampleConfig))
	selectors := map[string]string{
		"alerts/watchdog.rules.yml":   `job="llm/sglang-watchdog"`,
		"alerts/sglang-raw.rules.yml": `job="llm/sglang"`,
	}
	for name, sel := range selectors {
		var rf ruleFile
		if err := yaml.Unmarshal([]byte(files[name]), &rf); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, g := range rf.Groups {
			for _, r := range g.Rules {
				for _, m := range seriesRE.FindAllStringSubmatch(r.Expr, -1) {
					if !strings.Contains(m[2], sel) {
						t.Errorf("%s %s: %s%s lacks the selector %s", name, r.Alert, m[1], m[2], sel)
					}
				}
				if r.Alert == "" {
					continue
				}
				desc := r.Annotations["description"]
				if r.Labels["severity"] == "" || r.Annotations["summary"] == "" || desc == "" || r.Annotations["runbook_url"] == "" {
					t.Errorf("%s %s: want a severity, a summary, a description and a runbook_url", name, r.Alert)
				}
				if strings.Contains(desc, "$labels.instance") && !strings.Contains(desc, "{{ with $labels.pod }}{{ $labels.namespace }}/{{ . }}{{ else }}{{ $labels.instance }}{{ end }}") {
					t.Errorf("%s %s: the description names the instance without namespace/pod: %s", name, r.Alert, desc)
				}
				if r.Alert == "SGLangWatchdogAbsent" && !strings.Contains(desc, "{{") {
					t.Errorf("%s %s: the description is no template: %s", name, r.Alert, desc)
				}
			}
		}
	}
}

// jsonnetfile.json lets jsonnet-bundler vendor the mixin; it depends on
// nothing outside mixin/, so it lists no dependencies.
func TestJsonnetfile(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(repoRoot(t), "mixin", "jsonnetfile.json"))
	if err != nil {
		t.Fatal(err)
	}
	var jf struct {
		Version      int   `json:"version"`
		Dependencies []any `json:"dependencies"`
	}
	if err := json.Unmarshal(raw, &jf); err != nil {
		t.Fatal(err)
	}
	if jf.Version != 1 || len(jf.Dependencies) != 0 {
		t.Errorf("jsonnetfile.json: version %d, %d dependencies; want version 1 and none", jf.Version, len(jf.Dependencies))
	}
	imports := regexp.MustCompile(`import(str)? '([^']+)'`)
	err = filepath.WalkDir(filepath.Join(repoRoot(t), "mixin"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if !strings.HasSuffix(p, ".libsonnet") && !strings.HasSuffix(p, ".jsonnet") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range imports.FindAllStringSubmatch(string(src), -1) {
			if strings.HasPrefix(m[2], "github.com/") {
				t.Errorf("%s imports %s: a dependency jsonnetfile.json does not list", p, m[2])
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Every setting of the example config reaches the rendered files.
func TestExampleConfig(t *testing.T) {
	files := render(t, filepath.Join(repoRoot(t), ExampleConfig))
	var exprs []string
	for _, name := range []string{"alerts/watchdog.rules.yml", "alerts/sglang-raw.rules.yml"} {
		var rf ruleFile
		if err := yaml.Unmarshal([]byte(files[name]), &rf); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, g := range rf.Groups {
			for _, r := range g.Rules {
				exprs = append(exprs, r.Expr)
				if want := "https://runbooks.example.com/sglang#" + strings.ToLower(r.Alert); r.Annotations["runbook_url"] != want {
					t.Errorf("%s: runbook_url %q, want %q", r.Alert, r.Annotations["runbook_url"], want)
				}
			}
		}
	}
	all := strings.Join(exprs, "\n")
	// 30s scrape: 5m windows become 5m15s and the full-window guard 9 samples.
	for _, want := range []string{
		`[5m15s]`, `[10m15s]`, `[15m15s]`, `>= 9`,
		`up{job="llm/sglang-watchdog"} == 0`,
		`sglang:num_prefill_inflight_queue_reqs{priority="", job="llm/sglang"}`,
		`sglang:num_requests_total{job="llm/sglang"}`,
		`on (k8s_cluster, instance)`, `by (k8s_cluster, instance)`,
	} {
		if !strings.Contains(all, want) {
			t.Errorf("rendered rules lack %q", want)
		}
	}
	for _, unwanted := range []string{`[5m7s500ms]`, `>= 18`, `sglang-watchdog.*`, `(cluster, `} {
		if strings.Contains(all, unwanted) {
			t.Errorf("rendered rules still hold the default %q", unwanted)
		}
	}

	var d struct {
		UID        string   `json:"uid"`
		Title      string   `json:"title"`
		Tags       []string `json:"tags"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query string `json:"query"`
				Hide  int    `json:"hide"`
			} `json:"list"`
		} `json:"templating"`
	}
	text := files["dashboards/sglang-watchdog.json"]
	if err := json.Unmarshal([]byte(text), &d); err != nil {
		t.Fatal(err)
	}
	if d.UID != "sglang-watchdog-llm" || d.Title != "SGLang PD watchdog (llm)" || !reflect.DeepEqual(d.Tags, []string{"sglang", "llm"}) {
		t.Errorf("uid %q, title %q, tags %v", d.UID, d.Title, d.Tags)
	}
	for _, v := range d.Templating.List {
		switch v.Name {
		case "cluster":
			if v.Hide != 0 || v.Query != `label_values(sglang_watchdog_build_info{job="llm/sglang-watchdog"}, k8s_cluster)` {
				t.Errorf("cluster variable: hide %d, query %q", v.Hide, v.Query)
			}
		case "job":
			if !strings.Contains(v.Query, `job="llm/sglang-watchdog"`) {
				t.Errorf("job variable query %q does not use the watchdog selector", v.Query)
			}
		}
	}
	if n := strings.Count(text, `k8s_cluster=~\"$cluster\"`); n < 40 {
		t.Errorf("only %d queries filter by k8s_cluster", n)
	}
	if strings.Contains(text, `"cluster=~`) || strings.Contains(text, ` cluster=~`) || strings.Contains(text, `{cluster=~`) {
		t.Error("the dashboard still filters by the default cluster label")
	}
}

// The rendered rules of the example config load in promtool 2 and 3.
func TestExampleConfigPassesPromtool(t *testing.T) {
	stacks, err := prombin.All()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	written, err := Write(filepath.Join(repoRoot(t), ExampleConfig), dir)
	if err != nil {
		t.Fatal(err)
	}
	var rules []string
	for _, p := range written {
		if strings.HasSuffix(p, ".rules.yml") {
			rules = append(rules, p)
		}
	}
	for _, s := range stacks {
		out, err := exec.Command(s.Promtool, append([]string{"check", "rules"}, rules...)...).CombinedOutput()
		if err != nil {
			t.Errorf("%s: promtool check rules: %v\n%s", s.Name, err, out)
		}
	}
}

// exampleWindowTest is a promtool unit test of the example config's rules at
// its 30s scrape: the inflight gauge last changes at 1m30s and stays at 1 with
// no progress, so the 5m window is clean from 7m and `for: 5m` fires at 12m,
// not one evaluation earlier, on Prometheus 2 and 3 alike.
const exampleWindowTest = `rule_files: [sglang-raw.rules.yml]
evaluation_interval: 30s
tests:
  - interval: 30s
    input_series:
      - series: 'sglang:num_prefill_inflight_queue_reqs{instance="a:30000",job="llm/sglang",k8s_cluster="eu"}'
        values: '2 3 1 2 1x40'
      - series: 'sglang:num_requests_total{instance="a:30000",job="llm/sglang",k8s_cluster="eu"}'
        values: '90+1x3 94x40'
      # Another cluster's busy server with the same instance must not silence it.
      - series: 'sglang:num_requests_total{instance="a:30000",job="llm/sglang",k8s_cluster="us"}'
        values: '0+5x44'
      # A job the sglangSelector leaves out never alerts.
      - series: 'sglang:num_prefill_inflight_queue_reqs{instance="b:30000",job="other",k8s_cluster="eu"}'
        values: '1x44'
    alert_rule_test:
      - eval_time: 11m30s
        alertname: SGLangPrefillInflightQueuePinned
        exp_alerts: []
      - eval_time: 12m
        alertname: SGLangPrefillInflightQueuePinned
        exp_alerts:
          - exp_labels:
              severity: warning
              instance: a:30000
              job: llm/sglang
              k8s_cluster: eu
            exp_annotations:
              summary: The SGLang prefill inflight queue gauge is pinned with no request completing.
              description: sglang:num_prefill_inflight_queue_reqs on a:30000 has stayed at 1 for at least 10 minutes while no KV transfer finished or failed and no request completed. Likely stuck request(s) holding KV pages.
              runbook_url: https://runbooks.example.com/sglang#sglangprefillinflightqueuepinned
`

func TestExampleConfigWindowsOnBothPromtools(t *testing.T) {
	stacks, err := prombin.All()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if _, err := Write(filepath.Join(repoRoot(t), ExampleConfig), dir); err != nil {
		t.Fatal(err)
	}
	test := filepath.Join(dir, "alerts", "window_test.yml")
	if err := os.WriteFile(test, []byte(exampleWindowTest), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, s := range stacks {
		cmd := exec.Command(s.Promtool, "test", "rules", test)
		cmd.Dir = filepath.Dir(test)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s: promtool test rules: %v\n%s", s.Name, err, out)
		}
	}
}

func TestDurations(t *testing.T) {
	dir, err := Dir()
	if err != nil {
		t.Fatal(err)
	}
	vm := jsonnet.MakeVM()
	vm.Importer(&jsonnet.FileImporter{JPaths: []string{dir}})
	eval := func(code string) (string, error) {
		return vm.EvaluateAnonymousSnippet("t.jsonnet", "local w = import 'lib/windows.libsonnet'; local d = import 'lib/duration.libsonnet'; "+code)
	}
	for code, want := range map[string]string{
		`d.millis('5m7s500ms')`:     "307500",
		`d.millis('1h')`:            "3600000",
		`d.format(307500)`:          `"5m7s500ms"`,
		`d.format(0)`:               `"0s"`,
		`d.format(90061001)`:        `"1d1h1m1s1ms"`,
		`w.range('5m', '15s')`:      `"5m7s500ms"`,
		`w.range('10m', '1m')`:      `"10m30s"`,
		`w.minSamples('5m', '15s')`: "18",
		`w.minSamples('5m', '30s')`: "9",
		`w.minSamples('5m', '10s')`: "27",
	} {
		got, err := eval(code)
		if err != nil {
			t.Errorf("%s: %v", code, err)
			continue
		}
		if strings.TrimSpace(got) != want {
			t.Errorf("%s = %s, want %s", code, strings.TrimSpace(got), want)
		}
	}
	for _, code := range []string{`d.millis('15')`, `d.millis('5x')`, `d.millis('')`, `d.millis('m')`, `w.minSamples('30s', '15s')`} {
		if _, err := eval(code); err == nil {
			t.Errorf("%s: no error", code)
		}
	}
}

// README.md's "Use the mixin" section shows the commands that scripts/test.sh
// runs and that these tests mirror.
func TestReadmeShowsTheCommands(t *testing.T) {
	root := repoRoot(t)
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)## Use the mixin\n(.*?)\n## ").FindSubmatch(readme)
	if m == nil {
		t.Fatal(`README.md has no "## Use the mixin" section`)
	}
	script, err := os.ReadFile(filepath.Join(root, "scripts", "test.sh"))
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{GenerateCommand, "go run ./mixin/render -config " + ExampleConfig + " -out "} {
		if !strings.Contains(string(m[1]), cmd) {
			t.Errorf("README's \"Use the mixin\" lacks %q", cmd)
		}
	}
	// Every command line of the section's sh block runs in scripts/test.sh.
	block := regexp.MustCompile("(?s)```sh\n(.*?)```").FindSubmatch(m[1])
	if block == nil {
		t.Fatal(`"Use the mixin" has no sh block`)
	}
	for _, line := range strings.Split(string(block[1]), "\n") {
		cmd := strings.TrimSpace(strings.SplitN(line, "#", 2)[0])
		if cmd != "" && !strings.Contains(string(script), cmd) {
			t.Errorf("README command %q is not run by scripts/test.sh", cmd)
		}
	}
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
