package dashboards

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"

	"github.com/sglang-watchdog/sglang-watchdog/internal/prombin"
)

// ---------------------------------------------------------------------------
// Generated file

func TestCommittedJSONIsUpToDate(t *testing.T) {
	want, err := JSON()
	if err != nil {
		t.Fatalf("generating dashboard: %v", err)
	}
	got, err := os.ReadFile(FileName)
	if err != nil {
		t.Fatalf("reading committed dashboard: %v; run `%s` from the repository root", err, GenerateCommand)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s is stale (%s); run `%s` from the repository root and commit the result",
			FileName, firstDifference(got, want), GenerateCommand)
	}
}

func firstDifference(got, want []byte) string {
	g, w := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
	for i := 0; i < len(g) && i < len(w); i++ {
		if g[i] != w[i] {
			return fmt.Sprintf("first difference at line %d: committed %q, generated %q", i+1, g[i], w[i])
		}
	}
	return fmt.Sprintf("committed has %d lines, generated %d", len(g), len(w))
}

func TestJSONIsDeterministic(t *testing.T) {
	a, err := JSON()
	if err != nil {
		t.Fatal(err)
	}
	b, err := JSON()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Fatal("two generations differ")
	}
}

// ---------------------------------------------------------------------------
// Structure of the committed JSON

type jsonDashboard struct {
	UID        string   `json:"uid"`
	Title      string   `json:"title"`
	Tags       []string `json:"tags"`
	Refresh    string   `json:"refresh"`
	Templating struct {
		List []jsonVariable `json:"list"`
	} `json:"templating"`
	Panels []jsonPanel `json:"panels"`
}

type jsonDatasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type jsonVariable struct {
	Type       string          `json:"type"`
	Name       string          `json:"name"`
	Query      string          `json:"query"`
	Definition string          `json:"definition"`
	Datasource *jsonDatasource `json:"datasource"`
	Multi      bool            `json:"multi"`
	IncludeAll bool            `json:"includeAll"`
	AllValue   string          `json:"allValue"`
	Regex      string          `json:"regex"`
	Hide       int             `json:"hide"`
}

type jsonPanel struct {
	Type       string          `json:"type"`
	ID         *uint32         `json:"id"`
	Title      string          `json:"title"`
	Datasource *jsonDatasource `json:"datasource"`
	GridPos    struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		Datasource   *jsonDatasource `json:"datasource"`
		Expr         string          `json:"expr"`
		RefID        string          `json:"refId"`
		LegendFormat string          `json:"legendFormat"`
	} `json:"targets"`
	Panels []json.RawMessage `json:"panels"`
}

func loadCommitted(t *testing.T) (jsonDashboard, []byte) {
	t.Helper()
	raw, err := os.ReadFile(FileName)
	if err != nil {
		t.Fatalf("reading %s: %v; run `%s`", FileName, err, GenerateCommand)
	}
	var d jsonDashboard
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("%s is not valid JSON: %v", FileName, err)
	}
	return d, raw
}

func TestCommittedJSONUnmarshalsWithTheSDK(t *testing.T) {
	_, raw := loadCommitted(t)
	plugins.RegisterDefaultPlugins()
	var d dashboard.Dashboard
	err := d.UnmarshalJSONStrict(raw)
	// v0.0.22 returns an empty cog.BuildErrors as a non-nil error on success.
	if be, ok := err.(cog.BuildErrors); ok && len(be) == 0 {
		err = nil
	}
	if err != nil {
		t.Fatalf("strict SDK unmarshal: %v", err)
	}
	if d.Uid == nil || *d.Uid != UID {
		t.Fatalf("uid after SDK unmarshal = %v, want %q", d.Uid, UID)
	}
}

func TestDashboardIdentity(t *testing.T) {
	d, _ := loadCommitted(t)
	// The uid is part of every saved link and provisioning setup: never change it.
	if d.UID != "sglang-watchdog" {
		t.Errorf("uid = %q, want the stable %q", d.UID, "sglang-watchdog")
	}
	if d.Title != "SGLang PD watchdog" {
		t.Errorf("title = %q", d.Title)
	}
	if !slices.Contains(d.Tags, "sglang") || !slices.Contains(d.Tags, "sglang-watchdog") {
		t.Errorf("tags = %v, want sglang and sglang-watchdog among them", d.Tags)
	}
	if d.Refresh == "" {
		t.Error("no refresh interval")
	}
}

func TestVariables(t *testing.T) {
	d, _ := loadCommitted(t)
	byName := map[string]jsonVariable{}
	for _, v := range d.Templating.List {
		if _, dup := byName[v.Name]; dup {
			t.Errorf("variable %q defined twice", v.Name)
		}
		byName[v.Name] = v
	}
	ds, ok := byName["datasource"]
	if !ok || ds.Type != "datasource" || ds.Query != "prometheus" {
		t.Fatalf("want a datasource variable of type prometheus, got %+v", ds)
	}
	for _, name := range []string{"cluster", "namespace", "job", "instance", "model_name", "dp_rank"} {
		v, ok := byName[name]
		if !ok {
			t.Errorf("variable %q missing", name)
			continue
		}
		if v.Type != "query" {
			t.Errorf("%s: type %q, want query", name, v.Type)
		}
		if v.Datasource == nil || v.Datasource.UID != "${datasource}" || v.Datasource.Type != "prometheus" {
			t.Errorf("%s: datasource %+v, want ${datasource}", name, v.Datasource)
		}
		// Grafana's schema has no definition field; the query is all there is.
		if v.Query == "" || v.Definition != "" {
			t.Errorf("%s: query %q, definition %q (want a query and no definition)", name, v.Query, v.Definition)
		}
		if hidden := v.Hide == 2; hidden != (name == "cluster") {
			t.Errorf("%s: hide = %d; only the cluster variable is hidden (until the mixin's showMultiCluster)", name, v.Hide)
		}
		// Every query variable is multi-value with All, and All must also
		// match series that lack the label (older SGLang eras, non-DP servers).
		if !v.Multi || !v.IncludeAll || v.AllValue != ".*" {
			t.Errorf("%s: multi=%v includeAll=%v allValue=%q, want true, true, \".*\"", name, v.Multi, v.IncludeAll, v.AllValue)
		}
		if v.Regex != "" {
			if _, err := regexp.Compile(strings.TrimSuffix(strings.TrimPrefix(v.Regex, "/"), "/")); err != nil {
				t.Errorf("%s: regex %q does not compile: %v", name, v.Regex, err)
			}
		}
	}
	// The instance regex strips the port so that SGLang and its sidecar are one host.
	re := regexp.MustCompile(strings.Trim(byName["instance"].Regex, "/"))
	for in, want := range map[string]string{"10.0.0.7:30000": "10.0.0.7", "10.0.0.7:9400": "10.0.0.7", "pod-a": "pod-a", "[::1]:30000": "[::1]"} {
		if m := re.FindStringSubmatch(in); m == nil || m[1] != want {
			t.Errorf("instance regex on %q = %v, want %q", in, m, want)
		}
	}
	// model_name: query_result output of both label eras lands on model_name.
	re = regexp.MustCompile(strings.Trim(byName["model_name"].Regex, "/"))
	if m := re.FindStringSubmatch(`{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2 1730000000000`); m == nil || m[1] != "meta-llama/Llama-3.1-8B-Instruct" {
		t.Errorf("model_name regex: %v", m)
	}
	if !strings.Contains(byName["model_name"].Query, `"model_name", "$1", "name", "(.+)"`) {
		t.Error("model_name variable must fold the old \"name\" label into model_name")
	}
	// Variables() mirrors the JSON.
	var names []string
	for _, v := range Variables() {
		names = append(names, v.Name)
		if j := byName[v.Name]; j.Query != v.Query || j.Regex != v.Regex || j.Multi != v.Multi || j.IncludeAll != v.IncludeAll || j.AllValue != v.AllValue || (j.Hide == 2) != v.Hidden {
			t.Errorf("Variables()[%s] = %+v, JSON %+v", v.Name, v, j)
		}
	}
	if want := []string{"datasource", "cluster", "namespace", "job", "instance", "model_name", "dp_rank"}; !slices.Equal(names, want) {
		t.Errorf("Variables() names = %v, want %v", names, want)
	}
}

// Every panel says what its numbers are (mixtool's dashboard lint asks the
// same), and the dashboard is read-only in Grafana: it is generated and
// provisioned, so edits made there would be lost.
func TestPanelUnitsAndReadOnly(t *testing.T) {
	_, raw := loadCommitted(t)
	var d struct {
		Editable *bool `json:"editable"`
		Panels   []struct {
			Type        string `json:"type"`
			Title       string `json:"title"`
			FieldConfig struct {
				Defaults struct {
					Unit string `json:"unit"`
				} `json:"defaults"`
			} `json:"fieldConfig"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	if d.Editable == nil || *d.Editable {
		t.Error("the dashboard is editable; want editable: false")
	}
	for _, p := range d.Panels {
		if p.Type != "row" && p.FieldConfig.Defaults.Unit == "" {
			t.Errorf("panel %q has no unit (fieldConfig.defaults.unit)", p.Title)
		}
	}
}

func TestPanels(t *testing.T) {
	d, _ := loadCommitted(t)
	ids := map[uint32]string{}
	titles := map[string]bool{}
	type rect struct{ x, y, w, h int }
	var rects []rect
	var rectTitles []string
	nPanels := 0
	for _, p := range d.Panels {
		if p.ID == nil {
			t.Errorf("panel %q has no id", p.Title)
			continue
		}
		if prev, dup := ids[*p.ID]; dup {
			t.Errorf("panel id %d used by %q and %q", *p.ID, prev, p.Title)
		}
		ids[*p.ID] = p.Title
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: bad gridPos %+v", p.Title, g)
		}
		for i, r := range rects {
			if g.X < r.x+r.w && r.x < g.X+g.W && g.Y < r.y+r.h && r.y < g.Y+g.H {
				t.Errorf("panels %q and %q overlap", rectTitles[i], p.Title)
			}
		}
		rects = append(rects, rect{g.X, g.Y, g.W, g.H})
		rectTitles = append(rectTitles, p.Title)

		if p.Type == "row" {
			if len(p.Panels) != 0 {
				t.Errorf("row %q holds panels; rows are expanded and panels follow them", p.Title)
			}
			continue
		}
		nPanels++
		if p.Title == "" {
			t.Errorf("panel %d has no title", *p.ID)
		}
		if titles[p.Title] {
			t.Errorf("panel title %q used twice", p.Title)
		}
		titles[p.Title] = true
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q: datasource %+v, want prometheus ${datasource}", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no targets", p.Title)
		}
		refs := map[string]bool{}
		for i, tg := range p.Targets {
			if tg.Datasource == nil || tg.Datasource.UID != "${datasource}" || tg.Datasource.Type != "prometheus" {
				t.Errorf("panel %q target %d: datasource %+v, want prometheus ${datasource}", p.Title, i, tg.Datasource)
			}
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q target %d: empty expr", p.Title, i)
			}
			if tg.RefID == "" || refs[tg.RefID] {
				t.Errorf("panel %q target %d: refId %q empty or repeated", p.Title, i, tg.RefID)
			}
			refs[tg.RefID] = true
			if strings.Contains(tg.Expr, "datasource") {
				t.Errorf("panel %q target %d: expr mentions the datasource variable", p.Title, i)
			}
		}
	}
	if nPanels < 20 {
		t.Errorf("only %d panels", nPanels)
	}
}

// Queries() must describe exactly the targets of the committed JSON.
func TestQueriesMatchJSON(t *testing.T) {
	d, _ := loadCommitted(t)
	var fromJSON []Query
	row := ""
	for _, p := range d.Panels {
		if p.Type == "row" {
			row = p.Title
			continue
		}
		for _, tg := range p.Targets {
			fromJSON = append(fromJSON, Query{Row: row, Panel: p.Title, PanelID: *p.ID, RefID: tg.RefID, Expr: tg.Expr, Legend: tg.LegendFormat})
		}
	}
	qs := Queries()
	if len(qs) != len(fromJSON) {
		t.Fatalf("Queries() has %d entries, the JSON %d targets", len(qs), len(fromJSON))
	}
	for i, q := range qs {
		j := fromJSON[i]
		j.Needs = q.Needs
		if q != j {
			t.Errorf("Queries()[%d] = %+v\nJSON target     %+v", i, q, j)
		}
	}
}

// ---------------------------------------------------------------------------
// PromQL: syntax and metric names

// selector is one series selector found in an expression.
type selector struct {
	metrics  []string          // from the name or a __name__ matcher
	matchers map[string]string // label -> "op value", e.g. `=~"$dp_rank"`
}

var (
	identRE     = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*`)
	metricOnly  = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)
	aggregators = map[string]bool{"sum": true, "min": true, "max": true, "avg": true, "count": true, "stddev": true,
		"stdvar": true, "topk": true, "bottomk": true, "quantile": true, "count_values": true, "group": true}
	keywords = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true,
		"inf": true, "nan": true, "Inf": true, "NaN": true}
	labelListWords = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true,
		"group_left": true, "group_right": true}
)

// parsePromQL is a small lexer: it checks that quotes are closed and brackets
// balance and nest, and it returns the series selectors and the contents of
// every [...] range. It does not validate PromQL grammar beyond that.
func parsePromQL(expr string) ([]selector, []string, error) {
	var sels []selector
	var ranges []string
	var stack []byte
	closer := map[byte]byte{')': '(', '}': '{', ']': '['}
	// pending is a metric name waiting to see whether a {...} follows.
	var pending *selector
	flush := func() {
		if pending != nil {
			sels = append(sels, *pending)
			pending = nil
		}
	}
	readString := func(i int) (string, int, error) {
		q := expr[i]
		j := i + 1
		for j < len(expr) && expr[j] != q {
			if expr[j] == '\\' && q != '`' {
				j++
			}
			j++
		}
		if j >= len(expr) {
			return "", 0, fmt.Errorf("unterminated string at offset %d", i)
		}
		return expr[i+1 : j], j + 1, nil
	}
	skipSpace := func(i int) int {
		for i < len(expr) && (expr[i] == ' ' || expr[i] == '\t' || expr[i] == '\n') {
			i++
		}
		return i
	}
	i := 0
	for i < len(expr) {
		c := expr[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n':
			i++
		case c == '"' || c == '\'' || c == '`':
			flush()
			_, next, err := readString(i)
			if err != nil {
				return nil, nil, err
			}
			i = next
		case c == '{':
			// label matchers
			sel := selector{matchers: map[string]string{}}
			if pending != nil {
				sel = *pending
				pending = nil
			}
			j := i + 1
			for {
				j = skipSpace(j)
				if j >= len(expr) {
					return nil, nil, fmt.Errorf("unterminated {")
				}
				if expr[j] == '}' {
					j++
					break
				}
				name := identRE.FindString(expr[j:])
				if name == "" {
					return nil, nil, fmt.Errorf("bad label name at offset %d", j)
				}
				j = skipSpace(j + len(name))
				op := ""
				for _, o := range []string{"=~", "!~", "!=", "="} {
					if strings.HasPrefix(expr[j:], o) {
						op = o
						break
					}
				}
				if op == "" {
					return nil, nil, fmt.Errorf("no matcher operator after %q", name)
				}
				j = skipSpace(j + len(op))
				if j >= len(expr) || (expr[j] != '"' && expr[j] != '\'' && expr[j] != '`') {
					return nil, nil, fmt.Errorf("matcher %s%s without a quoted value", name, op)
				}
				val, next, err := readString(j)
				if err != nil {
					return nil, nil, err
				}
				if _, dup := sel.matchers[name]; dup {
					return nil, nil, fmt.Errorf("label %q matched twice in one selector", name)
				}
				sel.matchers[name] = op + `"` + val + `"`
				if name == "__name__" {
					switch op {
					case "=":
						sel.metrics = append(sel.metrics, val)
					case "=~":
						for _, alt := range strings.Split(val, "|") {
							if !metricOnly.MatchString(alt) {
								return nil, nil, fmt.Errorf("__name__ regex %q is not a plain list of names", val)
							}
							sel.metrics = append(sel.metrics, alt)
						}
					default:
						return nil, nil, fmt.Errorf("negative __name__ matcher")
					}
				}
				j = skipSpace(next)
				if j < len(expr) && expr[j] == ',' {
					j++
				}
			}
			if len(sel.metrics) == 0 {
				return nil, nil, fmt.Errorf("selector without a metric name")
			}
			sels = append(sels, sel)
			i = j
		case c == '[':
			flush()
			j := strings.IndexByte(expr[i:], ']')
			if j < 0 {
				return nil, nil, fmt.Errorf("unterminated [")
			}
			ranges = append(ranges, expr[i+1:i+j])
			i += j + 1
		case c == '(':
			flush()
			stack = append(stack, c)
			i++
		case c == ')' || c == '}' || c == ']':
			flush()
			if len(stack) == 0 || stack[len(stack)-1] != closer[c] {
				return nil, nil, fmt.Errorf("unbalanced %q at offset %d", c, i)
			}
			stack = stack[:len(stack)-1]
			i++
		case c == '$':
			flush()
			j := i + 1
			if j < len(expr) && expr[j] == '{' {
				k := strings.IndexByte(expr[j:], '}')
				if k < 0 {
					return nil, nil, fmt.Errorf("unterminated ${")
				}
				i = j + k + 1
				continue
			}
			for j < len(expr) && (expr[j] == '_' || expr[j] >= 'a' && expr[j] <= 'z' || expr[j] >= 'A' && expr[j] <= 'Z' || expr[j] >= '0' && expr[j] <= '9') {
				j++
			}
			i = j
		case c >= '0' && c <= '9' || c == '.':
			flush()
			for i < len(expr) && (expr[i] >= '0' && expr[i] <= '9' || expr[i] == '.' || expr[i] == 'e' || expr[i] >= 'a' && expr[i] <= 'z') {
				i++
			}
		case identRE.MatchString(expr[i:]):
			flush()
			word := identRE.FindString(expr[i:])
			i += len(word)
			j := skipSpace(i)
			nextIsParen := j < len(expr) && expr[j] == '('
			switch {
			case labelListWords[word]:
				if nextIsParen {
					k := strings.IndexByte(expr[j:], ')')
					if k < 0 {
						return nil, nil, fmt.Errorf("unterminated label list after %s", word)
					}
					for _, l := range strings.Split(expr[j+1:j+k], ",") {
						if l = strings.TrimSpace(l); l != "" && !metricOnly.MatchString(l) {
							return nil, nil, fmt.Errorf("bad label %q in %s(...)", l, word)
						}
					}
					i = j + k + 1
				}
			case aggregators[word] || keywords[word] || nextIsParen:
				// aggregation, keyword or function call
			default:
				pending = &selector{metrics: []string{word}, matchers: map[string]string{}}
			}
		default:
			flush()
			i++
		}
	}
	flush()
	if len(stack) != 0 {
		return nil, nil, fmt.Errorf("unclosed %q", stack)
	}
	return sels, ranges, nil
}

func TestParsePromQL(t *testing.T) {
	sels, ranges, err := parsePromQL(`histogram_quantile(0.99, sum by (le) (rate(a:b_bucket{x=~"1|2", y="}"}[$__rate_interval]))) or c == 1`)
	if err != nil {
		t.Fatal(err)
	}
	if len(sels) != 2 || sels[0].metrics[0] != "a:b_bucket" || sels[0].matchers["y"] != `="}"` || sels[1].metrics[0] != "c" {
		t.Errorf("selectors = %+v", sels)
	}
	if !slices.Equal(ranges, []string{"$__rate_interval"}) {
		t.Errorf("ranges = %v", ranges)
	}
	for _, bad := range []string{`sum(rate(x[1m])`, `x{a="b}`, `sum(x))`, `(x]`, `x{a}`, `{a="b"}`} {
		if _, _, err := parsePromQL(bad); err == nil {
			t.Errorf("parsePromQL(%q) accepted", bad)
		}
	}
}

// docMetric is one row of docs/metrics.md.
type docMetric struct {
	typ    string
	labels map[string]bool
}

func loadDocMetrics(t *testing.T) map[string]docMetric {
	t.Helper()
	f, err := os.Open("../docs/metrics.md")
	if err != nil {
		t.Fatalf("reading the exporter's metric list: %v", err)
	}
	defer f.Close()
	out := map[string]docMetric{}
	row := regexp.MustCompile("^\\| `(sglang_watchdog_[a-z0-9_]+)` \\| ([a-z]+) \\| ([^|]*) \\|")
	label := regexp.MustCompile("`([a-z_]+)`")
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		m := row.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		d := docMetric{typ: m[2], labels: map[string]bool{}}
		for _, l := range label.FindAllStringSubmatch(m[3], -1) {
			d.labels[l[1]] = true
		}
		out[m[1]] = d
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(out) < 10 {
		t.Fatalf("found only %d metrics in docs/metrics.md; has the table format changed?", len(out))
	}
	return out
}

// resolveDoc maps a series name to its documented watchdog metric
// (histograms expose _bucket, _sum and _count).
func resolveDoc(doc map[string]docMetric, name string) (string, bool) {
	if _, ok := doc[name]; ok && doc[name].typ != "histogram" {
		return name, true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		base := strings.TrimSuffix(name, suf)
		if base != name && doc[base].typ == "histogram" {
			return base, true
		}
	}
	return "", false
}

// knownSGLang lists the SGLang series the dashboard may use, with their
// labels beyond the common ones (SGLang v0.5.18:
// python/sglang/srt/observability/metrics_collector.py; the v0.5-era names
// from metrics/collector.py, v0.5.3).
var knownSGLang = map[string]bool{
	"sglang:num_prefill_inflight_queue_reqs":      true,
	"sglang:num_prefill_prealloc_queue_reqs":      true, // v0.5-era name
	"sglang:num_prefill_bootstrap_queue_reqs":     true, // newest name
	"sglang:num_decode_prealloc_queue_reqs":       true,
	"sglang:num_decode_transfer_queue_reqs":       true,
	"sglang:num_bootstrap_failed_reqs_total":      true,
	"sglang:num_transfer_failed_reqs_total":       true,
	"sglang:kv_transfer_latency_ms":               true, // gauge (v0.5 era)
	"sglang:kv_transfer_latency_ms_bucket":        true, // histogram (newest)
	"sglang:per_stage_req_latency_seconds_bucket": true,
	"sglang:num_running_reqs":                     true,
}

var sglangQueueGauges = map[string]bool{
	"sglang:num_prefill_inflight_queue_reqs":  true,
	"sglang:num_prefill_prealloc_queue_reqs":  true,
	"sglang:num_prefill_bootstrap_queue_reqs": true,
	"sglang:num_decode_prealloc_queue_reqs":   true,
	"sglang:num_decode_transfer_queue_reqs":   true,
}

// allExprs returns every PromQL expression of the dashboard: panel targets and
// the PromQL inside the query variables.
func allExprs(t *testing.T) map[string]string {
	out := map[string]string{}
	for _, q := range Queries() {
		out[fmt.Sprintf("panel %q %s", q.Panel, q.RefID)] = q.Expr
	}
	inner := regexp.MustCompile(`^(?:label_values|query_result)\((.*)\)$`)
	for _, v := range Variables() {
		if v.Type != "query" {
			continue
		}
		m := inner.FindStringSubmatch(v.Query)
		if m == nil {
			t.Errorf("variable %s: unexpected query form %q", v.Name, v.Query)
			continue
		}
		e := m[1]
		if strings.HasPrefix(v.Query, "label_values(") {
			k := strings.LastIndex(e, ",")
			e = strings.TrimSpace(e[:k])
		}
		out["variable "+v.Name] = e
	}
	for _, a := range Annotations() {
		out[fmt.Sprintf("annotation %q", a.Panel)] = a.Expr
	}
	return out
}

func TestQueriesUseOnlyKnownMetrics(t *testing.T) {
	doc := loadDocMetrics(t)
	for where, expr := range allExprs(t) {
		sels, ranges, err := parsePromQL(expr)
		if err != nil {
			t.Errorf("%s: %v in %s", where, err, expr)
			continue
		}
		if len(sels) == 0 {
			t.Errorf("%s: no series selector in %s", where, expr)
		}
		for _, r := range ranges {
			if r != "$__rate_interval" {
				t.Errorf("%s: range [%s], want [$__rate_interval]", where, r)
			}
		}
		for _, s := range sels {
			for _, m := range s.metrics {
				switch {
				case m == "up":
				case strings.HasPrefix(m, "sglang:"):
					if !knownSGLang[m] {
						t.Errorf("%s: SGLang metric %q is not in the known list (add it to knownSGLang after finding it in SGLang's observability/metrics_collector.py)", where, m)
					}
				case strings.HasPrefix(m, "sglang_watchdog_"):
					if _, ok := resolveDoc(doc, m); !ok {
						t.Errorf("%s: %q is not exported by the watchdog (not in docs/metrics.md)", where, m)
					}
				default:
					t.Errorf("%s: metric %q is neither up, sglang:* nor sglang_watchdog_*", where, m)
				}
			}
		}
	}
}

// Labels Prometheus adds to every series of a target.
var targetLabels = map[string]bool{"cluster": true, "namespace": true, "job": true, "instance": true}

// variableMatchers are the matchers each query variable's query must have:
// the variables before it, and the watchdog job selector where it lists the
// watchdog's own series.
var variableMatchers = map[string]map[string]string{
	"cluster":    {"job": `=~"sglang-watchdog.*"`},
	"namespace":  {"job": `=~"sglang-watchdog.*"`, "cluster": `=~"$cluster"`},
	"job":        {"job": `=~"sglang-watchdog.*"`, "cluster": `=~"$cluster"`, "namespace": `=~"$namespace"`},
	"instance":   {"cluster": `=~"$cluster"`, "namespace": `=~"$namespace"`},
	"model_name": {"cluster": `=~"$cluster"`, "namespace": `=~"$namespace"`, "instance": `=~"$instance(:[0-9]+)?"`},
	"dp_rank":    {"cluster": `=~"$cluster"`, "namespace": `=~"$namespace"`, "instance": `=~"$instance(:[0-9]+)?"`, "job": `=~"$job"`},
}

// Every query filters by the variables that apply to its series.
func TestQueriesUseVariables(t *testing.T) {
	doc := loadDocMetrics(t)
	const (
		cluster   = `=~"$cluster"`
		namespace = `=~"$namespace"`
		job       = `=~"$job"`
		inst      = `=~"$instance(:[0-9]+)?"`
		rank      = `=~"$dp_rank"`
		rawRank   = `=~"$dp_rank|"`
		model     = `=~"$model_name"`
		total     = `=""`
		variable  = "variable "
	)
	for where, expr := range allExprs(t) {
		sels, _, err := parsePromQL(expr)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		isVar := strings.HasPrefix(where, variable)
		eraCount := map[string]int{}
		for _, s := range sels {
			name := s.metrics[0]
			if isVar {
				// Each variable depends on exactly the variables before it.
				want := variableMatchers[strings.TrimPrefix(where, variable)]
				for l, v := range s.matchers {
					if l != "__name__" && want[l] != v {
						t.Errorf("%s: matcher %s%s, want %q", where, l, v, want[l])
					}
				}
				for l, v := range want {
					if s.matchers[l] != v {
						t.Errorf("%s: no matcher %s%s", where, l, v)
					}
				}
				continue
			}
			for l, want := range map[string]string{"cluster": cluster, "namespace": namespace, "instance": inst} {
				if got := s.matchers[l]; got != want {
					t.Errorf("%s: %s has %s matcher %q, want %s%s", where, name, l, got, l, want)
				}
			}
			// Only the watchdog's own series come from the watchdog's job.
			if got, isWD := s.matchers["job"], strings.HasPrefix(name, "sglang_watchdog_"); isWD && got != job || !isWD && got != "" {
				t.Errorf("%s: %s has job matcher %q; want job%s on sglang_watchdog_* only", where, name, got, job)
			}
			switch {
			case strings.HasPrefix(name, "sglang:"):
				// Each SGLang metric is selected once by model_name and once
				// by the old name label.
				byNew, byOld := s.matchers["model_name"], s.matchers["name"]
				switch {
				case byNew == model && byOld == "":
					eraCount[name]++
				case byOld == model && byNew == "":
					eraCount[name]--
				default:
					t.Errorf("%s: %s matches model_name %q and name %q, want exactly one of them =~\"$model_name\"", where, name, byNew, byOld)
				}
				if got := s.matchers["dp_rank"]; got != rawRank {
					t.Errorf("%s: %s has dp_rank matcher %q, want dp_rank%s", where, name, got, rawRank)
				}
				if sglangQueueGauges[name] && s.matchers["priority"] != total {
					t.Errorf("%s: queue gauge %s must match priority=\"\" (newest per-priority breakdown)", where, name)
				}
			case strings.HasPrefix(name, "sglang_watchdog_"):
				base, _ := resolveDoc(doc, name)
				hasRank := doc[base].labels["dp_rank"]
				got, filtered := s.matchers["dp_rank"]
				if hasRank && got != rank {
					t.Errorf("%s: %s carries dp_rank but its matcher is %q, want dp_rank%s", where, name, got, rank)
				}
				if !hasRank && filtered {
					t.Errorf("%s: %s has no dp_rank label but is filtered by it", where, name)
				}
				for l := range s.matchers {
					if !targetLabels[l] && l != "dp_rank" && !doc[base].labels[l] {
						t.Errorf("%s: %s matches label %q it does not carry", where, name, l)
					}
				}
			}
		}
		for m, n := range eraCount {
			if n != 0 {
				t.Errorf("%s: %s is not selected by model_name and by name equally often", where, m)
			}
		}
	}
}

// The dashboard shows every metric the exporter documents.
func TestEveryDocumentedMetricIsShown(t *testing.T) {
	doc := loadDocMetrics(t)
	used := map[string]bool{}
	for _, q := range Queries() {
		sels, _, err := parsePromQL(q.Expr)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range sels {
			for _, m := range s.metrics {
				if base, ok := resolveDoc(doc, m); ok {
					used[base] = true
				}
			}
		}
	}
	for name := range doc {
		if !used[name] {
			t.Errorf("docs/metrics.md lists %s but no panel queries it; add a panel in dashboards/layout.go and run `%s`", name, GenerateCommand)
		}
	}
}

// ---------------------------------------------------------------------------
// Needs tags

// pluginMetrics are the watchdog series built from the plugin listing.
var pluginMetrics = map[string]bool{
	"sglang_watchdog_inflight_requests":            true,
	"sglang_watchdog_inflight_oldest_age_seconds":  true,
	"sglang_watchdog_inflight_age_seconds":         true,
	"sglang_watchdog_stuck_requests":               true,
	"sglang_watchdog_scheduler_loop_stall_seconds": true,
	"sglang_watchdog_scheduler_wedged":             true,
	"sglang_watchdog_transfer_wedged":              true,
	"sglang_watchdog_transfer_wedges_total":        true,
	"sglang_watchdog_rank_targets":                 true,
	"sglang_watchdog_stuck_unactionable_requests":  true,
	"sglang_watchdog_kv_threads_dead":              true,
}

func TestNeedsTags(t *testing.T) {
	doc := loadDocMetrics(t)
	baseline := 0
	for _, q := range Queries() {
		where := fmt.Sprintf("panel %q %s", q.Panel, q.RefID)
		sels, _, err := parsePromQL(q.Expr)
		if err != nil {
			t.Fatal(err)
		}
		var want Needs
		for _, s := range sels {
			for _, m := range s.metrics {
				if strings.HasPrefix(m, "sglang:") {
					want |= NeedsSGLangScrape
				}
				if base, ok := resolveDoc(doc, m); ok && pluginMetrics[base] {
					want |= NeedsPlugin
				}
				if m == "sglang_watchdog_alert_webhook_refusals_total" {
					want |= NeedsWebhook
				}
				switch m {
				case "sglang:kv_transfer_latency_ms_bucket":
					want |= NeedsHistogramEra
				case "sglang:kv_transfer_latency_ms":
					want |= NeedsGaugeEra
				case "sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs":
					want |= NeedsDecodeRole
				}
			}
		}
		if q.Needs&want != want {
			t.Errorf("%s: needs %s, want at least %s", where, q.Needs, want)
		}
		if q.Needs&NeedsHistogramEra != 0 && q.Needs&NeedsGaugeEra != 0 {
			t.Errorf("%s: cannot need both eras", where)
		}
		if q.Needs == 0 {
			baseline++
		}
	}
	if baseline < 10 {
		t.Errorf("only %d baseline queries", baseline)
	}
}

func TestNeedsHelpers(t *testing.T) {
	if got := Needs(0).String(); got != "baseline" {
		t.Errorf("String() = %q", got)
	}
	if got := (NeedsPlugin | NeedsGaugeEra).String(); got != "plugin,gauge-era" {
		t.Errorf("String() = %q", got)
	}
	n := NeedsSGLangScrape | NeedsKVTransfer
	if !n.SatisfiedBy(n|NeedsPlugin) || n.SatisfiedBy(NeedsSGLangScrape) || !Needs(0).SatisfiedBy(0) {
		t.Error("SatisfiedBy")
	}
	for i, e := range needsNames {
		if e.n != 1<<i {
			t.Errorf("needsNames[%d] = %s out of order", i, e.name)
		}
	}
}

// ---------------------------------------------------------------------------
// Expand

func TestExpand(t *testing.T) {
	vars := map[string]string{"instance": "h", "dp_rank": "(0|1)", "__rate_interval": "1m"}
	for in, want := range map[string]string{
		`x{instance=~"$instance(:[0-9]+)?", dp_rank=~"$dp_rank|"}[$__rate_interval]`: `x{instance=~"h(:[0-9]+)?", dp_rank=~"(0|1)|"}[1m]`,
		`${dp_rank} ${dp_rank:regex} [[dp_rank]]`:                                    `(0|1) (0|1) (0|1)`,
		`label_replace(x, "a", "$1", "b", "(.+)") $unknown`:                          `label_replace(x, "a", "$1", "b", "(.+)") $unknown`,
	} {
		if got := Expand(in, vars); got != want {
			t.Errorf("Expand(%q) = %q, want %q", in, got, want)
		}
	}
	if got := RegexValue("127.0.0.1"); got != `127\\.0\\.0\\.1` {
		t.Errorf("RegexValue = %q", got)
	}
	if got := RegexValue("0", "1"); got != "(0|1)" {
		t.Errorf("RegexValue = %q", got)
	}
	left := regexp.MustCompile(`\$[a-zA-Z_{\[]`)
	for _, q := range Queries() {
		e := Expand(q.Expr, AllVars())
		if left.MatchString(e) {
			t.Errorf("panel %q %s: unexpanded variable left in %s", q.Panel, q.RefID, e)
		}
		if _, _, err := parsePromQL(e); err != nil {
			t.Errorf("panel %q %s: expanded query does not lex: %v", q.Panel, q.RefID, err)
		}
	}
}

// The matchers the queries use behave as documented once Grafana expands them.
func TestVariableRegexSemantics(t *testing.T) {
	full := func(re string) *regexp.Regexp { return regexp.MustCompile("^(?:" + re + ")$") }
	// Raw SGLang rank matcher: All and a selection keep servers without dp_rank.
	for _, v := range []string{allValue, "0", "(0|3)"} {
		if !full(v + "|").MatchString("") {
			t.Errorf("dp_rank=~%q| drops series without dp_rank", v)
		}
	}
	if full("(0|3)|").MatchString("1") {
		t.Error("dp_rank selection leaks other ranks")
	}
	// Instance matcher: the host selects SGLang and its sidecar, any port.
	host := `10\.0\.0\.7` // what Grafana inserts for 10.0.0.7 once PromQL unquotes it
	for _, in := range []string{"10.0.0.7:30000", "10.0.0.7:9400", "10.0.0.7"} {
		if !full(host + "(:[0-9]+)?").MatchString(in) {
			t.Errorf("instance matcher misses %q", in)
		}
	}
	if full(host + "(:[0-9]+)?").MatchString("10.0.0.70:30000") {
		t.Error("instance matcher leaks another host")
	}
	if !full(allValue + "(:[0-9]+)?").MatchString("anything:1") {
		t.Error("All instance matcher")
	}
}

// promtool 2.42 has no query parser, but `promtool check rules` parses every
// rule expression with Prometheus's own parser: run each expanded query
// through it as a recording rule.
func TestQueriesParseWithPromtool(t *testing.T) {
	stacks := promtools(t)
	var b strings.Builder
	b.WriteString("groups:\n- name: dashboard-queries\n  rules:\n")
	n := 0
	add := func(expr string) {
		n++
		quoted, _ := json.Marshal(expr) // a JSON string is a YAML string
		fmt.Fprintf(&b, "  - record: dashboard:query_%d\n    expr: %s\n", n, quoted)
	}
	where := map[int]string{}
	for name, expr := range allExprs(t) {
		add(Expand(expr, AllVars()))
		where[n] = name
	}
	// Also with concrete selections, as Grafana expands them.
	for _, q := range Queries() {
		add(Expand(q.Expr, map[string]string{
			"cluster":         allValue,
			"namespace":       allValue,
			"job":             RegexValue("sglang-watchdog", "sglang-watchdog-b"),
			"instance":        RegexValue("10.0.0.7"),
			"model_name":      RegexValue("deepseek-ai/DeepSeek-R1", "meta-llama/Llama-3.1-8B"),
			"dp_rank":         RegexValue("0", "3"),
			"__rate_interval": "1m",
		}))
		where[n] = fmt.Sprintf("panel %q %s (selected values)", q.Panel, q.RefID)
	}
	file := t.TempDir() + "/queries.yml"
	if err := os.WriteFile(file, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, s := range stacks {
		out, err := exec.Command(s.Promtool, "check", "rules", file).CombinedOutput()
		if err != nil {
			var failed []string
			for _, m := range regexp.MustCompile(`dashboard:query_(\d+)`).FindAllStringSubmatch(string(out), -1) {
				i, err := strconv.Atoi(m[1]) // \d+: only an overflow fails
				if err != nil || i >= len(where) {
					failed = append(failed, m[0]+" = ?")
					continue
				}
				failed = append(failed, fmt.Sprintf("%s = %s", m[0], where[i]))
			}
			t.Fatalf("promtool check rules (%s): %v\n%s\n%s", s.Name, err, out, strings.Join(failed, "\n"))
		}
	}
}

// promtools returns Debian's promtool 2.x and the 3.x that scripts/deps.sh
// builds: every query must parse and return data on both.
func promtools(t *testing.T) []prombin.Stack {
	t.Helper()
	stacks, err := prombin.All()
	if err != nil {
		t.Fatal(err)
	}
	return stacks
}

// eraSeries is the synthetic SGLang /metrics of one label era, as Prometheus
// stores it after scraping 10.0.0.7:30000: each entry is a series selector
// (without instance and job) and its promtool values notation.
type eraSeries struct {
	name     string
	provides Needs
	series   [][2]string
}

func syntheticEras() []eraSeries {
	const counter, gauge, hist = "0+1x80", "1x80", "0+2x80"
	// pd builds the PD families of one era from its scheduler labels.
	pd := func(labels, bootstrapQueue string, kvHistogram bool, priorities bool) [][2]string {
		var s [][2]string
		for _, q := range []string{"sglang:num_prefill_inflight_queue_reqs", bootstrapQueue,
			"sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs"} {
			s = append(s, [2]string{q + "{" + labels + "}", gauge})
			if priorities { // newest: per-priority breakdown next to the total
				s = append(s, [2]string{q + "{" + labels + `,priority="1"}`, gauge})
			}
		}
		s = append(s,
			[2]string{"sglang:num_transfer_failed_reqs_total{" + labels + "}", counter},
			[2]string{"sglang:num_bootstrap_failed_reqs_total{" + labels + "}", counter},
			[2]string{"sglang:num_running_reqs{" + labels + "}", gauge},
			[2]string{"sglang:per_stage_req_latency_seconds_bucket{" + labels + `,stage="prefill_transfer_kv_cache",le="0.1"}`, counter},
			[2]string{"sglang:per_stage_req_latency_seconds_bucket{" + labels + `,stage="prefill_transfer_kv_cache",le="+Inf"}`, hist},
			[2]string{"sglang:per_stage_req_latency_seconds_bucket{" + labels + `,stage="prefill_forward",le="+Inf"}`, hist},
		)
		if kvHistogram {
			s = append(s,
				[2]string{"sglang:kv_transfer_latency_ms_bucket{" + labels + `,le="10"}`, counter},
				[2]string{"sglang:kv_transfer_latency_ms_bucket{" + labels + `,le="+Inf"}`, hist})
		} else {
			s = append(s, [2]string{"sglang:kv_transfer_latency_ms{" + labels + "}", gauge})
		}
		return s
	}
	// The watchdog side (watchdogSeries) holds every documented metric, the
	// webhook's refusals included.
	all := NeedsSGLangScrape | NeedsPlugin | NeedsDecodeRole | NeedsInflightTraffic | NeedsKVTransfer | NeedsTransferFailure | NeedsWebhook
	var v05, newest [][2]string
	for _, dp := range []string{"0", "1"} {
		v05 = append(v05, pd(`model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="`+dp+`"`,
			"sglang:num_prefill_prealloc_queue_reqs", false, false)...)
		newest = append(newest, pd(`model_name="m",engine_type="prefill",tp_rank="0",pp_rank="0",moe_ep_rank="0",dp_rank="`+dp+`"`,
			"sglang:num_prefill_bootstrap_queue_reqs", true, true)...)
	}
	return []eraSeries{
		// The PD families never shipped in the name and model_name eras, but
		// the simulator emits them there to exercise label handling.
		{"name", all | NeedsGaugeEra, pd(`name="m"`, "sglang:num_prefill_prealloc_queue_reqs", false, false)},
		{"model_name", all | NeedsGaugeEra, pd(`model_name="m"`, "sglang:num_prefill_prealloc_queue_reqs", false, false)},
		{"v0.5 (DP2)", all | NeedsGaugeEra, v05},
		{"newest (DP2)", all | NeedsHistogramEra, newest},
	}
}

// watchdogSeries is one series per documented watchdog metric (per bucket for
// histograms), with placeholder label values, as scraped from 10.0.0.7:9400.
func watchdogSeries(doc map[string]docMetric) [][2]string {
	value := map[string]string{"source": "metrics", "target": "http://127.0.0.1:30000/metrics", "queue": "prefill_inflight",
		"dp_rank": "0", "pp_rank": "0", "tp_rank": "0", "poll": "Transferring", "result": "released", "trigger": "auto",
		"reason": "mode_off", "mode": "auto"}
	var out [][2]string
	for name, d := range doc {
		var ls []string
		for l := range d.labels {
			v, ok := value[l]
			if !ok {
				v = "x"
			}
			ls = append(ls, fmt.Sprintf("%s=%q", l, v))
		}
		slices.Sort(ls)
		labels := strings.Join(ls, ",")
		with := func(extra string) string {
			if labels == "" {
				return "{" + extra + "}"
			}
			if extra == "" {
				return "{" + labels + "}"
			}
			return "{" + labels + "," + extra + "}"
		}
		switch d.typ {
		case "histogram":
			out = append(out,
				[2]string{name + "_bucket" + with(`le="1"`), "0+1x80"},
				[2]string{name + "_bucket" + with(`le="+Inf"`), "0+2x80"},
				[2]string{name + "_count" + with(""), "0+2x80"},
				[2]string{name + "_sum" + with(""), "0+3x80"})
		case "counter":
			out = append(out, [2]string{name + with(""), "0+1x80"})
		default:
			out = append(out, [2]string{name + with(""), "1x80"})
		}
	}
	slices.SortFunc(out, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return out
}

// Every query returns data on synthetic series of every SGLang label era,
// with All and with one host, model and rank picked, and returns nothing for
// a host that is not there. The watchdog side is generated from
// docs/metrics.md. Runs the queries with `promtool test rules`.
func TestQueriesReturnDataPerEra(t *testing.T) {
	stacks := promtools(t)
	doc := loadDocMetrics(t)
	wdSeries := watchdogSeries(doc)
	picked := map[string]string{
		"cluster": allValue, "namespace": allValue, "job": RegexValue("sglang-watchdog"),
		"instance": RegexValue("10.0.0.7"), "model_name": RegexValue("m"), "dp_rank": RegexValue("0"), "__rate_interval": "1m",
	}
	elsewhere := map[string]string{
		"cluster": allValue, "namespace": allValue, "job": allValue,
		"instance": RegexValue("10.0.0.8"), "model_name": allValue, "dp_rank": allValue, "__rate_interval": "1m",
	}
	q := func(s string) string { b, _ := json.Marshal(s); return string(b) }

	var b strings.Builder
	b.WriteString("rule_files: []\nevaluation_interval: 1m\ntests:\n")
	covered := map[int]bool{}
	for _, era := range syntheticEras() {
		fmt.Fprintf(&b, "- name: %s\n  interval: 15s\n  input_series:\n", q(era.name))
		add := func(series, values string) {
			fmt.Fprintf(&b, "  - series: %s\n    values: %s\n", q(series), q(values))
		}
		for _, s := range era.series {
			add(strings.Replace(s[0], "{", `{instance="10.0.0.7:30000",job="sglang",`, 1), s[1])
		}
		for _, s := range wdSeries {
			add(strings.Replace(s[0], "{", `{instance="10.0.0.7:9400",job="sglang-watchdog",`, 1), s[1])
		}
		add(`up{instance="10.0.0.7:30000",job="sglang"}`, "1x80")
		add(`up{instance="10.0.0.7:9400",job="sglang-watchdog"}`, "1x80")
		b.WriteString("  promql_expr_test:\n")
		for i, qu := range Queries() {
			if !qu.Needs.SatisfiedBy(era.provides) {
				continue
			}
			covered[i] = true
			for _, vars := range []map[string]string{AllVars(), picked} {
				fmt.Fprintf(&b, "  - expr: %s\n    eval_time: 15m\n    exp_samples:\n    - labels: '{}'\n      value: 1\n",
					q("count("+Expand(qu.Expr, vars)+") > bool 0"))
			}
			fmt.Fprintf(&b, "  - expr: %s\n    eval_time: 15m\n    exp_samples: []\n", q("count("+Expand(qu.Expr, elsewhere)+")"))
		}
		// The model_name variable lists the model in every label era.
		for _, v := range Variables() {
			if v.Name != "model_name" {
				continue
			}
			inner := strings.TrimSuffix(strings.TrimPrefix(v.Query, "query_result("), ")")
			fmt.Fprintf(&b, "  - expr: %s\n    eval_time: 15m\n    exp_samples:\n    - labels: '{model_name=\"m\"}'\n      value: 1\n",
				q(Expand(inner, picked)+" > bool 0"))
		}
	}
	file := t.TempDir() + "/queries_test.yml"
	if err := os.WriteFile(file, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, s := range stacks {
		out, err := exec.Command(s.Promtool, "test", "rules", file).CombinedOutput()
		if err != nil {
			t.Fatalf("promtool test rules (%s): %v\n%s", s.Name, err, out)
		}
	}
	for i, qu := range Queries() {
		if !covered[i] {
			t.Errorf("panel %q %s (needs %s) was checked against no synthetic era", qu.Panel, qu.RefID, qu.Needs)
		}
	}
}
