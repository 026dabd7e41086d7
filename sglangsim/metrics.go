package sglangsim

import (
	"bytes"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Scheduler gauges (SGLang v0.5.18: observability/metrics_collector.py),
// indexes into rankMetrics.g.
const (
	gRunning = iota
	gUsedTokens
	gTokenUsage
	gGenThroughput
	gQueue
	gCacheHit
	gInflight
	gBootstrapQ // num_prefill_prealloc_queue_reqs (v0.5) / num_prefill_bootstrap_queue_reqs (newest)
	gDecodePrealloc
	gDecodeTransfer
	gGrammarQueue
	gRunningOffline
	gMaxTotalTokens
	gSpecAcceptLen
	gUtilization
	gStartup
	gLoadWeights
	gCudaGraph
	gNewTokenRatio
	gRetracted
	gPaused
	gKVSpeed
	gKVLatency
	gKVBootstrap
	gKVAlloc
	gKVTotalMB
	gKVAvailable
	gKVUsed
	gKVEvictable
	gFullTokenUsage
	gPageSize
	gContextLen
	numGauges
)

// Stages of per_stage_req_latency_seconds observed on a PD prefill rank.
const (
	stagePrepare = iota
	stageBootstrap
	stageWaiting
	stageForward
	stageChunkedPrefill
	stageTransfer
	stageRequestProcess
	stageTokenize
	stageDispatch
	numStages
)

var stageNames = [numStages]string{"prefill_prepare", "prefill_bootstrap", "prefill_waiting", "prefill_forward",
	"chunked_prefill", "prefill_transfer_kv_cache", "request_process", "tokenize", "dispatch"}

// kv_transfer_* histograms (newest era).
const (
	kvSpeed = iota
	kvLatency
	kvBootstrap
	kvAlloc
	kvTotalMB
	numKV
)

var (
	// exponential_buckets(start=0.001, width=1.62, length=30): start * width**i.
	stageBuckets = func() []float64 {
		b := make([]float64, 30)
		for i := range b {
			b[i] = 0.001 * math.Pow(1.62, float64(i))
		}
		return b
	}()
	msBuckets   = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000}
	kvBuckets   = [numKV][]float64{{0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400}, msBuckets, msBuckets, msBuckets, {1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000}}
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 15, 20, 25, 30}
	e2eBuckets  = []float64{0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60}
)

// hist is one histogram series: per-bucket (not cumulative) counts, the
// last slot being +Inf.
type hist struct {
	counts [32]uint64
	sum    float64
	n      uint64
	seen   bool
}

func (h *hist) observe(bounds []float64, v float64) {
	h.counts[sort.SearchFloat64s(bounds, v)]++ // first bound >= v: le semantics
	h.sum += v
	h.n++
	h.seen = true
}

func (h *hist) add(o *hist) {
	for i := range h.counts {
		h.counts[i] += o.counts[i]
	}
	h.sum += o.sum
	h.n += o.n
	h.seen = h.seen || o.seen
}

// rankMetrics is what one scheduler process (and its share of the
// tokenizer) has written to its multiprocess files.
type rankMetrics struct {
	lastLog time.Time
	g       [numGauges]float64

	bootstrapFailed, transferFailed, retries, loopIterations float64
	realtimeCompute, realtimeCache                           float64
	stages                                                   [numStages]hist
	kv                                                       [numKV]hist

	// Tokenizer side, summed over ranks on output.
	requests, promptTokens, genTokens, cachedTokens, aborted float64
	ttft, e2e                                                hist
}

func (m *rankMetrics) stage(i int, seconds float64) { m.stages[i].observe(stageBuckets, seconds) }

const (
	eName = 1 << iota
	eModelName
	eEngineType
	eV05
	eNewest
	eAll = eName | eModelName | eEngineType | eV05 | eNewest
)

var eraBits = map[string]int{EraName: eName, EraModelName: eModelName, EraEngineType: eEngineType, EraV05: eV05, EraNewest: eNewest}

type gaugeDef struct {
	idx      int
	name     string
	help     string
	oldHelp  string // HELP in the two oldest eras, when it differed
	eras     int
	priority bool // newest: QueueCount gauge with priority=""
	pid      bool // no multiprocess_mode: prometheus_client adds pid (SGLang v0.5.18: observability/metrics_collector.py)
}

// HELP strings are verbatim from SGLang v0.5.18:
// observability/metrics_collector.py and the fixtures where
// known; the others are written in SGLang's style.
var gaugeDefs = []gaugeDef{
	{gRunning, "sglang:num_running_reqs", "The number of running requests.", "The number of running requests", eAll, true, false},
	{gUsedTokens, "sglang:num_used_tokens", "The number of used tokens.", "The number of used tokens", eAll, false, false},
	{gTokenUsage, "sglang:token_usage", "The token usage.", "The token usage", eAll, false, false},
	{gGenThroughput, "sglang:gen_throughput", "The generation throughput (token/s).", "The generate throughput (token/s)", eAll, false, false},
	{gQueue, "sglang:num_queue_reqs", "The number of requests in the waiting queue.", "The number of requests in the waiting queue", eAll, true, false},
	{gCacheHit, "sglang:cache_hit_rate", "The prefix cache hit rate.", "The cache hit rate", eAll, false, false},
	{gInflight, "sglang:num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.", "", eAll, true, false},
	{gBootstrapQ, "sglang:num_prefill_prealloc_queue_reqs", "The number of requests in the prefill prealloc queue.", "", eAll &^ eNewest, false, false},
	{gBootstrapQ, "sglang:num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.", "", eNewest, true, false},
	{gDecodePrealloc, "sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", "", eAll, true, false},
	{gDecodeTransfer, "sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.", "", eAll, true, false},
	{gGrammarQueue, "sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.", "", eEngineType | eV05 | eNewest, true, false},
	{gRunningOffline, "sglang:num_running_reqs_offline_batch", "The number of running low-priority offline batch requests(label is 'batch').", "", eV05 | eNewest, false, false},
	{gMaxTotalTokens, "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", "", eV05 | eNewest, false, false},
	{gSpecAcceptLen, "sglang:spec_accept_length", "The average acceptance length of speculative decoding.", "", eEngineType | eV05 | eNewest, false, false},
	{gUtilization, "sglang:utilization", "The utilization.", "", eV05 | eNewest, false, false},
	{gStartup, "sglang:engine_startup_time", "The time taken for the engine to start up.", "", eV05 | eNewest, false, false},
	{gLoadWeights, "sglang:engine_load_weights_time", "The time taken for the engine to load weights.", "", eV05 | eNewest, false, false},
	{gCudaGraph, "sglang:is_cuda_graph", "Whether the batch is using CUDA graph.", "", eV05 | eNewest, false, false},
	{gNewTokenRatio, "sglang:new_token_ratio", "The new token ratio.", "", eV05 | eNewest, false, false},
	{gRetracted, "sglang:num_retracted_reqs", "The number of retracted requests.", "", eV05 | eNewest, false, true},
	{gPaused, "sglang:num_paused_reqs", "The number of paused requests by async weight sync.", "", eV05 | eNewest, false, true},
	{gKVSpeed, "sglang:kv_transfer_speed_gb_s", "The transfer speed of the KV cache in GB/s.", "", eV05, false, false},
	{gKVLatency, "sglang:kv_transfer_latency_ms", "The transfer latency of the KV cache in ms.", "", eV05, false, false},
	{gKVBootstrap, "sglang:kv_transfer_bootstrap_ms", "The bootstrap time of the KV transfer in ms.", "", eV05, false, false},
	{gKVAlloc, "sglang:kv_transfer_alloc_ms", "The allocation waiting time of the KV transfer in ms.", "", eV05, false, false},
	{gKVTotalMB, "sglang:kv_transfer_total_mb", "The total number of tokens transferred in the KV cache.", "", eV05, false, false},
	{gKVAvailable, "sglang:kv_available_tokens", "The number of available KV cache tokens.", "", eNewest, false, false},
	{gKVUsed, "sglang:kv_used_tokens", "The number of used KV cache tokens.", "", eNewest, false, false},
	{gKVEvictable, "sglang:kv_evictable_tokens", "The number of evictable KV cache tokens.", "", eNewest, false, false},
	{gFullTokenUsage, "sglang:full_token_usage", "The token usage of full attention layers.", "", eNewest, false, false},
	{gPageSize, "sglang:page_size", "The page size of the KV cache.", "", eNewest, false, false},
	{gContextLen, "sglang:context_len", "The context length of the model.", "", eNewest, false, false},
}

var kvHistDefs = [numKV]struct{ name, help string }{
	{"sglang:kv_transfer_speed_gb_s", "Histogram of KV cache transfer speed in GB/s."},
	{"sglang:kv_transfer_latency_ms", "Histogram of KV cache transfer latency in ms."},
	{"sglang:kv_transfer_bootstrap_ms", "Histogram of KV transfer bootstrap time in ms."},
	{"sglang:kv_transfer_alloc_ms", "Histogram of KV transfer allocation waiting time in ms."},
	{"sglang:kv_transfer_total_mb", "Histogram of KV cache transfer size in MB."},
}

type lbl struct{ k, v string }

// series is one scheduler process as /metrics shows it.
type series struct {
	base []lbl
	pid  int
	m    *rankMetrics
}

// mergeProcesses is what eras without rank labels show of several
// scheduler processes: multiprocess mode keeps the most recent gauge value
// and sums counters and histograms over the processes.
func mergeProcesses(snaps []rankMetrics) rankMetrics {
	merged := snaps[0]
	for i := 1; i < len(snaps); i++ {
		m := &snaps[i]
		if m.lastLog.After(merged.lastLog) {
			merged.g, merged.lastLog = m.g, m.lastLog
		}
		merged.bootstrapFailed += m.bootstrapFailed
		merged.transferFailed += m.transferFailed
		merged.retries += m.retries
		merged.loopIterations += m.loopIterations
		merged.realtimeCompute += m.realtimeCompute
		merged.realtimeCache += m.realtimeCache
		for j := range merged.stages {
			merged.stages[j].add(&m.stages[j])
		}
		for j := range merged.kv {
			merged.kv[j].add(&m.kv[j])
		}
	}
	return merged
}

// ContentType is what SGLang's /metrics (prometheus_client) serves.
const ContentType = "text/plain; version=0.0.4; charset=utf-8"

// MetricsHandler serves SGLang's /metrics for the whole server. While the
// server boots after a restart it refuses connections.
func (s *Sim) MetricsHandler() http.Handler { return metricsHandler(s.Booting, s.MetricsText) }

// metricsHandler serves render() as a /metrics payload, refusing
// connections while down() holds.
func metricsHandler(down func() bool, render func() []byte) http.Handler {
	return refuseWhile(down, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		body := render()
		w.Header().Set("Content-Type", ContentType)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	}))
}

// MetricsText renders the /metrics payload.
func (s *Sim) MetricsText() []byte { return s.metricsText(s.ranks) }

// NodeMetricsHandler serves the /metrics of one node of a multi-node
// instance: the scheduler series of the given ranks only, as the
// prometheus_client multiprocess directory of that node holds them
// (SGLang v0.5.18: entrypoints/engine.py, launch_dummy_health_check_server
// on node_rank >= 1). The tokenizer's counters are summed over those ranks
// too, a simplification: SGLang's tokenizer runs on node 0 only.
func (s *Sim) NodeMetricsHandler(ranks []int) http.Handler {
	rs := make([]*rank, len(ranks))
	for i, r := range ranks {
		rs[i] = s.rank(r)
	}
	return metricsHandler(s.Booting, func() []byte { return s.metricsText(rs) })
}

func (s *Sim) metricsText(ranks []*rank) []byte {
	model := s.modelName()
	era := s.opts.Era
	bit := eraBits[era]
	snaps := make([]rankMetrics, len(ranks))
	pids := make([]int, len(ranks))
	for i, r := range ranks {
		r.mu.Lock()
		snaps[i] = r.m
		pids[i] = r.pid
		r.mu.Unlock()
	}

	var tok rankMetrics
	for i := range snaps {
		m := &snaps[i]
		tok.requests += m.requests
		tok.promptTokens += m.promptTokens
		tok.genTokens += m.genTokens
		tok.cachedTokens += m.cachedTokens
		tok.aborted += m.aborted
		tok.ttft.add(&m.ttft)
		tok.e2e.add(&m.e2e)
	}
	tokBase := []lbl{{"model_name", model}}
	if era == EraName {
		tokBase = []lbl{{"name", model}}
	}

	var sched []series
	switch era {
	case EraName, EraModelName, EraEngineType:
		merged := mergeProcesses(snaps)
		sched = []series{{base: schedLabels(era, model, "", 0, 0, false), pid: pids[0], m: &merged}}
	default:
		for i, r := range ranks {
			sched = append(sched, series{base: schedLabels(era, model, "prefill", r.dp, r.pp, s.opts.DPSize > 1),
				pid: pids[i], m: &snaps[i]})
		}
	}

	w := &expWriter{}
	w.buf.Grow(int(lastMetricsSize.Load()) + 4096)
	old := era == EraName || era == EraModelName

	// Tokenizer side.
	tokSeries := []series{{base: tokBase, m: &tok}}
	w.counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", tokSeries, nil,
		func(m *rankMetrics) float64 { return m.promptTokens })
	w.counter("sglang:generation_tokens_total", "Number of generation tokens processed.", tokSeries, nil,
		func(m *rankMetrics) float64 { return m.genTokens })
	if bit&(eEngineType|eV05|eNewest) != 0 {
		w.counter("sglang:num_requests_total", "Number of requests processed.", tokSeries, nil,
			func(m *rankMetrics) float64 { return m.requests })
		w.counter("sglang:cached_tokens_total", "Number of cached prompt tokens.", tokSeries, nil,
			func(m *rankMetrics) float64 { return m.cachedTokens })
		w.counter("sglang:num_aborted_requests_total", "Number of requests aborted.", tokSeries, nil,
			func(m *rankMetrics) float64 { return m.aborted })
	}
	w.histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets,
		tokSeries, nil, func(m *rankMetrics) *hist { return &m.ttft })
	w.histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", e2eBuckets,
		tokSeries, nil, func(m *rankMetrics) *hist { return &m.e2e })

	// Scheduler gauges.
	var prio []lbl
	if era == EraNewest {
		prio = []lbl{{"priority", ""}}
	}
	for _, d := range gaugeDefs {
		if d.eras&bit == 0 {
			continue
		}
		help := d.help
		if old && d.oldHelp != "" {
			help = d.oldHelp
		}
		w.header(d.name, help, "gauge")
		for _, se := range sched {
			var extra []lbl
			if d.priority {
				extra = prio
			}
			if d.pid {
				extra = []lbl{{"pid", strconv.Itoa(se.pid)}}
			}
			w.sample(d.name, se.base, extra, se.m.g[d.idx])
		}
	}

	// Scheduler counters.
	w.counter("sglang:num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests.", sched, nil,
		func(m *rankMetrics) float64 { return m.bootstrapFailed })
	w.counter("sglang:num_transfer_failed_reqs_total", "The number of transfer failed requests.", sched, nil,
		func(m *rankMetrics) float64 { return m.transferFailed })
	if era == EraNewest {
		w.counter("sglang:num_prefill_retries_total", "Total number of prefill retries.", sched, nil,
			func(m *rankMetrics) float64 { return m.retries })
		w.counter("sglang:scheduler_loop_iterations_total", "Total number of scheduler event loop iterations.", sched, nil,
			func(m *rankMetrics) float64 { return m.loopIterations })
	}
	if bit&(eV05|eNewest) != 0 {
		w.header("sglang:realtime_tokens_total", "Total number of tokens processed by mode.", "counter")
		for _, se := range sched {
			w.sample("sglang:realtime_tokens_total", se.base, []lbl{{"mode", "prefill_compute"}}, se.m.realtimeCompute)
			w.sample("sglang:realtime_tokens_total", se.base, []lbl{{"mode", "prefill_cache"}}, se.m.realtimeCache)
		}

		// per_stage_req_latency_seconds: one series per (rank, stage) once observed.
		var stageSeries []series
		var stageExtra [][]lbl
		var stageHists []*hist
		for _, se := range sched {
			for j := 0; j < numStages; j++ {
				stageSeries = append(stageSeries, se)
				stageExtra = append(stageExtra, []lbl{{"stage", stageNames[j]}})
				stageHists = append(stageHists, &se.m.stages[j])
			}
		}
		w.histogramSeries("sglang:per_stage_req_latency_seconds", "The latency of each stage of requests.", stageBuckets,
			stageSeries, stageExtra, stageHists)
	}
	if era == EraNewest {
		for j := 0; j < numKV; j++ {
			w.histogram(kvHistDefs[j].name, kvHistDefs[j].help, kvBuckets[j], sched, nil,
				func(m *rankMetrics) *hist { return &m.kv[j] })
		}
	}
	lastMetricsSize.Store(int64(w.buf.Len()))
	return w.buf.Bytes()
}

var lastMetricsSize atomic.Int64

// schedLabels are the labels of one scheduler process's series in an era
// (SGLang metrics/collector.py to v0.5.3, observability/metrics_collector.py
// from v0.5.10): none but the model in the oldest eras (where the ranks are
// merged), engine_type="unified" from ~v0.4.9, rank labels from v0.5, and
// the disaggregation mode as engine_type in the newest.
func schedLabels(era, model, mode string, dp, pp int, multiDP bool) []lbl {
	switch era {
	case EraName:
		return []lbl{{"name", model}}
	case EraModelName:
		return []lbl{{"model_name", model}}
	case EraEngineType:
		return []lbl{{"engine_type", "unified"}, {"model_name", model}}
	case EraNewest:
		return []lbl{{"dp_rank", strconv.Itoa(dp)}, {"engine_type", mode}, {"model_name", model},
			{"moe_ep_rank", "0"}, {"pp_rank", strconv.Itoa(pp)}, {"tp_rank", "0"}}
	}
	var base []lbl
	if multiDP {
		base = append(base, lbl{"dp_rank", strconv.Itoa(dp)})
	}
	return append(base, lbl{"engine_type", "unified"}, lbl{"model_name", model},
		lbl{"pp_rank", strconv.Itoa(pp)}, lbl{"tp_rank", "0"})
}

// expWriter writes prometheus_client's text format (version 0.0.4).
type expWriter struct {
	buf     bytes.Buffer
	scratch []lbl
}

func (w *expWriter) header(name, help, typ string) {
	w.buf.WriteString("# HELP ")
	w.buf.WriteString(name)
	w.buf.WriteByte(' ')
	w.buf.WriteString(strings.NewReplacer(`\`, `\\`, "\n", `\n`).Replace(help))
	w.buf.WriteString("\n# TYPE ")
	w.buf.WriteString(name)
	w.buf.WriteByte(' ')
	w.buf.WriteString(typ)
	w.buf.WriteByte('\n')
}

// sample writes one line; labels come out sorted by name, like
// generate_latest does.
func (w *expWriter) sample(name string, base, extra []lbl, v float64) {
	ls := append(append(w.scratch[:0], base...), extra...)
	for i := 1; i < len(ls); i++ {
		for j := i; j > 0 && ls[j].k < ls[j-1].k; j-- {
			ls[j], ls[j-1] = ls[j-1], ls[j]
		}
	}
	w.scratch = ls
	w.buf.WriteString(name)
	if len(ls) > 0 {
		w.buf.WriteByte('{')
		for i, l := range ls {
			if i > 0 {
				w.buf.WriteByte(',')
			}
			w.buf.WriteString(l.k)
			w.buf.WriteString(`="`)
			writeLabelValue(&w.buf, l.v)
			w.buf.WriteByte('"')
		}
		w.buf.WriteByte('}')
	}
	w.buf.WriteByte(' ')
	w.buf.WriteString(goFloat(v))
	w.buf.WriteByte('\n')
}

func writeLabelValue(b *bytes.Buffer, v string) {
	for i := 0; i < len(v); i++ {
		switch c := v[i]; c {
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '"':
			b.WriteString(`\"`)
		default:
			b.WriteByte(c)
		}
	}
}

func (w *expWriter) counter(name, help string, ss []series, extra []lbl, get func(*rankMetrics) float64) {
	w.header(name, help, "counter")
	for _, se := range ss {
		w.sample(name, se.base, extra, get(se.m))
	}
}

func (w *expWriter) histogram(name, help string, bounds []float64, ss []series, extra []lbl, get func(*rankMetrics) *hist) {
	extras := make([][]lbl, len(ss))
	hs := make([]*hist, len(ss))
	for i, se := range ss {
		extras[i] = extra
		hs[i] = get(se.m)
	}
	w.histogramSeries(name, help, bounds, ss, extras, hs)
}

// histogramSeries writes a histogram family the way MultiProcessCollector
// orders it: every _sum line first, then _bucket lines and _count per
// series. Series never observed are absent; a family without series is
// left out.
func (w *expWriter) histogramSeries(name, help string, bounds []float64, ss []series, extras [][]lbl, hs []*hist) {
	any := false
	for _, h := range hs {
		any = any || h.seen
	}
	if !any {
		return
	}
	w.header(name, help, "histogram")
	for i, se := range ss {
		if hs[i].seen {
			w.sample(name+"_sum", se.base, extras[i], hs[i].sum)
		}
	}
	les := make([]string, len(bounds)+1)
	for j, b := range bounds {
		les[j] = goFloat(b)
	}
	les[len(bounds)] = "+Inf"
	le := make([]lbl, 0, 4)
	for i, se := range ss {
		h := hs[i]
		if !h.seen {
			continue
		}
		var acc uint64
		for j := range les {
			acc += h.counts[j]
			le = append(append(le[:0], extras[i]...), lbl{"le", les[j]})
			w.sample(name+"_bucket", se.base, le, float64(acc))
		}
		w.sample(name+"_count", se.base, extras[i], float64(acc))
	}
}

// pyRepr formats f like Python's repr(float).
func pyRepr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "nan"
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	case f == 0:
		if math.Signbit(f) {
			return "-0.0"
		}
		return "0.0"
	}
	s := strconv.FormatFloat(f, 'e', -1, 64) // shortest round-trip digits, like repr
	neg := s[0] == '-'
	if neg {
		s = s[1:]
	}
	e := strings.IndexByte(s, 'e')
	digits := strings.Replace(s[:e], ".", "", 1)
	exp, _ := strconv.Atoi(s[e+1:])
	decpt := exp + 1 // value = 0.digits * 10**decpt
	var out string
	if decpt > -4 && decpt <= 16 {
		switch {
		case decpt <= 0:
			out = "0." + strings.Repeat("0", -decpt) + digits
		case decpt >= len(digits):
			out = digits + strings.Repeat("0", decpt-len(digits)) + ".0"
		default:
			out = digits[:decpt] + "." + digits[decpt:]
		}
	} else {
		out = digits[:1]
		if len(digits) > 1 {
			out += "." + digits[1:]
		}
		x := decpt - 1
		sign := "+"
		if x < 0 {
			sign, x = "-", -x
		}
		xs := strconv.Itoa(x)
		if len(xs) < 2 {
			xs = "0" + xs
		}
		out += "e" + sign + xs
	}
	if neg {
		out = "-" + out
	}
	return out
}

// goFloat is prometheus_client's floatToGoString: repr, but large positive
// values switch to an exponent the way Go would ("8.128902e+06").
func goFloat(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "+Inf"
	case math.IsInf(f, -1):
		return "-Inf"
	case math.IsNaN(f):
		return "NaN"
	}
	s := pyRepr(f)
	dot := strings.IndexByte(s, '.')
	if f > 0 && dot > 6 {
		mant := strings.TrimRight(s[:1]+"."+s[1:dot]+s[dot+1:], "0.")
		return mant + "e+0" + strconv.Itoa(dot-1)
	}
	return s
}
