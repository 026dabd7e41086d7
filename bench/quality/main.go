// Command quality measures how well stuck requests are detected and
// released, on a trace replayed from a seed on the fake clock:
//
//	go run ./bench/quality -seed 1
//
// The trace (see -h for its knobs): DP8 prefill ranks (sglangsim, newest
// label era, NIXL), 100k healthy requests with lognormal (heavy-tailed) KV
// transfer times, 0.5% slow-but-progressing transfers, SGLang health checks
// every 10 s plus one stuck health check per rank, and 1% pins (1000)
// spread evenly over the three mechanisms (PinResurrection,
// PinAbortBeforeRegister, PinStuckHandle), evenly spaced in time so that
// the default rate limit (6 force-fails a minute) is never the bottleneck.
//
// It replays the trace (Step-driven simulator, a scheduler pass every
// 100 ms of simulated time, no goroutines of its own) three ways:
//
//  1. with the real watchdog (watchdog.New, RunCycle every 1 s and
//     ScrapeMetrics every 15 s, mode auto, default windows), reading the
//     plugin listings through an in-process PluginSource adapter and
//     /metrics through collector.ParseMetrics;
//  2. stock SGLang: the same trace without the watchdog;
//  3. for both, the raw-metrics alert group alerts/sglang-raw.rules.yml:
//     /metrics is sampled every 15 s, written as OpenMetrics with
//     timestamps, backfilled with `promtool tsdb create-blocks-from
//     openmetrics`, and every alert expression is evaluated by a real
//     Prometheus (127.0.0.1, free port) with /api/v1/query_range at a 15 s
//     step; `for:` is applied to the result as Prometheus does (the
//     expression present at every evaluation for that long).
//
// Then it sweeps --watchdog.deadline {10,20,30,60}s x --watchdog.stall-window
// {5,10,30}s over the same trace. Everything printed is reproducible from
// -seed; only the Prometheus time shift depends on the wall clock.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/bench/simplugin"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// epoch is where the simulated clock starts; fixed so that a seed replays
// the same trace. Prometheus sees the samples shifted to end just before
// the wall-clock now.
var epoch = time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC)

type options struct {
	seed         int64
	ranks        int
	healthy      int
	pinPct       float64
	slowPct      float64
	duration     time.Duration
	median       time.Duration
	step         time.Duration
	stockTimeout time.Duration
	stockStep    time.Duration
	sweep        bool
	prom         bool
	stock        bool
	prometheus   string
	promtool     string
	rules        string
	keep         bool
	parallel     int
	deadline     time.Duration
	stall        time.Duration
	hcEvery      time.Duration
	memprofile   string
	cpuprofile   string
}

func main() {
	var o options
	flag.Int64Var(&o.seed, "seed", 1, "seed of the trace and the simulator")
	flag.IntVar(&o.ranks, "ranks", 8, "DP ranks")
	flag.IntVar(&o.healthy, "healthy", 100000, "healthy requests")
	flag.Float64Var(&o.pinPct, "pins", 1, "pinned requests, in percent of -healthy, spread over the three mechanisms")
	flag.Float64Var(&o.slowPct, "slow", 0.5, "slow-but-progressing requests (30-150 s), in percent of -healthy")
	flag.DurationVar(&o.duration, "duration", 4*time.Hour, "simulated length of the trace (1000 pins at <= 6 a minute need about 3 h)")
	flag.DurationVar(&o.median, "median", time.Second, "median healthy KV transfer time (lognormal, sigma 1, capped at 100 medians)")
	flag.DurationVar(&o.step, "step", 100*time.Millisecond, "simulated time between scheduler passes")
	flag.DurationVar(&o.stockStep, "stock-step", time.Second, "simulated time between scheduler passes in the stock replay, where tens of thousands of requests pile up behind wedged shards")
	flag.DurationVar(&o.stockTimeout, "decode-timeout", 300*time.Second, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT of stock SGLang's decode side")
	flag.BoolVar(&o.sweep, "sweep", true, "sweep deadline x stall window")
	flag.BoolVar(&o.stock, "stock", true, "replay stock SGLang (no watchdog) too")
	flag.BoolVar(&o.prom, "prom", true, "evaluate alerts/sglang-raw.rules.yml with real Prometheus")
	flag.StringVar(&o.prometheus, "prometheus", "/usr/bin/prometheus", "Prometheus binary")
	flag.StringVar(&o.promtool, "promtool", "/usr/bin/promtool", "promtool binary")
	flag.StringVar(&o.rules, "rules", "alerts/sglang-raw.rules.yml", "raw-metrics rule file")
	flag.BoolVar(&o.keep, "keep", false, "keep the temp dir (OpenMetrics files, TSDB, Prometheus log)")
	flag.IntVar(&o.parallel, "parallel", runtime.NumCPU(), "replays run at once (sweep)")
	flag.DurationVar(&o.deadline, "deadline", 60*time.Second, "--watchdog.deadline of the main run")
	flag.DurationVar(&o.stall, "stall", 30*time.Second, "--watchdog.stall-window of the main run")
	flag.DurationVar(&o.hcEvery, "health-checks", 10*time.Second, "SGLang health checks every (round robin over the ranks); 0: none")
	flag.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the harness")
	flag.StringVar(&o.memprofile, "memprofile", "", "write a heap profile of the harness at the end")
	flag.Parse()
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err == nil {
			_ = pprof.StartCPUProfile(f)
			defer pprof.StopCPUProfile()
		}
	}
	code := run(o)
	if o.memprofile != "" {
		if f, err := os.Create(o.memprofile); err == nil {
			_ = pprof.WriteHeapProfile(f)
			f.Close()
		}
	}
	if o.cpuprofile != "" {
		pprof.StopCPUProfile()
	}
	os.Exit(code)
}

// ---------------------------------------------------------------- trace

type arrival struct {
	at       time.Duration // from the start of the trace
	rank     int
	behavior sglangsim.Behavior
}

type trace struct {
	o        options
	arrivals []arrival // sorted by at
	pins     int
}

func makeTrace(o options) *trace {
	rng := rand.New(rand.NewPCG(uint64(o.seed), 0x5eed))
	t := &trace{o: o}
	// Traffic stops 6 minutes before the end so that every healthy request
	// (at most 100 medians) and every pin (deadline + windows) can finish.
	traffic := o.duration - 6*time.Minute
	uniform := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Float64()*float64(hi-lo)) }
	for i := 0; i < o.healthy; i++ {
		t.arrivals = append(t.arrivals, arrival{at: uniform(0, traffic), rank: rng.IntN(o.ranks), behavior: sglangsim.BehaviorHealthy})
	}
	slow := int(math.Round(float64(o.healthy) * o.slowPct / 100))
	for i := 0; i < slow; i++ {
		t.arrivals = append(t.arrivals, arrival{at: uniform(0, traffic), rank: rng.IntN(o.ranks), behavior: sglangsim.BehaviorSlow})
	}
	for r := 0; r < o.ranks; r++ {
		t.arrivals = append(t.arrivals, arrival{at: time.Minute + time.Duration(r)*7*time.Second, rank: r, behavior: sglangsim.BehaviorStuckHealthCheck})
	}
	// Pins: evenly spaced slots over [2 min, end - 8 min], one pin at a
	// random point of each slot, mechanisms in a shuffled even mix.
	t.pins = int(math.Round(float64(o.healthy) * o.pinPct / 100))
	kinds := make([]sglangsim.Behavior, t.pins)
	for i := range kinds {
		kinds[i] = []sglangsim.Behavior{sglangsim.BehaviorPinResurrection, sglangsim.BehaviorPinAbortBeforeRegister, sglangsim.BehaviorPinStuckHandle}[i%3]
	}
	rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	if t.pins > 0 {
		from, to := 2*time.Minute, o.duration-8*time.Minute
		slot := (to - from) / time.Duration(t.pins)
		for i := 0; i < t.pins; i++ {
			at := from + time.Duration(i)*slot + uniform(0, slot)
			t.arrivals = append(t.arrivals, arrival{at: at, rank: rng.IntN(o.ranks), behavior: kinds[i]})
		}
	}
	sort.SliceStable(t.arrivals, func(i, j int) bool { return t.arrivals[i].at < t.arrivals[j].at })
	return t
}

// ---------------------------------------------------------------- replay

type replayConfig struct {
	step          time.Duration
	watchdog      bool
	deadline      time.Duration
	stall         time.Duration
	collectSeries bool
}

type replayResult struct {
	cfg       replayConfig
	pins      *pinTracker
	records   []sglangsim.Record
	series    *seriesStore
	calls     map[string]int // force-fail results
	skips     map[string]int
	ridEvents map[string][]string
	wall      time.Duration
	end       time.Time
}

// simMetrics is the watchdog's MetricsSource over the simulator: the body
// SGLang would serve, parsed by the collector.
type simMetrics struct {
	sim  *sglangsim.Sim
	last []byte
}

func (m *simMetrics) Target() string { return "sim://metrics" }

func (m *simMetrics) Scrape(context.Context) (*watchdog.MetricsSample, error) {
	m.last = m.sim.MetricsText()
	return collector.ParseMetrics(m.last)
}

// pinTracker remembers, for every pin, when the listing last showed a change
// of its poll or progress: the moment the pin took hold, as far as anyone
// watching could tell. A pin blocked behind another pin's wedged shard
// keeps moving once the wedge clears, so it takes hold later than it
// entered.
type pinTracker struct {
	mu   sync.Mutex
	pins map[string]*pinTrack
}

type pinTrack struct {
	seen       bool
	poll       string
	progress   int64
	lastChange time.Time
}

func (p *pinTracker) observe(l *pluginapi.Listing, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := range l.Inflight {
		r := &l.Inflight[i]
		t, ok := p.pins[r.RID]
		if !ok {
			continue
		}
		if !t.seen || t.poll != r.Poll || t.progress != r.Progress {
			t.seen, t.poll, t.progress, t.lastChange = true, r.Poll, r.Progress, now
		}
	}
}

// trackedSource is a PluginSource that lets the tracker see each listing.
type trackedSource struct {
	*simplugin.Source
	pins  *pinTracker
	clock clock.Clock
}

func (s *trackedSource) Inflight(ctx context.Context) (*pluginapi.Listing, error) {
	l, err := s.Source.Inflight(ctx)
	if err == nil {
		s.pins.observe(l, s.clock.Now())
	}
	return l, err
}

func replay(t *trace, rc replayConfig) (*replayResult, error) {
	wallStart := time.Now()
	o := t.o
	c := clock.NewFake(epoch)
	sim, err := sglangsim.New(sglangsim.Options{
		Clock: c, DPSize: o.ranks, Era: sglangsim.EraNewest, Backend: sglangsim.BackendNIXL, Seed: o.seed,
		TransferMedian: o.median, HealthCheckEvery: o.hcEvery, HookRunsWhenEmpty: true,
	})
	if err != nil {
		return nil, err
	}
	res := &replayResult{cfg: rc, calls: map[string]int{}, skips: map[string]int{}, ridEvents: map[string][]string{},
		pins: &pinTracker{pins: map[string]*pinTrack{}}}
	if rc.collectSeries {
		res.series = newSeriesStore()
	}
	metrics := &simMetrics{sim: sim}
	var w *watchdog.Watchdog
	if rc.watchdog {
		cfg := watchdog.Config{
			Clock: c, Metrics: metrics, Interval: time.Second, MetricsInterval: 15 * time.Second,
			Deadline: rc.deadline, StallWindow: rc.stall, PinWindow: 2 * time.Minute, MaxRooms: 100000,
			Mode: watchdog.ModeAuto, MaxPerMinute: 6, ConfirmTimeout: time.Minute,
			OnEvent: func(e watchdog.Event) {
				switch e.Kind {
				case watchdog.EventForceFail:
					res.calls[e.Result]++
				case watchdog.EventSkipped:
					res.skips[e.Reason]++
				}
				if e.RID != "" {
					res.ridEvents[e.RID] = append(res.ridEvents[e.RID], fmt.Sprintf("%s %s%s%s age %.1fs poll %s progress %d",
						c.Now().Sub(epoch).Round(100*time.Millisecond), e.Kind, opt(" ", e.Result), opt(" ", e.Reason), e.Age, e.Poll, e.Progress))
				}
			},
		}
		for _, s := range simplugin.New(sim, false) {
			s.Live = true
			cfg.Plugins = append(cfg.Plugins, &trackedSource{Source: s, pins: res.pins, clock: c})
		}
		if w, err = watchdog.New(cfg); err != nil {
			return nil, err
		}
	}
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(uint64(o.seed), 0xb007))
	next := 0
	step := rc.step
	cycleEvery := int(time.Second / step)
	scrapeEvery := int(15 * time.Second / step)
	if cycleEvery < 1 || scrapeEvery < 1 || time.Second%step != 0 {
		return nil, fmt.Errorf("-step must divide 1s")
	}
	sample := func(k int) {
		var body []byte
		if w != nil {
			w.ScrapeMetrics(ctx)
			body = metrics.last
		} else if res.series != nil {
			body = sim.MetricsText()
		}
		if res.series != nil {
			res.series.add(c.Now(), body)
		}
	}
	sample(0)
	steps := int(o.duration / step)
	for k := 1; k <= steps; k++ {
		c.Advance(step)
		el := time.Duration(k) * step
		for next < len(t.arrivals) && t.arrivals[next].at <= el {
			a := t.arrivals[next]
			spec := sglangsim.RequestSpec{Rank: a.rank, Behavior: a.behavior}
			if a.behavior == sglangsim.BehaviorHealthy || a.behavior == sglangsim.BehaviorSlow {
				spec.Bootstrap = 2*time.Millisecond + time.Duration(rng.Float64()*float64(28*time.Millisecond))
			}
			rid, _ := sim.Submit(spec)
			switch a.behavior {
			case sglangsim.BehaviorPinResurrection, sglangsim.BehaviorPinAbortBeforeRegister, sglangsim.BehaviorPinStuckHandle:
				res.pins.pins[rid] = &pinTrack{}
			}
			next++
		}
		sim.Step()
		if w != nil && k%cycleEvery == 0 {
			w.RunCycle(ctx)
		}
		if k%scrapeEvery == 0 {
			sample(k)
		}
	}
	res.records = sim.Records()
	res.end = c.Now()
	res.wall = time.Since(wallStart)
	return res, nil
}

func opt(sep, s string) string {
	if s == "" {
		return ""
	}
	return sep + s
}

// ---------------------------------------------------------------- analysis

func isPin(k sglangsim.Kind) bool {
	return k == sglangsim.KindPinResurrection || k == sglangsim.KindPinAbortBeforeRegister || k == sglangsim.KindPinStuckHandle
}

type analysis struct {
	pins, released        int
	lat                   []time.Duration // pin entry to release, released pins
	excess                []time.Duration // release after the earliest moment the windows allow it
	heldLate              int             // pins over deadline+3s from entry
	byKind                map[sglangsim.Kind][]time.Duration
	missed                []sglangsim.Record
	falseFF               []sglangsim.Record // progressing or healthy/slow/health check forced
	blockedForced         int                // blocked_by_wedge rooms force-failed while still blocked
	blocked               int                // rooms that waited behind a wedge
	blockedDelay          []time.Duration    // their time in the inflight queue (completed ones)
	healthyInflight       []time.Duration    // healthy requests' time in the inflight queue
	slowInflight          []time.Duration
	stuckHCForced         int
	healthyDone, healthyN int
}

func analyse(r *replayResult) *analysis {
	a := &analysis{byKind: map[sglangsim.Kind][]time.Duration{}}
	for _, rec := range r.records {
		forced := !rec.ForcedAt.IsZero()
		switch {
		case isPin(rec.Kind):
			a.pins++
			if rec.Outcome == sglangsim.OutcomeFailedForced {
				a.released++
				d := rec.Left.Sub(rec.EnteredInflight)
				a.lat = append(a.lat, d)
				a.byKind[rec.Kind] = append(a.byKind[rec.Kind], d)
				if t := r.pins.pins[rec.RID]; t != nil && t.seen {
					// The earliest a correct watchdog may act: old enough
					// and still for a whole stall window.
					allowed := rec.EnteredInflight.Add(r.cfg.deadline)
					if st := t.lastChange.Add(r.cfg.stall); st.After(allowed) {
						allowed = st
					}
					a.excess = append(a.excess, rec.Left.Sub(allowed))
				}
				if d > r.cfg.deadline+3*time.Second {
					a.heldLate++
				}
			} else {
				a.missed = append(a.missed, rec)
			}
			continue
		case rec.Kind == sglangsim.KindBlockedByWedge:
			a.blocked++
			if forced && !rec.ProgressingWhenForced {
				a.blockedForced++
			}
			if !rec.Left.IsZero() && !rec.EnteredInflight.IsZero() {
				a.blockedDelay = append(a.blockedDelay, rec.Left.Sub(rec.EnteredInflight))
			}
		case rec.Kind == sglangsim.KindHealthy:
			a.healthyN++
			if rec.Outcome == sglangsim.OutcomeSuccess {
				a.healthyDone++
				a.healthyInflight = append(a.healthyInflight, rec.Left.Sub(rec.EnteredInflight))
			}
		case rec.Kind == sglangsim.KindSlow:
			if rec.Outcome == sglangsim.OutcomeSuccess {
				a.slowInflight = append(a.slowInflight, rec.Left.Sub(rec.EnteredInflight))
			}
		}
		if rec.ProgressingWhenForced || (forced && (rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow || rec.Kind == sglangsim.KindHealthCheck)) {
			a.falseFF = append(a.falseFF, rec)
		}
		if forced && rec.Kind == sglangsim.KindHealthCheck {
			a.stuckHCForced++
		}
	}
	return a
}

func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func maxDur(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

func secs(d time.Duration) string { return fmt.Sprintf("%.1f s", d.Seconds()) }

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
	done chan error
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
	p := &promServer{base: "http://" + addr, cmd: cmd, done: make(chan error, 1)}
	go func() { p.done <- cmd.Wait(); logf.Close() }()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-p.done:
			return nil, fmt.Errorf("prometheus exited: %v (log: %s)", err, logf.Name())
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

// ---------------------------------------------------------------- main

func run(o options) int {
	t0 := time.Now()
	tr := makeTrace(o)
	fmt.Printf("# Detection quality, seed %d\n\n", o.seed)
	fmt.Printf("trace: DP%d, %s simulated, %d healthy requests (lognormal transfers, median %s), %d slow-but-progressing (30-150 s, a chunk every 2.5-5 s), %d pins (1%% of healthy, the three mechanisms evenly), %d stuck health checks, health checks every %s (0: none); a scheduler pass every %s\n",
		o.ranks, o.duration, o.healthy, o.median, int(math.Round(float64(o.healthy)*o.slowPct/100)), tr.pins, o.ranks, o.hcEvery, o.step)

	// The main runs: the watchdog with the default windows, and stock.
	type job struct {
		name string
		cfg  replayConfig
	}
	jobs := []job{{"watchdog", replayConfig{step: o.step, watchdog: true, deadline: o.deadline, stall: o.stall, collectSeries: o.prom}}}
	if o.stock {
		jobs = append(jobs, job{"stock", replayConfig{step: o.stockStep, collectSeries: o.prom}})
	}
	var sweepCfgs []replayConfig
	if o.sweep {
		for _, d := range []time.Duration{10, 20, 30, 60} {
			for _, s := range []time.Duration{5, 10, 30} {
				if d*time.Second == o.deadline && s*time.Second == o.stall {
					continue // the main run
				}
				sweepCfgs = append(sweepCfgs, replayConfig{step: o.step, watchdog: true, deadline: d * time.Second, stall: s * time.Second})
			}
		}
	}
	for _, c := range sweepCfgs {
		jobs = append(jobs, job{fmt.Sprintf("sweep-%s-%s", c.deadline, c.stall), c})
	}
	results := make([]*replayResult, len(jobs))
	errs := make([]error, len(jobs))
	sem := make(chan struct{}, max(o.parallel, 1))
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			results[i], errs[i] = replay(tr, j.cfg)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", jobs[i].name, err)
			return 1
		}
	}
	mainRun := results[0]
	a := analyse(mainRun)
	fmt.Printf("replay: %d records; one replay took %s of wall time (watchdog), all %d replays %s\n\n",
		len(mainRun.records), mainRun.wall.Round(100*time.Millisecond), len(jobs), time.Since(t0).Round(100*time.Millisecond))

	p50, p999 := quantile(a.healthyInflight, 0.5), quantile(a.healthyInflight, 0.999)
	ok := "ok"
	if p999 < 10*p50 {
		ok = "NOT heavy-tailed enough"
	}
	fmt.Printf("healthy transfer times (time in the inflight queue, %d completed of %d): p50 %s, p99 %s, p99.9 %s (%.1fx the median: %s), max %s\n",
		a.healthyDone, a.healthyN, secs(p50), secs(quantile(a.healthyInflight, 0.99)), secs(p999), float64(p999)/float64(max(p50, 1)), ok, secs(maxDur(a.healthyInflight)))
	for _, lim := range []time.Duration{10 * time.Second, 20 * time.Second, 30 * time.Second, 60 * time.Second} {
		n := 0
		for _, d := range a.healthyInflight {
			if d > lim {
				n++
			}
		}
		fmt.Printf("  healthy transfers longer than %s: %d (%.3f%%)\n", lim, n, 100*float64(n)/float64(max(len(a.healthyInflight), 1)))
	}
	fmt.Printf("slow transfers: %d completed, p50 %s, max %s\n\n", len(a.slowInflight), secs(quantile(a.slowInflight, 0.5)), secs(maxDur(a.slowInflight)))

	// 1. The watchdog.
	fmt.Printf("## Watchdog, auto mode, deadline %s, stall window %s, interval 1s, /metrics every 15s\n\n", o.deadline, o.stall)
	recall := float64(a.released) / float64(max(a.pins, 1))
	target := o.deadline + 3*time.Second
	fmt.Printf("recall %d/%d = %.2f%%; false force-fails %d; release latency (inflight entry to release) median %s, p99 %s, max %s (target <= %s: %s)\n",
		a.released, a.pins, 100*recall, len(a.falseFF), secs(quantile(a.lat, 0.5)), secs(quantile(a.lat, 0.99)), secs(maxDur(a.lat)), secs(target), verdict(maxDur(a.lat) <= target && a.released > 0))
	for _, k := range []sglangsim.Kind{sglangsim.KindPinResurrection, sglangsim.KindPinAbortBeforeRegister, sglangsim.KindPinStuckHandle} {
		ds := a.byKind[k]
		fmt.Printf("  %-26s released %4d, median %s, max %s\n", k, len(ds), secs(quantile(ds, 0.5)), secs(maxDur(ds)))
	}
	fmt.Printf("pins released later than deadline + 3 s after entering: %d; release after the earliest moment the windows allow (max(entry + deadline, last visible change of poll/progress + stall window)): median %s, max %s (<= 3 s: %s)\n",
		a.heldLate, secs(quantile(a.excess, 0.5)), secs(maxDur(a.excess)), verdict(maxDur(a.excess) <= 3*time.Second && len(a.excess) > 0))
	fmt.Printf("force-fail calls by result: %v; skips: %v\n", a2s(mainRun.calls), a2s(mainRun.skips))
	fmt.Printf("rooms that waited behind a wedged shard: %d (force-failed while still blocked: %d), their time in the queue median %s, max %s\n",
		a.blocked, a.blockedForced, secs(quantile(a.blockedDelay, 0.5)), secs(maxDur(a.blockedDelay)))
	fmt.Printf("stuck health checks force-failed: %d\n", a.stuckHCForced)
	for i, m := range a.missed {
		if i == 20 {
			fmt.Printf("  ... %d more\n", len(a.missed)-20)
			break
		}
		fmt.Printf("  MISSED %s rank %d %s entered %s outcome %s; events: %s\n", m.Kind, m.Rank, m.RID, m.EnteredInflight.Sub(epoch), m.Outcome, strings.Join(mainRun.ridEvents[m.RID], "; "))
	}
	for i, m := range a.falseFF {
		if i == 20 {
			fmt.Printf("  ... %d more\n", len(a.falseFF)-20)
			break
		}
		fmt.Printf("  FALSE FORCE-FAIL %s rank %d %s entered %s forced %s; events: %s\n", m.Kind, m.Rank, m.RID, m.EnteredInflight.Sub(epoch), m.ForcedAt.Sub(epoch), strings.Join(mainRun.ridEvents[m.RID], "; "))
	}
	// Pins released later than deadline + 3 s after entering: split into
	// those that took hold late (still moving after entering, typically
	// blocked behind another pin's wedged shard, then progressing once it
	// cleared: no watchdog may act before last change + stall window) and
	// those the watchdog itself released late (more than 3 s after the
	// windows allowed it).
	tookHoldLate, watchdogLate := 0, 0
	var late []sglangsim.Record
	for _, rec := range mainRun.records {
		if !isPin(rec.Kind) || rec.Outcome != sglangsim.OutcomeFailedForced {
			continue
		}
		t := mainRun.pins.pins[rec.RID]
		allowed := rec.EnteredInflight.Add(o.deadline)
		if t != nil && t.seen && t.lastChange.Add(o.stall).After(allowed) {
			allowed = t.lastChange.Add(o.stall)
		}
		if rec.Left.Sub(rec.EnteredInflight) > target {
			if allowed.Sub(rec.EnteredInflight) > target-3*time.Second {
				tookHoldLate++
			}
		}
		if rec.Left.Sub(allowed) > 3*time.Second {
			watchdogLate++
			late = append(late, rec)
		}
	}
	fmt.Printf("over deadline + 3 s: %d took hold late (they kept moving after entering, e.g. blocked behind another pin's wedged shard and then progressing: no watchdog may act before last change + stall window); released more than 3 s after the windows allowed: %d\n", tookHoldLate, watchdogLate)
	for i, m := range late {
		if i == 10 {
			fmt.Printf("  ... %d more\n", len(late)-10)
			break
		}
		lc := "?"
		if t := mainRun.pins.pins[m.RID]; t != nil && t.seen {
			lc = secs(t.lastChange.Sub(m.EnteredInflight)) + " after entry (" + t.poll + ", progress " + strconv.FormatInt(t.progress, 10) + ")"
		}
		fmt.Printf("  LATE %s rank %d %s entered %s released after %s; last visible change %s; events: %s\n", m.Kind, m.Rank, m.RID, m.EnteredInflight.Sub(epoch), secs(m.Left.Sub(m.EnteredInflight)), lc, strings.Join(mainRun.ridEvents[m.RID], "; "))
	}
	// Healthy requests force-failed while blocked behind a wedged shard.
	n := 0
	for _, rec := range mainRun.records {
		if rec.Kind != sglangsim.KindBlockedByWedge || rec.ForcedAt.IsZero() {
			continue
		}
		if n == 10 {
			fmt.Printf("  ... more\n")
			break
		}
		n++
		// The pin of the same rank force-failed just before, if any.
		pin := ""
		for _, p := range mainRun.records {
			if isPin(p.Kind) && p.Rank == rec.Rank && !p.ForcedAt.IsZero() && !p.ForcedAt.After(rec.ForcedAt) && rec.ForcedAt.Sub(p.ForcedAt) < 2*time.Second {
				pin = fmt.Sprintf("; %s %s on the same rank force-failed %s before", p.Kind, p.RID[:8], rec.ForcedAt.Sub(p.ForcedAt))
			}
		}
		fmt.Printf("  BLOCKED-AND-FORCED rank %d %s room%%4=%d entered %s forced %s (age %s, progressing=%v)%s; events: %s\n", rec.Rank, rec.RID, rec.Room%4, rec.EnteredInflight.Sub(epoch),
			rec.ForcedAt.Sub(epoch), secs(rec.ForcedAt.Sub(rec.EnteredInflight)), rec.ProgressingWhenForced, pin, strings.Join(mainRun.ridEvents[rec.RID], "; "))
	}

	// 2. Stock SGLang.
	var stock *replayResult
	if o.stock {
		stock = results[1]
		sa := analyse(stock)
		var held []time.Duration
		for _, rec := range stock.records {
			if isPin(rec.Kind) {
				end := stock.end
				if !rec.Left.IsZero() {
					end = rec.Left
				}
				held = append(held, end.Sub(rec.EnteredInflight))
			}
		}
		stuckAtEnd := 0
		for _, rec := range stock.records {
			if rec.Outcome == sglangsim.OutcomeInflight && !isPin(rec.Kind) && rec.Kind != sglangsim.KindHealthCheck {
				stuckAtEnd++
			}
		}
		fmt.Printf("\n## Stock SGLang (no watchdog), same trace (a scheduler pass every %s; replay took %s)\n\n", o.stockStep, stock.wall.Round(100*time.Millisecond))
		fmt.Printf("pins released by SGLang: %d/%d. The decode side gives up after %s (SGLANG_DISAGGREGATION_WAITING_TIMEOUT): the client's request fails then; the prefill request and its KV pages stay until a restart: held %s (median) to %s (max) by the end of the trace, a lower bound.\n",
			sa.pins-len(sa.missed), sa.pins, o.stockTimeout, secs(quantile(held, 0.5)), secs(maxDur(held)))
		fmt.Printf("healthy requests that completed: %d/%d; requests still in the inflight queue at the end (not pins; mostly behind wedged shards): %d; rooms that waited behind a wedge: %d\n",
			sa.healthyDone, sa.healthyN, stuckAtEnd, sa.blocked)
	}

	// 3. Raw metrics with real Prometheus.
	var raws []rawResult
	if o.prom {
		dir, err := os.MkdirTemp("", "wd-quality-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if o.keep {
			fmt.Printf("\n(temp dir kept: %s)\n", dir)
		} else {
			defer os.RemoveAll(dir)
		}
		raws = append(raws, evalRaw(o, dir, "watchdog", mainRun.series, epoch, mainRun.end))
		if stock != nil {
			raws = append(raws, evalRaw(o, dir, "stock", stock.series, epoch, stock.end))
		}
		pinRules := map[string]bool{"SGLangPrefillInflightQueuePinned": true, "SGLangPrefillKVTransferStalled": true}
		for i, r := range raws {
			res := mainRun
			if i == 1 {
				res = stock
			}
			fmt.Printf("\n## Raw-metrics rules (alerts/sglang-raw.rules.yml), real Prometheus, series of the %s run\n\n", r.name)
			if r.err != nil {
				fmt.Printf("ERROR: %v\n", r.err)
				continue
			}
			fmt.Printf("(Prometheus evaluated the rules over the trace shifted by %s; eval step 15 s; `for` applied to the range result)\n", r.shift.Round(time.Second))
			for _, rl := range r.rules {
				n, first := 0, time.Duration(-1)
				for _, e := range r.episodes {
					if e.alert == rl.Alert {
						n++
						if first < 0 {
							first = e.fired.Sub(epoch)
						}
					}
				}
				f := "never"
				if first >= 0 {
					f = "first at " + first.String() + " into the trace"
				}
				fmt.Printf("  %-34s for %-4s fired %d time(s), %s\n", rl.Alert, rl.For, n, f)
			}
			fmt.Printf("which part holds (an evaluation counts if any series is present):\n")
			for _, d := range r.diag {
				fmt.Printf("  %s\n", d)
			}
			st := matchPins(res, r, pinRules)
			fmt.Printf("pins alerted (Pinned or Stalled on the pin's dp_rank while the pin was inside): %d/%d", st.alerted, a.pins)
			if len(st.delays) > 0 {
				fmt.Printf(", time to alert median %s, min %s, max %s", secs(quantile(st.delays, 0.5)), secs(quantile(st.delays, 0)), secs(maxDur(st.delays)))
			}
			fmt.Printf("; firing episodes with no pin inside their rank (false alerts): %d of %d\n", st.falseAlerts, st.episodes)
		}
	}

	// Sweep.
	if o.sweep {
		fmt.Printf("\n## Sweep: deadline x stall window (same trace, auto mode)\n\n")
		fmt.Printf("| deadline | stall window | recall | false force-fails | blocked rooms force-failed | release median | release p99 | release max | released > 3 s after the windows allowed | over deadline + 3 s |\n|---|---|---|---|---|---|---|---|---|---|\n")
		all := append([]*replayResult{mainRun}, results[len(jobs)-len(sweepCfgs):]...)
		sort.Slice(all, func(i, j int) bool {
			if all[i].cfg.deadline != all[j].cfg.deadline {
				return all[i].cfg.deadline < all[j].cfg.deadline
			}
			return all[i].cfg.stall < all[j].cfg.stall
		})
		safe := map[time.Duration]time.Duration{}
		for _, r := range all {
			sa := analyse(r)
			overExcess := 0
			for _, d := range sa.excess {
				if d > 3*time.Second {
					overExcess++
				}
			}
			fmt.Printf("| %s | %s | %d/%d | %d | %d | %s | %s | %s | %d | %d |\n", r.cfg.deadline, r.cfg.stall, sa.released, sa.pins, len(sa.falseFF), sa.blockedForced,
				secs(quantile(sa.lat, 0.5)), secs(quantile(sa.lat, 0.99)), secs(maxDur(sa.lat)), overExcess, sa.heldLate)
			if len(sa.falseFF) == 0 && sa.released == sa.pins {
				if cur, ok := safe[r.cfg.stall]; !ok || r.cfg.deadline < cur {
					safe[r.cfg.stall] = r.cfg.deadline
				}
			}
		}
		fmt.Println()
		for _, s := range []time.Duration{5 * time.Second, 10 * time.Second, 30 * time.Second} {
			if d, ok := safe[s]; ok {
				fmt.Printf("stall window %s: smallest deadline with 100%% recall and no false force-fail: %s\n", s, d)
			} else {
				fmt.Printf("stall window %s: no deadline in the sweep is free of false force-fails\n", s)
			}
		}
		fmt.Printf("longest healthy transfer in the trace: %s, longest slow one: %s (a deadline below these is safe only through the stall window)\n",
			secs(maxDur(a.healthyInflight)), secs(maxDur(a.slowInflight)))
	}
	fmt.Printf("\ntotal wall time %s\n", time.Since(t0).Round(100*time.Millisecond))
	return 0
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

func a2s(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}
