package faults

import (
	"context"
	"net/http"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// probe wraps a source and records every read: when it started, how long
// it took, and how many were under way at once.
type probe struct {
	mu        sync.Mutex
	active    int
	maxActive int
	starts    []time.Time
	durations []time.Duration
}

func (p *probe) enter() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.active++
	p.maxActive = max(p.maxActive, p.active)
	now := time.Now()
	p.starts = append(p.starts, now)
	return now
}

func (p *probe) leave(t0 time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.active--
	p.durations = append(p.durations, time.Since(t0))
}

func (p *probe) snapshot() (maxActive int, starts []time.Time, durations []time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maxActive, append([]time.Time(nil), p.starts...), append([]time.Duration(nil), p.durations...)
}

type probedPlugin struct {
	watchdog.PluginSource
	probe
}

func (p *probedPlugin) Inflight(ctx context.Context) (*pluginapi.Listing, error) {
	defer p.leave(p.enter())
	return p.PluginSource.Inflight(ctx)
}

type probedMetrics struct {
	watchdog.MetricsSource
	probe
}

func (p *probedMetrics) Scrape(ctx context.Context) (*watchdog.MetricsSample, error) {
	defer p.leave(p.enter())
	return p.MetricsSource.Scrape(ctx)
}

// trickle answers 200 at once, then sends one byte every 20 ms for ever.
func trickle(w http.ResponseWriter, r *http.Request, _ http.Handler) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	for {
		if _, err := w.Write([]byte(" ")); err != nil {
			return
		}
		_ = rc.Flush()
		select {
		case <-r.Context().Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// liveEnv is the simulator running in real time behind fault servers, and
// a watchdog on the real clock whose reads are probed.
type liveEnv struct {
	t       *testing.T
	sim     *sglangsim.Sim
	metrics *faultServer
	plugins []*faultServer
	probes  []*probedPlugin
	mprobe  *probedMetrics
	logs    *syncBuffer
	wd      *watchdog.Watchdog
	reg     *prometheus.Registry
}

func newLiveEnv(t *testing.T, simOpts sglangsim.Options, cfg watchdog.Config, pluginTimeout, adminTimeout, metricsTimeout time.Duration) *liveEnv {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	simOpts.Clock = clock.Real{}
	sim, err := sglangsim.New(simOpts)
	if err != nil {
		t.Fatal(err)
	}
	sim.Start(ctx)
	e := &liveEnv{t: t, sim: sim, logs: &syncBuffer{}}
	e.metrics = newFaultServer(t, "metrics", sim.MetricsHandler(), clock.Real{}, true)
	for i := 0; i < sim.Ranks(); i++ {
		e.plugins = append(e.plugins, newFaultServer(t, "plugin", sim.PluginHandler(i), clock.Real{}, true))
	}
	logCfg, err := logging.ParseConfig("debug", "")
	if err != nil {
		t.Fatal(err)
	}
	logger := logging.New(e.logs, logCfg)
	cfg.Clock = clock.Real{}
	cfg.Logger = logger
	e.mprobe = &probedMetrics{MetricsSource: collector.NewMetricsScraper(e.metrics.url()+"/metrics", metricsTimeout)}
	cfg.Metrics = e.mprobe
	for _, p := range e.plugins {
		pp := &probedPlugin{PluginSource: pluginapi.NewClient(p.url(), pluginapi.ClientOptions{Timeout: pluginTimeout, AdminTimeout: adminTimeout})}
		e.probes = append(e.probes, pp)
		cfg.Plugins = append(cfg.Plugins, pp)
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.wd = wd
	e.reg = prometheus.NewRegistry()
	e.reg.MustRegister(collector.NewExporter(wd.Snapshot))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("watchdog log (last 3000 bytes):\n%s", tail(e.logs.String(), 3000))
		}
	})
	return e
}

// run runs the real Run loop for d, sampling the last cycle's duration
// every 50 ms, and checks that Run returns promptly once cancelled.
func (e *liveEnv) run(d time.Duration) (lastCycles []time.Duration) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.wd.Run(ctx)
	}()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		time.Sleep(50 * time.Millisecond)
		lastCycles = append(lastCycles, e.wd.Snapshot().LastCycle)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		e.t.Fatal("Run did not return within 3 s of its context ending")
	}
	return lastCycles
}

func maxDuration(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

func minGap(starts []time.Time) time.Duration {
	sort.Slice(starts, func(i, j int) bool { return starts[i].Before(starts[j]) })
	gap := time.Duration(1 << 62)
	for i := 1; i < len(starts); i++ {
		gap = min(gap, starts[i].Sub(starts[i-1]))
	}
	return gap
}

// TestFaultSlowResponsesNeverOverlapCycles runs the real Run loop on the
// real clock for 3 s while rank 0's listing and SGLang's /metrics answer
// far slower than the interval: late headers, or a body that trickles in.
// Each read is cut at its per-source timeout (shorter than the interval),
// cycles never overlap and keep their pace, rank 1 is read every cycle, and
// the slow sources are reported down with the timeout logged.
func TestFaultSlowResponsesNeverOverlapCycles(t *testing.T) {
	const (
		interval        = 400 * time.Millisecond
		pluginTimeout   = 150 * time.Millisecond
		metricsInterval = 600 * time.Millisecond
		metricsTimeout  = 150 * time.Millisecond
		slack           = 300 * time.Millisecond // scheduling on a loaded 2-core machine
	)
	for _, tc := range []struct {
		name string
		hook hookFunc
	}{
		{"late headers", delay(3 * time.Second)},
		{"trickled body", trickle},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := productionConfig()
			cfg.Interval = interval
			cfg.MetricsInterval = metricsInterval
			e := newLiveEnv(t, sglangsim.Options{DPSize: 2, Seed: 4, ArrivalRate: 20, TransferMedian: 50 * time.Millisecond},
				cfg, pluginTimeout, defaultAdminTimeout, metricsTimeout)
			e.plugins[0].setHook(onListing(tc.hook))
			e.metrics.setHook(tc.hook)
			lastCycles := e.run(3 * time.Second)

			for i, p := range e.probes {
				maxActive, starts, durations := p.snapshot()
				if maxActive != 1 {
					t.Errorf("rank %d: %d listing reads under way at once: cycles overlapped", i, maxActive)
				}
				if len(starts) < 5 {
					t.Errorf("rank %d: only %d reads in 3 s at a %s interval", i, len(starts), interval)
				}
				if g := minGap(starts); g < interval-20*time.Millisecond {
					t.Errorf("rank %d: two cycles started %s apart, want at least the %s interval", i, g, interval)
				}
				if i == 0 {
					if d := maxDuration(durations); d > pluginTimeout+slack {
						t.Errorf("slow listing read took %s, want it cut at the %s timeout", d, pluginTimeout)
					}
				}
			}
			_, _, durations0 := e.probes[0].snapshot()
			_, starts1, _ := e.probes[1].snapshot()
			t.Logf("%d cycles in 3 s; slow listing reads took at most %s (timeout %s); cycle starts at least %s apart; longest cycle %s",
				len(starts1), maxDuration(durations0).Round(time.Millisecond), pluginTimeout, minGap(starts1).Round(time.Millisecond),
				maxDuration(lastCycles).Round(time.Millisecond))
			maxActive, starts, durations := e.mprobe.snapshot()
			if maxActive != 1 || len(starts) < 3 {
				t.Errorf("/metrics reads: %d at once, %d in all", maxActive, len(starts))
			}
			if d := maxDuration(durations); d > metricsTimeout+slack {
				t.Errorf("slow /metrics read took %s, want it cut at the %s timeout", d, metricsTimeout)
			}
			t.Logf("%d /metrics reads, the longest %s (timeout %s)", len(starts), maxDuration(durations).Round(time.Millisecond), metricsTimeout)
			if d := maxDuration(lastCycles); d > interval {
				t.Errorf("a cycle took %s, longer than the %s interval", d, interval)
			}
			p0, p1 := e.plugins[0].url(), e.plugins[1].url()
			if v, _ := gather(t, e.reg, "sglang_watchdog_scrape_success", "source", "plugin", "target", p0); v != 0 {
				t.Error("the slow rank is not reported down")
			}
			if v, _ := gather(t, e.reg, "sglang_watchdog_scrape_success", "source", "plugin", "target", p1); v != 1 {
				t.Error("the healthy rank is not reported up")
			}
			if v, _ := gather(t, e.reg, "sglang_watchdog_scrape_duration_seconds", "source", "plugin", "target", p0); v > (pluginTimeout + slack).Seconds() {
				t.Errorf("scrape_duration_seconds of the slow rank = %v", v)
			}
			if v, _ := gather(t, e.reg, "sglang_watchdog_scrape_failures_total", "source", "metrics"); v < 3 {
				t.Errorf("scrape_failures_total{source=metrics} = %v", v)
			}
			if len(e.logs.lines("level=error", "reading plugin listing failed", "target="+p0, "deadline exceeded")) == 0 {
				t.Error("the listing timeout is not logged")
			}
			if len(e.logs.lines("level=error", "reading SGLang metrics failed", "deadline exceeded")) == 0 {
				t.Error("the /metrics timeout is not logged")
			}
		})
	}
}

// TestFaultSlowAdminCallsStallEveryRank: the admin call of rank 0 hangs
// until its timeout (an overloaded scheduler: the plugin answers 503 only
// after 5 s) while four of its rooms are stuck. The actuator makes the
// calls one after another inside the cycle, so one cycle lasts about
// candidates × --force-fail.timeout (4 × 7 s = 28 s with the defaults), and
// for that long no rank's listing is read: a stuck room elsewhere, or
// progress, goes unseen. A cycle should stop acting once its interval is
// spent and leave the rest to the next cycles.
func TestFaultSlowAdminCallsStallEveryRank(t *testing.T) {
	const (
		interval      = 300 * time.Millisecond
		pluginTimeout = 150 * time.Millisecond
		adminTimeout  = 500 * time.Millisecond
		slack         = 300 * time.Millisecond
	)
	cfg := productionConfig()
	cfg.Interval = interval
	cfg.Deadline = time.Second
	cfg.StallWindow = time.Second
	cfg.MaxPerMinute = 60
	e := newLiveEnv(t, sglangsim.Options{DPSize: 2, Seed: 8}, cfg, pluginTimeout, adminTimeout, time.Second)
	e.plugins[0].setHook(onAdmin(hang))
	for i := 0; i < 4; i++ {
		// Stuck from entry, all four in the same cycle.
		e.sim.Inject(0, sglangsim.PinAbortBeforeRegister)
	}
	e.run(4 * time.Second)
	if n := len(e.plugins[0].adminCalls()); n < 4 {
		t.Fatalf("setup: %d admin calls, want the 4 stuck rooms tried", n)
	}
	_, starts, _ := e.probes[1].snapshot()
	sort.Slice(starts, func(i, j int) bool { return starts[i].Before(starts[j]) })
	var worst time.Duration
	for i := 1; i < len(starts); i++ {
		worst = max(worst, starts[i].Sub(starts[i-1]))
	}
	// At most one slow admin call (and its re-read) may delay a cycle.
	if limit := interval + adminTimeout + pluginTimeout + slack; worst > limit {
		t.Errorf("rank 1 went unread for %s while rank 0's admin calls hung, want at most %s", worst, limit)
	}
}
