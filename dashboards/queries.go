package dashboards

import (
	"regexp"
	"strings"
)

// Needs names the conditions under which a panel query legitimately returns
// data. The zero value means "baseline": the watchdog runs, reads the
// /metrics of an SGLang PD server successfully, and Prometheus scrapes the
// watchdog. Every baseline query must return data in that setup (the
// watchdog pre-initialises its counters, so force-fail, skip, webhook and
// read-failure panels are baseline). A query with a non-zero Needs may return
// nothing, or only NaN, until each of its conditions holds.
//
// An end-to-end test states what its scenario provides and asserts the queries
// whose needs it satisfies:
//
//	have := dashboards.NeedsSGLangScrape | dashboards.NeedsPlugin | dashboards.NeedsGaugeEra
//	for _, q := range dashboards.Queries() {
//		if q.Needs.SatisfiedBy(have) { /* Expand, query Prometheus, expect data */ }
//	}
type Needs uint32

const (
	// NeedsSGLangScrape: the query reads SGLang's own sglang:* series, so
	// Prometheus must scrape SGLang's /metrics itself (not only the watchdog).
	// These queries return data on every label era: they match the model by
	// model_name or by the old name label, and a missing dp_rank or priority
	// label. A query that exists only in one era also carries
	// NeedsHistogramEra or NeedsGaugeEra.
	NeedsSGLangScrape Needs = 1 << iota
	// NeedsPlugin: watchdog series built from the plugin's /debug/inflight
	// listing (poll states, oldest age, age histogram, stuck requests,
	// scheduler loop). Absent when the watchdog runs without the plugin.
	NeedsPlugin
	// NeedsDecodeRole: SGLang's decode-side queue gauges, emitted by a decode
	// server (a prefill server may not emit them).
	NeedsDecodeRole
	// NeedsHistogramEra: newest SGLang, where sglang:kv_transfer_* are
	// histograms (sglang:kv_transfer_latency_ms_bucket).
	NeedsHistogramEra
	// NeedsGaugeEra: SGLang whose sglang:kv_transfer_* are gauges
	// (sglang:kv_transfer_latency_ms): v0.5 and earlier PD-capable eras.
	NeedsGaugeEra
	// NeedsInflightTraffic: at least one request left the prefill inflight
	// queue within the window (the age quantiles are NaN until then).
	NeedsInflightTraffic
	// NeedsKVTransfer: at least one KV transfer completed successfully within
	// the window (SGLang observes kv_transfer_* and the
	// prefill_transfer_kv_cache stage only on KVPoll.Success, and creates the
	// histogram series on the first observation).
	NeedsKVTransfer
	// NeedsTransferFailure: SGLang counted a failed KV transfer or bootstrap
	// (for example a force-fail that released a stuck request). Servers that
	// create the failure counters at start satisfy it without a failure.
	NeedsTransferFailure
	// NeedsForceFail: the watchdog made a force-fail call (any result,
	// would_flip in dry-run mode included) within the window.
	NeedsForceFail
	// NeedsWedge: a scheduler loop was wedged within the window.
	NeedsWedge
	// NeedsTransferWedge: a KV transfer queue was wedged (diagnosed or
	// suspected, sglang_watchdog_transfer_wedged 1) within the window.
	NeedsTransferWedge
	// NeedsWebhook: the watchdog runs with --alertmanager.webhook, which
	// exports the webhook's refusal counter (the delivery counter is
	// exported either way).
	NeedsWebhook
)

var needsNames = []struct {
	n    Needs
	name string
}{
	{NeedsSGLangScrape, "sglang-scrape"},
	{NeedsPlugin, "plugin"},
	{NeedsDecodeRole, "decode-role"},
	{NeedsHistogramEra, "histogram-era"},
	{NeedsGaugeEra, "gauge-era"},
	{NeedsInflightTraffic, "inflight-traffic"},
	{NeedsKVTransfer, "kv-transfer"},
	{NeedsTransferFailure, "transfer-failure"},
	{NeedsForceFail, "force-fail"},
	{NeedsWedge, "wedge"},
	{NeedsTransferWedge, "transfer-wedge"},
	{NeedsWebhook, "webhook"},
}

// SatisfiedBy reports whether every condition in n is among have.
func (n Needs) SatisfiedBy(have Needs) bool { return n&^have == 0 }

// String lists the conditions, comma separated; "baseline" for none.
func (n Needs) String() string {
	if n == 0 {
		return "baseline"
	}
	var parts []string
	for _, e := range needsNames {
		if n&e.n != 0 {
			parts = append(parts, e.name)
			n &^= e.n
		}
	}
	if n != 0 {
		parts = append(parts, "unknown")
	}
	return strings.Join(parts, ",")
}

// Query is one panel target of the dashboard.
type Query struct {
	Row     string // title of the row the panel sits in
	Panel   string // panel title
	PanelID uint32 // panel id in the dashboard JSON
	RefID   string // target refId ("A", "B", ...)
	// Expr is the PromQL exactly as stored in the dashboard, with Grafana
	// variables ($instance, $model_name, $dp_rank, $__rate_interval). Run it
	// through Expand before sending it to Prometheus.
	Expr   string
	Legend string // legendFormat
	Needs  Needs  // when the query legitimately returns data; 0 = always
}

// Queries returns every panel target of the dashboard, in panel order. It is
// derived from the same specification that builds the dashboard, and the
// package tests check it against the generated JSON.
func Queries() []Query {
	var out []Query
	_, panels := assignIDs(layout())
	for _, p := range panels {
		for i, t := range p.spec.targets {
			out = append(out, Query{
				Row:     p.row,
				Panel:   p.spec.title,
				PanelID: p.id,
				RefID:   refID(i),
				Expr:    t.expr,
				Legend:  t.legend,
				Needs:   t.needs,
			})
		}
	}
	return out
}

// Variable describes one dashboard template variable.
type Variable struct {
	Name string
	// Type is "datasource" or "query".
	Type string
	// Query is what Grafana stores: the plugin type for the datasource
	// variable, a label_values(...) or query_result(...) call otherwise.
	Query string
	// Regex is applied by Grafana to each value; the first capture group
	// becomes the option.
	Regex      string
	Multi      bool
	IncludeAll bool
	// AllValue is what "All" expands to inside queries.
	AllValue string
	// Hidden variables are not shown on the dashboard (the cluster picker
	// until the mixin's showMultiCluster turns it on).
	Hidden bool
}

// Variables returns the dashboard's template variables in display order.
func Variables() []Variable { return variables() }

// Expand substitutes Grafana template variables in expr the way Grafana's
// template service finds them: $name, ${name}, ${name:format} and [[name]].
// Values are inserted verbatim, so each must already be valid where it lands:
// every dashboard query uses the variables only inside regex matchers
// (instance=~"$instance(:[0-9]+)?", model_name=~"$model_name",
// name=~"$model_name", dp_rank=~"$dp_rank" or dp_rank=~"$dp_rank|"), so pass
// a regex written for a PromQL double-quoted string, as RegexValue builds, or
// ".*" (see AllVars).
// $__rate_interval needs a PromQL duration such as "1m". Variables missing
// from vars are left as they are (e.g. the "$1" of a label_replace).
func Expand(expr string, vars map[string]string) string {
	return varRef.ReplaceAllStringFunc(expr, func(m string) string {
		sub := varRef.FindStringSubmatch(m)
		name := sub[1] + sub[2] + sub[3]
		if v, ok := vars[name]; ok {
			return v
		}
		return m
	})
}

var varRef = regexp.MustCompile(`\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::\w+)?\]\]|\$(\w+)`)

// AllVars returns the substitutions Grafana makes when every query variable is
// set to "All", with $__rate_interval set to "1m" (override it to at least
// four times the Prometheus scrape interval of the test setup).
func AllVars() map[string]string {
	return map[string]string{
		"cluster":         allValue,
		"namespace":       allValue,
		"job":             allValue,
		"instance":        allValue,
		"model_name":      allValue,
		"dp_rank":         allValue,
		"__rate_interval": "1m",
	}
}

// RegexValue renders one or more concrete variable values the way Grafana's
// Prometheus data source interpolates a multi-value variable into a regex
// matcher: each value regex-escaped, several joined as (a|b), and backslashes
// doubled for the PromQL string literal. RegexValue("127.0.0.1") is
// `127\\.0\\.0\\.1`.
func RegexValue(values ...string) string {
	esc := make([]string, len(values))
	for i, v := range values {
		esc[i] = strings.ReplaceAll(regexp.QuoteMeta(v), `\`, `\\`)
	}
	if len(esc) == 1 {
		return esc[0]
	}
	return "(" + strings.Join(esc, "|") + ")"
}

func refID(i int) string { return string(rune('A' + i)) }
