package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// ---------------------------------------------------------------- series

// seriesStore keeps the samples of the families the raw rules use.
type seriesStore struct {
	samples map[string][]omSample
}

type omSample struct {
	ts    time.Time
	value string
}

func newSeriesStore() *seriesStore { return &seriesStore{samples: map[string][]omSample{}} }

var rawFamilies = map[string]bool{
	"sglang:num_prefill_inflight_queue_reqs": true,
	"sglang:num_decode_transfer_queue_reqs":  true,
	"sglang:num_decode_prealloc_queue_reqs":  true,
	"sglang:num_transfer_failed_reqs_total":  true,
	"sglang:num_bootstrap_failed_reqs_total": true,
	"sglang:prompt_tokens_total":             true,
	"sglang:num_requests_total":              true,
	"sglang:generation_tokens_total":         true,
}

func (s *seriesStore) add(at time.Time, body []byte) {
	for _, l := range strings.Split(string(body), "\n") {
		if l == "" || l[0] == '#' {
			continue
		}
		end := strings.IndexAny(l, "{ ")
		if end < 0 {
			continue
		}
		name := l[:end]
		keep := rawFamilies[name]
		if name == "sglang:per_stage_req_latency_seconds_count" {
			keep = strings.Contains(l, `stage="prefill_transfer_kv_cache"`) || strings.Contains(l, `stage="decode_transferred"`)
		}
		if !keep {
			continue
		}
		sp := strings.LastIndexByte(l, ' ')
		// Clone: a substring would keep the whole 0.6 MB body alive.
		key, val := l[:sp], strings.Clone(l[sp+1:])
		if _, ok := s.samples[key]; !ok {
			key = strings.Clone(key)
		}
		s.samples[key] = append(s.samples[key], omSample{at, val})
	}
}

const instanceLabels = `instance="sglang-prefill:30000",job="sglang"`

// writeOpenMetrics writes every series with timestamps shifted by shift,
// grouped by metric name, as promtool's backfill wants.
func (s *seriesStore) writeOpenMetrics(w io.Writer, shift time.Duration) error {
	keys := make([]string, 0, len(s.samples))
	for k := range s.samples {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		var series string
		switch {
		case strings.HasSuffix(k, "{}"):
			series = k[:len(k)-1] + instanceLabels + "}"
		case strings.HasSuffix(k, "}"):
			series = k[:len(k)-1] + "," + instanceLabels + "}"
		default:
			series = k + "{" + instanceLabels + "}"
		}
		for _, smp := range s.samples[k] {
			ms := smp.ts.Add(shift).UnixMilli()
			fmt.Fprintf(&b, "%s %s %d.%03d\n", series, smp.value, ms/1000, ms%1000)
		}
		if b.Len() > 1<<20 {
			if _, err := io.WriteString(w, b.String()); err != nil {
				return err
			}
			b.Reset()
		}
	}
	b.WriteString("# EOF\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// ---------------------------------------------------------------- Prometheus

type rule struct {
	Alert string `yaml:"alert"`
	Expr  string `yaml:"expr"`
	For   string `yaml:"for"`
}

func loadRules(path string) ([]rule, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var f struct {
		Groups []struct {
			Rules []rule `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(b, &f); err != nil {
		return nil, err
	}
	var out []rule
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				out = append(out, r)
			}
		}
	}
	return out, nil
}

type promServer struct {
	base string
	cmd  *exec.Cmd
	// done is closed once Prometheus has exited, with waitErr set.
	done    chan struct{}
	waitErr error
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func startPrometheus(o options, dir, tsdb string) (*promServer, error) {
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, []byte("global:\n  evaluation_interval: 15s\n  scrape_interval: 15s\n"), 0o644); err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	cmd := exec.Command(o.prometheus, "--config.file="+cfg, "--storage.tsdb.path="+tsdb,
		"--storage.tsdb.retention.time=100y", "--web.listen-address="+addr, "--query.max-samples=200000000")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &promServer{base: "http://" + addr, cmd: cmd, done: make(chan struct{})}
	go func() { p.waitErr = cmd.Wait(); logf.Close(); close(p.done) }()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			return nil, fmt.Errorf("prometheus exited: %v (log: %s)", p.waitErr, logf.Name())
		default:
		}
		resp, err := http.Get(p.base + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return p, nil
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	p.stop()
	return nil, fmt.Errorf("prometheus not ready after 60 s")
}

func (p *promServer) stop() {
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

type promSeries struct {
	Metric map[string]string `json:"metric"`
	Values [][2]any          `json:"values"`
}

func (p *promServer) queryRange(expr string, start, end time.Time, step time.Duration) ([]promSeries, error) {
	q := url.Values{}
	q.Set("query", expr)
	q.Set("start", strconv.FormatInt(start.Unix(), 10))
	q.Set("end", strconv.FormatInt(end.Unix(), 10))
	q.Set("step", strconv.Itoa(int(step.Seconds())))
	resp, err := http.PostForm(p.base+"/api/v1/query_range", q)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []promSeries `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, err
	}
	if out.Status != "success" {
		return nil, fmt.Errorf("query_range: %s", out.Error)
	}
	return out.Data.Result, nil
}

// episode is one alert instance that fired: pending from active, firing
// from fired (active + for) until last (the last evaluation it was present).
type episode struct {
	alert  string
	labels map[string]string
	active time.Time
	fired  time.Time
	last   time.Time
}

// firing applies `for` to a query_range result evaluated at every step.
func firing(alert string, res []promSeries, forDur, step time.Duration) []episode {
	var out []episode
	for _, s := range res {
		var cur *episode
		var prev time.Time
		for _, v := range s.Values {
			tsf, _ := v[0].(float64)
			ts := time.Unix(0, int64(tsf*1e9)).UTC()
			if cur != nil && ts.Sub(prev) > step+time.Second {
				// Absent at an evaluation in between: the alert resets.
				if !cur.fired.IsZero() {
					out = append(out, *cur)
				}
				cur = nil
			}
			if cur == nil {
				cur = &episode{alert: alert, labels: s.Metric, active: ts}
			}
			if cur.fired.IsZero() && ts.Sub(cur.active) >= forDur {
				cur.fired = ts
			}
			cur.last = ts
			prev = ts
		}
		if cur != nil && !cur.fired.IsZero() {
			out = append(out, *cur)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].fired.Before(out[j].fired) })
	return out
}

type rawResult struct {
	diag     []string
	name     string
	episodes []episode
	rules    []rule
	shift    time.Duration
	err      error
}

// evalRaw backfills the series of each replay into its own TSDB, starts
// Prometheus on each in turn and evaluates every alert.
func evalRaw(o options, dir string, name string, s *seriesStore, start, end time.Time) rawResult {
	r := rawResult{name: name}
	rules, err := loadRules(o.rules)
	if err != nil {
		r.err = err
		return r
	}
	r.rules = rules
	// Shift the trace so that it ends five minutes before now: the data is
	// then recent (inside any retention, queried like live data) and
	// entirely in the past.
	shift := time.Now().Add(-5 * time.Minute).Truncate(15 * time.Second).Sub(end)
	r.shift = shift
	sub := filepath.Join(dir, name)
	if err := os.MkdirAll(sub, 0o755); err != nil {
		r.err = err
		return r
	}
	omPath := filepath.Join(sub, "series.om.txt")
	f, err := os.Create(omPath)
	if err != nil {
		r.err = err
		return r
	}
	if err := s.writeOpenMetrics(f, shift); err != nil {
		f.Close()
		r.err = err
		return r
	}
	f.Close()
	tsdb := filepath.Join(sub, "tsdb")
	out, err := exec.Command(o.promtool, "tsdb", "create-blocks-from", "openmetrics", omPath, tsdb).CombinedOutput()
	if err != nil {
		r.err = fmt.Errorf("promtool: %v: %s", err, out)
		return r
	}
	p, err := startPrometheus(o, sub, tsdb)
	if err != nil {
		r.err = err
		return r
	}
	defer p.stop()
	step := 15 * time.Second
	qs, qe := start.Add(shift), end.Add(shift)
	// Diagnostics: how often each half of the pinned/stalled rules holds.
	evals := int(qe.Sub(qs)/step) + 1
	for _, d := range rawDiagnostics {
		res, err := p.queryRange(d, qs, qe, step)
		if err != nil {
			r.err = fmt.Errorf("%s: %w", d, err)
			return r
		}
		present := map[float64]bool{}
		for _, s := range res {
			for _, v := range s.Values {
				if f, ok := v[0].(float64); ok {
					present[f] = true
				}
			}
		}
		r.diag = append(r.diag, fmt.Sprintf("%5.1f%% of evaluations: %s", 100*float64(len(present))/float64(evals), d))
	}
	for _, rl := range rules {
		res, err := p.queryRange(rl.Expr, qs, qe, step)
		if err != nil {
			r.err = fmt.Errorf("%s: %w", rl.Alert, err)
			return r
		}
		fd, err := time.ParseDuration(rl.For)
		if err != nil && rl.For != "" {
			r.err = fmt.Errorf("%s: for %q: %w", rl.Alert, rl.For, err)
			return r
		}
		for _, e := range firing(rl.Alert, res, fd, step) {
			// Back to simulated time.
			e.active, e.fired, e.last = e.active.Add(-shift), e.fired.Add(-shift), e.last.Add(-shift)
			r.episodes = append(r.episodes, e)
		}
	}
	return r
}

// rawDiagnostics are the parts of SGLangPrefillInflightQueuePinned and
// SGLangPrefillKVTransferStalled, to show which part keeps them silent.
var rawDiagnostics = []string{
	`min_over_time(sglang:num_prefill_inflight_queue_reqs{priority=""}[5m]) > 0 and changes(sglang:num_prefill_inflight_queue_reqs{priority=""}[5m]) == 0 and count_over_time(sglang:num_prefill_inflight_queue_reqs{priority=""}[5m]) >= 18`,
	`min_over_time(sglang:num_prefill_inflight_queue_reqs{priority=""}[5m]) > 0 and changes(sglang:num_prefill_inflight_queue_reqs{priority=""}[5m]) > 0 and count_over_time(sglang:num_prefill_inflight_queue_reqs{priority=""}[5m]) >= 18`,
	`sum by (instance) (increase(sglang:num_transfer_failed_reqs_total[5m])) > 0`,
	`sum by (instance) (increase(sglang:per_stage_req_latency_seconds_count{stage="prefill_transfer_kv_cache"}[5m])) > 0`,
	`sum by (instance) (increase(sglang:prompt_tokens_total[5m])) > 0`,
	`sum by (instance) (increase(sglang:num_requests_total[5m])) > 0`,
}

// pinAlerts matches the per-rank pin alerts to the pins of a replay.
type pinAlertStats struct {
	alerted     int
	delays      []time.Duration
	falseAlerts int
	episodes    int
	firstFired  time.Duration // from the trace start; -1 none
}

func matchPins(res *replayResult, r rawResult, alerts map[string]bool) pinAlertStats {
	st := pinAlertStats{firstFired: -1}
	byRank := map[string][]episode{}
	for _, e := range r.episodes {
		if !alerts[e.alert] {
			continue
		}
		st.episodes++
		if st.firstFired < 0 || e.fired.Sub(epoch) < st.firstFired {
			st.firstFired = e.fired.Sub(epoch)
		}
		byRank[e.labels["dp_rank"]] = append(byRank[e.labels["dp_rank"]], e)
	}
	inside := func(rec sglangsim.Record, t time.Time) bool {
		return !rec.EnteredInflight.IsZero() && !rec.EnteredInflight.After(t) && (rec.Left.IsZero() || rec.Left.After(t))
	}
	var pins []sglangsim.Record
	for _, rec := range res.records {
		if isPin(rec.Kind) {
			pins = append(pins, rec)
		}
	}
	for _, rec := range pins {
		for _, e := range byRank[strconv.Itoa(rec.Rank)] {
			if inside(rec, e.fired) {
				st.alerted++
				st.delays = append(st.delays, e.fired.Sub(rec.EnteredInflight))
				break
			}
		}
	}
	for rank, eps := range byRank {
		for _, e := range eps {
			hit := false
			for _, rec := range pins {
				if strconv.Itoa(rec.Rank) == rank && inside(rec, e.fired) {
					hit = true
					break
				}
			}
			if !hit {
				st.falseAlerts++
			}
		}
	}
	return st
}
