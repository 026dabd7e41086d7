// Command quality measures how well stuck requests are detected and
// released, and what a transfer wedge costs, on a trace replayed from a
// seed on the fake clock:
//
//	go run ./bench/quality -seed 1
//
// The trace (see -h for its knobs): DP8 prefill ranks (sglangsim, newest
// label era, NIXL, transfer queues keyed by destination decode ports), 25k
// healthy requests over an hour with lognormal (heavy-tailed) KV transfer
// times, 0.5% slow-but-progressing transfers, SGLang health checks every
// 10 s plus one stuck health check per rank, and 0.4% pins (100) spread
// evenly over the three mechanisms (PinResurrection,
// PinAbortBeforeRegister, PinStuckHandle) and evenly in time. A stuck
// handle wedges its transfer queue until the server restarts: every later
// room bound for that queue waits behind it (sglang-facts §10.1).
//
// It replays the trace (Step-driven simulator, no goroutines of its own)
// under several configurations of the real watchdog (watchdog.New,
// RunCycle every 1 s and ScrapeMetrics every 15 s, mode auto, default
// windows, reading the plugin listings through bench/simplugin and
// /metrics through collector.ParseMetrics) and without it (stock SGLang):
//
//   - defaults: as shipped (fail-fast on, 180 a minute; restart off), and
//     on the decode server (-decode-ranks ranks) the decode pod's own
//     watchdog: a second watchdog.New over the decode ranks and the decode
//     /metrics, default decode deadline (180 s) and rails, asking the
//     prefill watchdog for verdicts through pluginapi.VerdictClient and the
//     prefill watchdog's VerdictHandler (in memory, no sockets), as
//     --decode.prefill-watchdog-url does;
//   - decode-off: the same without the decode-side watchdog;
//   - decode-6: the decode-side watchdog with --decode.max-per-minute=6,
//     the budget decode releases shared with prefill's deadline path before;
//   - ff-off: --force-fail.fail-fast=false;
//   - restart-30m: fail-fast and --restart.mode=auto with the default
//     --restart.min-interval (30 min);
//   - restart-5m: the same with a 5 min interval;
//   - stock: no watchdog.
//
// The decode side is reported from the simulator's ground truth: decode
// slot hold time (Record.DecodeHold), how decode let go (force-fail, its
// own waiting timeout, its heartbeat after a prefill restart), the decode
// requests held as "transfer may be live" (skip transfer_live), pages freed
// under a live transfer (Record.UnsafeFree) and late writes that landed
// (Sim.Corruptions), by what freed the pages.
//
// A restart restarts the whole simulated server: the requests inside are
// lost, and for its boot time (30 s) the listings and /metrics fail and
// arriving requests are refused by the simulator (counted apart from the
// requests it admitted).
//
// For the defaults and stock runs, the raw-metrics alert group
// alerts/sglang-raw.rules.yml is evaluated by a real Prometheus: /metrics
// sampled every 15 s, backfilled with `promtool tsdb create-blocks-from
// openmetrics`, every alert expression queried with /api/v1/query_range
// at a 15 s step, `for:` applied as Prometheus does. -sweep adds
// --watchdog.deadline {10,20,30,60}s x --watchdog.stall-window {5,10,30}s
// on the defaults configuration. Everything printed is reproducible from
// -seed; only the Prometheus time shift depends on the wall clock.
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

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
	configs      string
	prometheus   string
	promtool     string
	rules        string
	keep         bool
	parallel     int
	deadline     time.Duration
	stall        time.Duration
	hcEvery      time.Duration
	bootTime     time.Duration
	decodeRanks  int
	mechanisms   string
	memprofile   string
	cpuprofile   string
}

func main() {
	var o options
	flag.Int64Var(&o.seed, "seed", 1, "seed of the trace and the simulator")
	flag.IntVar(&o.ranks, "ranks", 8, "DP ranks")
	flag.IntVar(&o.healthy, "healthy", 25000, "healthy requests")
	flag.Float64Var(&o.pinPct, "pins", 0.4, "pinned requests, in percent of -healthy, spread over the three mechanisms")
	flag.Float64Var(&o.slowPct, "slow", 0.5, "slow-but-progressing requests (30-150 s), in percent of -healthy")
	flag.DurationVar(&o.duration, "duration", time.Hour, "simulated length of the trace")
	flag.DurationVar(&o.median, "median", time.Second, "median healthy KV transfer time (lognormal, sigma 1, capped at 100 medians)")
	flag.DurationVar(&o.step, "step", 100*time.Millisecond, "simulated time between scheduler passes")
	flag.DurationVar(&o.stockStep, "stock-step", time.Second, "simulated time between scheduler passes in the stock replay, where thousands of requests pile up behind wedged queues")
	flag.DurationVar(&o.stockTimeout, "decode-timeout", sglangsim.DefaultDecodeWaitingTimeout, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT of decode")
	flag.StringVar(&o.mechanisms, "mechanisms", "resurrection,abort-before-register,stuck-handle", "pin mechanisms to mix evenly (resurrection, abort-before-register, stuck-handle); without stuck-handle no transfer queue wedges")
	flag.IntVar(&o.decodeRanks, "decode-ranks", 2, "decode ranks (scheduler processes of the decode server); the decode endpoints are spread over them")
	flag.DurationVar(&o.bootTime, "boot-time", sglangsim.DefaultBootTime, "how long a restarted server boots (listings, /metrics and arrivals refused)")
	flag.BoolVar(&o.sweep, "sweep", false, "also sweep deadline x stall window on the defaults configuration (12 more replays)")
	flag.BoolVar(&o.stock, "stock", true, "replay stock SGLang (no watchdog) too")
	flag.StringVar(&o.configs, "configs", "defaults,decode-off,decode-6,ff-off,restart-30m,restart-5m", "watchdog configurations to replay (defaults, decode-off, decode-6, ff-off, restart-30m, restart-5m)")
	flag.BoolVar(&o.prom, "prom", true, "evaluate alerts/sglang-raw.rules.yml with real Prometheus on the defaults and stock runs")
	flag.StringVar(&o.prometheus, "prometheus", "/usr/bin/prometheus", "Prometheus binary")
	flag.StringVar(&o.promtool, "promtool", "/usr/bin/promtool", "promtool binary")
	flag.StringVar(&o.rules, "rules", "alerts/sglang-raw.rules.yml", "raw-metrics rule file")
	flag.BoolVar(&o.keep, "keep", false, "keep the temp dir (OpenMetrics files, TSDB, Prometheus log)")
	flag.IntVar(&o.parallel, "parallel", runtime.NumCPU(), "replays run at once")
	flag.DurationVar(&o.deadline, "deadline", 60*time.Second, "--watchdog.deadline of the main runs")
	flag.DurationVar(&o.stall, "stall", 30*time.Second, "--watchdog.stall-window of the main runs")
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
	mechs := pinMechanisms(o.mechanisms)
	kinds := make([]sglangsim.Behavior, t.pins)
	for i := range kinds {
		kinds[i] = mechs[i%len(mechs)]
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

// pinMechanisms parses -mechanisms; main checks it first.
func pinMechanisms(list string) []sglangsim.Behavior {
	var out []sglangsim.Behavior
	for _, m := range strings.Split(list, ",") {
		if b, ok := mechanismNames[strings.TrimSpace(m)]; ok {
			out = append(out, b)
		}
	}
	return out
}

var mechanismNames = map[string]sglangsim.Behavior{
	"resurrection":          sglangsim.BehaviorPinResurrection,
	"abort-before-register": sglangsim.BehaviorPinAbortBeforeRegister,
	"stuck-handle":          sglangsim.BehaviorPinStuckHandle,
}

func isPinBehavior(b sglangsim.Behavior) bool {
	return b == sglangsim.BehaviorPinResurrection || b == sglangsim.BehaviorPinAbortBeforeRegister || b == sglangsim.BehaviorPinStuckHandle
}

// ---------------------------------------------------------------- replay

type replayConfig struct {
	name          string
	step          time.Duration
	watchdog      bool
	deadline      time.Duration
	stall         time.Duration
	failFast      bool
	decode        bool // a decode-side watchdog on the decode server
	decodeBudget  int  // its --decode.max-per-minute
	restart       watchdog.Mode
	restartMin    time.Duration
	collectSeries bool
}

// configs are the watchdog configurations of the comparison, by name.
func configs(o options) map[string]replayConfig {
	base := replayConfig{step: o.step, watchdog: true, deadline: o.deadline, stall: o.stall, failFast: true, decode: true, decodeBudget: watchdog.DefaultDecodePerMinute, restart: watchdog.ModeOff}
	ffOff, r30, r5, decOff, dec6 := base, base, base, base, base
	ffOff.failFast = false
	decOff.decode = false
	dec6.decodeBudget = 6
	r30.restart, r30.restartMin = watchdog.ModeAuto, 30*time.Minute
	r5.restart, r5.restartMin = watchdog.ModeAuto, 5*time.Minute
	out := map[string]replayConfig{"defaults": base, "decode-off": decOff, "decode-6": dec6, "ff-off": ffOff, "restart-30m": r30, "restart-5m": r5}
	for k, c := range out {
		c.name = k
		out[k] = c
	}
	return out
}

type wedgeEvent struct {
	at    time.Time
	rank  int
	queue int
	room  uint64
	rule  string
}

type replayResult struct {
	cfg       replayConfig
	pins      *pinTracker
	records   []sglangsim.Record
	series    *seriesStore
	calls     map[string]int    // force-fail results by trigger: "trigger/result"
	skips     map[string]int    // by reason
	trigger   map[string]string // rid -> trigger of the force-fail that set its lever
	wedges    []wedgeEvent      // transfer wedges diagnosed (or suspected)
	restarts  map[string]int    // restart escalations by result
	restartAt []time.Time       // restarts performed
	refused   map[sglangsim.Kind]int
	ridEvents map[string][]string // pins only
	// The decode-side watchdog: its force-fail results and skips, and
	// the requests it held because their transfer may be live.
	decCalls   map[string]int
	decSkips   map[string]int
	heldLive   map[string]bool
	lookups    map[string]int // prefill verdicts it got, by answer
	corruption []sglangsim.Corruption
	wall       time.Duration
	end        time.Time
}

// simMetrics is the watchdog's MetricsSource over the simulator: the body
// SGLang would serve, parsed by the collector; refused while it boots.
type simMetrics struct {
	sim  *sglangsim.Sim
	last []byte
}

func (m *simMetrics) Target() string { return "sim://metrics" }

func (m *simMetrics) Scrape(context.Context) (*watchdog.MetricsSample, error) {
	if m.sim.Booting() {
		m.last = nil
		return nil, simplugin.ErrBooting
	}
	m.last = m.sim.MetricsText()
	return collector.ParseMetrics(m.last)
}

// pinTracker remembers, for every pin, when the listing last showed a
// change of its poll, progress or transfer in flight: the moment the pin
// took hold, as far as anyone watching could tell (a pin queued behind
// another wedge never moves at all), and whether it ever held a transfer
// in flight (a stuck handle that wedged its queue).
type pinTracker struct {
	mu   sync.Mutex
	pins map[string]*pinTrack
}

type pinTrack struct {
	seen       bool
	poll       string
	progress   int64
	inFlight   bool
	wedging    bool // seen frozen with its transfer in flight
	queue      int
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
		inFlight := r.TransferInFlight != nil && *r.TransferInFlight
		if !t.seen || t.poll != r.Poll || t.progress != r.Progress || t.inFlight != inFlight {
			t.seen, t.poll, t.progress, t.inFlight, t.lastChange = true, r.Poll, r.Progress, inFlight, now
		}
		if r.TransferQueue != nil {
			t.queue = *r.TransferQueue
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

// simToken is the plugin token of the replayed server (restart needs one).
const simToken = "bench-quality-token"

func replay(t *trace, rc replayConfig) (*replayResult, error) {
	wallStart := time.Now()
	o := t.o
	c := clock.NewFake(epoch)
	sim, err := sglangsim.New(sglangsim.Options{
		Clock: c, DPSize: o.ranks, Era: sglangsim.EraNewest, Backend: sglangsim.BackendNIXL, Seed: o.seed,
		TransferMedian: o.median, HealthCheckEvery: o.hcEvery, HookRunsWhenEmpty: true,
		Token: simToken, AllowRestart: true, BootTime: o.bootTime, DecodeWaitingTimeout: o.stockTimeout,
		DecodeDPSize: o.decodeRanks,
	})
	if err != nil {
		return nil, err
	}
	res := &replayResult{cfg: rc, calls: map[string]int{}, skips: map[string]int{}, trigger: map[string]string{},
		restarts: map[string]int{}, refused: map[sglangsim.Kind]int{}, ridEvents: map[string][]string{},
		decCalls: map[string]int{}, decSkips: map[string]int{}, heldLive: map[string]bool{}, lookups: map[string]int{},
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
			FailFast: rc.failFast, FailFastPerMinute: 180, RestartMode: rc.restart, RestartMinInterval: rc.restartMin,
			OnEvent: func(e watchdog.Event) {
				switch e.Kind {
				case watchdog.EventForceFail:
					res.calls[e.Trigger+"/"+e.Result]++
					if e.Result == pluginapi.ResultFlipped || e.Result == pluginapi.ResultAlreadyFailed {
						res.trigger[e.RID] = e.Trigger
					}
				case watchdog.EventSkipped:
					res.skips[e.Reason]++
				case watchdog.EventTransferWedged:
					res.wedges = append(res.wedges, wedgeEvent{at: c.Now(), rank: e.DPRank, queue: e.Queue, room: e.Room, rule: e.Reason})
				case watchdog.EventRestart:
					res.restarts[e.Result]++
					if e.Result == watchdog.RestartRestarted {
						res.restartAt = append(res.restartAt, c.Now())
					}
				}
				if _, pin := res.pins.pins[e.RID]; pin && e.RID != "" {
					res.ridEvents[e.RID] = append(res.ridEvents[e.RID], fmt.Sprintf("%s %s%s%s%s age %.1fs poll %s progress %d",
						c.Now().Sub(epoch).Round(100*time.Millisecond), e.Kind, opt(" ", e.Trigger), opt(" ", e.Result), opt(" ", e.Reason), e.Age, e.Poll, e.Progress))
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
	var dw *watchdog.Watchdog
	decMetrics := &simDecodeMetrics{sim: sim}
	if rc.watchdog && rc.decode {
		if dw, err = decodeWatchdog(sim, c, w, decMetrics, rc.decodeBudget, res); err != nil {
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
	sample := func() {
		var body []byte
		if dw != nil {
			dw.ScrapeMetrics(ctx)
		}
		if w != nil {
			w.ScrapeMetrics(ctx)
			body = metrics.last
		} else if !sim.Booting() {
			if res.series != nil {
				body = sim.MetricsText()
			}
			// Stock: look at the listings now and then, to count the
			// wedges (nobody acts on them).
			for r := 0; r < sim.Ranks(); r++ {
				l := sim.Listing(r)
				res.pins.observe(&l, c.Now())
			}
		}
		if res.series != nil && body != nil {
			res.series.add(c.Now(), body)
		}
	}
	sample()
	steps := int(o.duration / step)
	for k := 1; k <= steps; k++ {
		c.Advance(step)
		el := time.Duration(k) * step
		for next < len(t.arrivals) && t.arrivals[next].at <= el {
			a := t.arrivals[next]
			next++
			spec := sglangsim.RequestSpec{Rank: a.rank, Behavior: a.behavior}
			if a.behavior == sglangsim.BehaviorHealthy || a.behavior == sglangsim.BehaviorSlow {
				spec.Bootstrap = 2*time.Millisecond + time.Duration(rng.Float64()*float64(28*time.Millisecond))
			}
			rid, _, err := sim.TrySubmit(spec)
			if err != nil {
				// Nobody listens while the server boots: the request is
				// refused (a router retries it elsewhere, if it can).
				res.refused[behaviorKind(a.behavior)]++
				continue
			}
			if isPinBehavior(a.behavior) {
				res.pins.mu.Lock()
				res.pins.pins[rid] = &pinTrack{queue: -1}
				res.pins.mu.Unlock()
			}
		}
		sim.Step()
		if w != nil && k%cycleEvery == 0 {
			w.RunCycle(ctx)
		}
		if dw != nil && k%cycleEvery == 0 {
			dw.RunCycle(ctx)
		}
		if k%scrapeEvery == 0 {
			sample()
		}
	}
	// Refused arrivals are counted in res.refused; the analysis is of the
	// requests the server admitted.
	res.records = slices.DeleteFunc(sim.Records(), func(rec sglangsim.Record) bool {
		return rec.Outcome == sglangsim.OutcomeRefusedBooting
	})
	res.corruption = sim.Corruptions()
	if dw != nil {
		for k, v := range dw.Snapshot().VerdictLookups {
			res.lookups[k] = int(v)
		}
	}
	res.end = c.Now()
	res.wall = time.Since(wallStart)
	return res, nil
}

// simDecodeMetrics is the decode server's /metrics, parsed by the
// collector; refused while the decode server boots.
type simDecodeMetrics struct{ sim *sglangsim.Sim }

func (m *simDecodeMetrics) Target() string { return "sim://decode-metrics" }

func (m *simDecodeMetrics) Scrape(context.Context) (*watchdog.MetricsSample, error) {
	if m.sim.DecodeBooting() {
		return nil, simplugin.ErrBooting
	}
	return collector.ParseMetrics(m.sim.DecodeMetricsText())
}

// verdictTransport carries the decode-side watchdog's verdict lookups to
// the prefill watchdog's VerdictHandler in memory: the real client (URL
// from the bootstrap host, network check, 5 s cache on the fake clock) and
// the real handler, without sockets.
type verdictTransport struct{ h http.Handler }

func (t verdictTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	rec := httptest.NewRecorder()
	t.h.ServeHTTP(rec, r)
	return rec.Result(), nil
}

// decodeWatchdog is the decode pod's own watchdog, as deployed: a second
// instance that reads only the decode ranks and the decode server's
// /metrics, with the default decode deadline and rails, and asks the
// prefill pod's watchdog (prefill, nil when there is none) for its
// verdicts over the verdict API, as --decode.prefill-watchdog-url does.
func decodeWatchdog(sim *sglangsim.Sim, c clock.Clock, prefill *watchdog.Watchdog, metrics watchdog.MetricsSource, budget int, res *replayResult) (*watchdog.Watchdog, error) {
	cfg := watchdog.Config{
		Clock: c, Metrics: metrics, Interval: time.Second, MetricsInterval: 15 * time.Second,
		Deadline: 60 * time.Second, DecodeDeadline: watchdog.DefaultDecodeDeadline, StallWindow: 30 * time.Second, PinWindow: 2 * time.Minute,
		MaxRooms: 100000, Mode: watchdog.ModeAuto, MaxPerMinute: 6, DecodePerMinute: budget, ConfirmTimeout: time.Minute, FailFastPerMinute: 180,
		OnEvent: func(e watchdog.Event) {
			switch e.Kind {
			case watchdog.EventForceFail:
				res.decCalls[e.Result]++
			case watchdog.EventSkipped:
				res.decSkips[e.Reason]++
				if e.Reason == watchdog.SkipTransferLive {
					res.heldLive[e.RID] = true
				}
			}
		},
	}
	if prefill != nil {
		host, _, err := net.SplitHostPort(sim.Options().BootstrapAddr)
		if err != nil {
			return nil, err
		}
		addr, err := netip.ParseAddr(host)
		if err != nil {
			return nil, err
		}
		v, err := pluginapi.NewVerdictClient(pluginapi.VerdictClientOptions{
			URLTemplate: "http://{host}:9433", Networks: []netip.Prefix{netip.PrefixFrom(addr, addr.BitLen())},
			Client: &http.Client{Transport: verdictTransport{prefill.VerdictHandler()}}, Timeout: 500 * time.Millisecond,
			CacheTTL: 5 * time.Second, Now: c.Now,
		})
		if err != nil {
			return nil, err
		}
		cfg.Verdicts = v
	}
	for _, d := range simplugin.NewDecode(sim) {
		cfg.Plugins = append(cfg.Plugins, d)
	}
	return watchdog.New(cfg)
}

func behaviorKind(b sglangsim.Behavior) sglangsim.Kind {
	switch b {
	case sglangsim.BehaviorSlow:
		return sglangsim.KindSlow
	case sglangsim.BehaviorHealthCheck, sglangsim.BehaviorStuckHealthCheck:
		return sglangsim.KindHealthCheck
	case sglangsim.BehaviorPinResurrection:
		return sglangsim.KindPinResurrection
	case sglangsim.BehaviorPinAbortBeforeRegister:
		return sglangsim.KindPinAbortBeforeRegister
	case sglangsim.BehaviorPinStuckHandle:
		return sglangsim.KindPinStuckHandle
	}
	return sglangsim.KindHealthy
}

func opt(sep, s string) string {
	if s == "" {
		return ""
	}
	return sep + s
}

// ---------------------------------------------------------------- analysis

func isPin(k sglangsim.Kind) bool { return k.Pin() }

var pinKinds = []sglangsim.Kind{sglangsim.KindPinResurrection, sglangsim.KindPinAbortBeforeRegister, sglangsim.KindPinStuckHandle}

// fate is where one class of requests ended.
type fate struct {
	n          int
	success    int
	auto       int // lever set by the deadline path (or the alert webhook)
	failFast   int // lever set by fail-fast
	failed     int // failed by itself
	restarted  int // lost in a restart (the client got an error)
	held       int // still in the server at the end of the trace
	lat        []time.Duration
	heldAge    []time.Duration // age at the end of the trace of the held ones
	decodeHold []time.Duration // decode slot held: DecodeReleased (or the end) - DecodeAdmitted
	decodeOpen int             // decode still holding at the end
	decodeEnd  map[sglangsim.DecodeEnd]int
	// decodeHoldForced: the hold of those a decode force-fail released.
	decodeHoldForced []time.Duration
	// heldLive: decode requests the decode-side watchdog held as
	// "transfer may be live"; heldThenTimeout: of those, the ones
	// SGLang's own waiting timeout released.
	heldLive, heldThenTimeout int
}

func (f *fate) add(rec sglangsim.Record, trig string, heldLive bool, end time.Time) {
	f.n++
	entered := rec.EnteredInflight
	switch rec.Outcome {
	case sglangsim.OutcomeSuccess:
		f.success++
	case sglangsim.OutcomeFailedForced:
		if trig == watchdog.TriggerFailFast {
			f.failFast++
		} else {
			f.auto++
		}
		if !entered.IsZero() {
			f.lat = append(f.lat, rec.Left.Sub(entered))
		}
	case sglangsim.OutcomeFailed:
		f.failed++
	case sglangsim.OutcomeRestarted:
		f.restarted++
	default:
		f.held++
		if !entered.IsZero() {
			f.heldAge = append(f.heldAge, end.Sub(entered))
		}
	}
	if heldLive {
		f.heldLive++
		if rec.DecodeEnd == sglangsim.DecodeTimeout {
			f.heldThenTimeout++
		}
	}
	if rec.DecodeAdmitted.IsZero() {
		return
	}
	if f.decodeEnd == nil {
		f.decodeEnd = map[sglangsim.DecodeEnd]int{}
	}
	f.decodeEnd[rec.DecodeEnd]++
	if rec.DecodeReleased.IsZero() {
		f.decodeOpen++
		f.decodeHold = append(f.decodeHold, end.Sub(rec.DecodeAdmitted))
		return
	}
	f.decodeHold = append(f.decodeHold, rec.DecodeHold())
	if rec.DecodeEnd == sglangsim.DecodeForceFail {
		f.decodeHoldForced = append(f.decodeHoldForced, rec.DecodeHold())
	}
}

type analysis struct {
	byKind          map[sglangsim.Kind]*fate
	falseFF         []sglangsim.Record // progressing, or healthy/slow/health check forced
	blockedProgress int                // blocked rooms force-failed while progressing
	healthyInflight []time.Duration
	slowInflight    []time.Duration
	excess          []time.Duration // pin release after the earliest moment the windows allow it
	restartLost     int             // requests of every kind lost in restarts
	// wedges: stuck-handle pins that held a transfer in flight and froze
	// (each wedged its queue), and the time from the freeze to the
	// watchdog's diagnosis.
	wedging       int
	diagnosed     int
	toDiagnosis   []time.Duration
	undiagnosed   []string
	wedgeAtEnd    int // wedging pins whose queue was still wedged at the end (no restart since)
	otherWedgeEvs int // wedge events that match no wedging pin
	// Decode pages freed under a live transfer (Record.UnsafeFree) and
	// late writes that landed (Sim.Corruptions), by what freed the pages,
	// in all and by the writer's kind.
	unsafeFree, corrupt         map[sglangsim.DecodeEnd]int
	decodeHealthy               []sglangsim.Record // healthy or slow requests a decode force-fail released
	unsafeByKind, corruptByKind map[sglangsim.Kind]map[sglangsim.DecodeEnd]int
}

func analyse(r *replayResult) *analysis {
	a := &analysis{byKind: map[sglangsim.Kind]*fate{}, unsafeFree: map[sglangsim.DecodeEnd]int{}, corrupt: map[sglangsim.DecodeEnd]int{},
		unsafeByKind: map[sglangsim.Kind]map[sglangsim.DecodeEnd]int{}, corruptByKind: map[sglangsim.Kind]map[sglangsim.DecodeEnd]int{}}
	kindOf := map[string]sglangsim.Kind{}
	count := func(m map[sglangsim.Kind]map[sglangsim.DecodeEnd]int, k sglangsim.Kind, e sglangsim.DecodeEnd) {
		if m[k] == nil {
			m[k] = map[sglangsim.DecodeEnd]int{}
		}
		m[k][e]++
	}
	for _, k := range append(append([]sglangsim.Kind{}, pinKinds...), sglangsim.KindHealthy, sglangsim.KindSlow, sglangsim.KindHealthCheck, sglangsim.KindBlockedByWedge) {
		a.byKind[k] = &fate{}
	}
	for _, rec := range r.records {
		f := a.byKind[rec.Kind]
		if f == nil {
			f = &fate{}
			a.byKind[rec.Kind] = f
		}
		trig := r.trigger[rec.RID]
		f.add(rec, trig, r.heldLive[rec.RID], r.end)
		kindOf[rec.RID] = rec.Kind
		if rec.DecodeEnd == sglangsim.DecodeForceFail && (rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow) {
			a.decodeHealthy = append(a.decodeHealthy, rec)
		}
		if rec.UnsafeFree != "" {
			a.unsafeFree[rec.UnsafeFree]++
			count(a.unsafeByKind, rec.Kind, rec.UnsafeFree)
		}
		forced := !rec.ForcedAt.IsZero()
		if rec.Outcome == sglangsim.OutcomeRestarted {
			a.restartLost++
		}
		switch rec.Kind {
		case sglangsim.KindHealthy:
			if rec.Outcome == sglangsim.OutcomeSuccess {
				a.healthyInflight = append(a.healthyInflight, rec.Left.Sub(rec.EnteredInflight))
			}
		case sglangsim.KindSlow:
			if rec.Outcome == sglangsim.OutcomeSuccess {
				a.slowInflight = append(a.slowInflight, rec.Left.Sub(rec.EnteredInflight))
			}
		case sglangsim.KindBlockedByWedge:
			if forced && rec.ProgressingWhenForced {
				a.blockedProgress++
			}
		}
		if rec.ProgressingWhenForced || (forced && (rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow || rec.Kind == sglangsim.KindHealthCheck)) {
			a.falseFF = append(a.falseFF, rec)
		}
		if isPin(rec.Kind) && rec.Outcome == sglangsim.OutcomeFailedForced {
			if t := r.pins.pins[rec.RID]; t != nil && t.seen {
				// The earliest a correct watchdog may act on the deadline
				// path: old enough and still for a whole stall window.
				allowed := rec.EnteredInflight.Add(r.cfg.deadline)
				if st := t.lastChange.Add(r.cfg.stall); st.After(allowed) {
					allowed = st
				}
				a.excess = append(a.excess, rec.Left.Sub(allowed))
			}
		}
	}
	// Wedges: match each wedging pin to the first diagnosis naming its
	// rank and room (rule in_flight or orphaned_transfer).
	used := make([]bool, len(r.wedges))
	for _, rec := range r.records {
		if rec.Kind != sglangsim.KindPinStuckHandle {
			continue
		}
		t := r.pins.pins[rec.RID]
		if t == nil || !t.seen || !t.inFlight {
			continue
		}
		a.wedging++
		restartedSince := false
		for _, at := range r.restartAt {
			if at.After(t.lastChange) {
				restartedSince = true
			}
		}
		if !restartedSince {
			a.wedgeAtEnd++
		}
		found := false
		for i, e := range r.wedges {
			if e.rank == rec.Rank && e.room == rec.Room && !e.at.Before(t.lastChange) {
				used[i] = true
				if !found {
					a.diagnosed++
					a.toDiagnosis = append(a.toDiagnosis, e.at.Sub(t.lastChange))
					found = true
				}
			}
		}
		if !found && r.cfg.watchdog {
			a.undiagnosed = append(a.undiagnosed, fmt.Sprintf("rank %d %s queue %d frozen at %s, outcome %s", rec.Rank, rec.RID[:12], t.queue, t.lastChange.Sub(epoch).Round(100*time.Millisecond), rec.Outcome))
		}
	}
	for _, u := range used {
		if !u {
			a.otherWedgeEvs++
		}
	}
	for _, c := range r.corruption {
		a.corrupt[c.Cause]++
		count(a.corruptByKind, kindOf[c.Writer], c.Cause)
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

// dist is "median / p99 / max" of ds, or "-" when empty.
func dist(ds []time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	return fmt.Sprintf("%s / %s / %s", secs(quantile(ds, 0.5)), secs(quantile(ds, 0.99)), secs(maxDur(ds)))
}

// ---------------------------------------------------------------- main

func run(o options) int {
	t0 := time.Now()
	for _, m := range strings.Split(o.mechanisms, ",") {
		if _, ok := mechanismNames[strings.TrimSpace(m)]; !ok {
			fmt.Fprintf(os.Stderr, "-mechanisms: unknown mechanism %q (want resurrection, abort-before-register, stuck-handle)\n", m)
			return 2
		}
	}
	tr := makeTrace(o)
	fmt.Printf("# Detection quality, seed %d\n\n", o.seed)
	fmt.Printf("trace: DP%d, %s simulated, %d healthy requests (lognormal transfers, median %s), %d slow-but-progressing (30-150 s, a chunk every 2.5-5 s), %d pins (%.2g%% of healthy, %s evenly), %d stuck health checks, health checks every %s (0: none); NIXL, transfer queues keyed by decode ports (sglangsim defaults), boot time %s; a scheduler pass every %s (stock: %s)\n",
		o.ranks, o.duration, o.healthy, o.median, int(math.Round(float64(o.healthy)*o.slowPct/100)), tr.pins, o.pinPct, o.mechanisms, o.ranks, o.hcEvery, o.bootTime, o.step, o.stockStep)

	all := configs(o)
	type job struct {
		name string
		cfg  replayConfig
	}
	var jobs []job
	for _, n := range strings.Split(o.configs, ",") {
		n = strings.TrimSpace(n)
		if n == "" {
			continue
		}
		c, ok := all[n]
		if !ok {
			fmt.Fprintf(os.Stderr, "-configs: unknown configuration %q (want defaults, decode-off, decode-6, ff-off, restart-30m, restart-5m)\n", n)
			return 2
		}
		c.collectSeries = o.prom && n == "defaults"
		jobs = append(jobs, job{n, c})
	}
	if o.stock {
		jobs = append(jobs, job{"stock", replayConfig{name: "stock", step: o.stockStep, deadline: o.deadline, stall: o.stall, collectSeries: o.prom}})
	}
	nMain := len(jobs)
	if o.sweep {
		base := all["defaults"]
		for _, d := range []time.Duration{10, 20, 30, 60} {
			for _, s := range []time.Duration{5, 10, 30} {
				c := base
				c.deadline, c.stall = d*time.Second, s*time.Second
				if c.deadline == base.deadline && c.stall == base.stall && strings.Contains(","+o.configs+",", ",defaults,") {
					continue // the defaults run
				}
				c.name = fmt.Sprintf("sweep-%s-%s", c.deadline, c.stall)
				jobs = append(jobs, job{c.name, c})
			}
		}
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
			if errs[i] == nil {
				fmt.Fprintf(os.Stderr, "replay %s done in %s\n", j.name, results[i].wall.Round(100*time.Millisecond))
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", jobs[i].name, err)
			return 1
		}
	}
	mains := results[:nMain]
	as := make([]*analysis, len(mains))
	for i, r := range mains {
		as[i] = analyse(r)
	}
	fmt.Printf("replays: %d; wall time each: ", len(jobs))
	for i, r := range mains {
		fmt.Printf("%s %s; ", jobs[i].name, r.wall.Round(100*time.Millisecond))
	}
	fmt.Printf("all %s\n\n", time.Since(t0).Round(100*time.Millisecond))

	ref := as[0]
	p50, p999 := quantile(ref.healthyInflight, 0.5), quantile(ref.healthyInflight, 0.999)
	fmt.Printf("healthy transfer times in the %s run (time in the inflight queue, %d completed): p50 %s, p99 %s, p99.9 %s (%.1fx the median), max %s; slow transfers completed %d, max %s\n\n",
		jobs[0].name, len(ref.healthyInflight), secs(p50), secs(quantile(ref.healthyInflight, 0.99)), secs(p999), float64(p999)/float64(max(p50, 1)), secs(maxDur(ref.healthyInflight)),
		len(ref.slowInflight), secs(maxDur(ref.slowInflight)))

	// The comparison, one column per configuration.
	fmt.Printf("## Side by side (deadline %s, stall window %s, interval 1 s, /metrics every 15 s, max 6 force-fails a minute, fail-fast 180 a minute)\n\n", o.deadline, o.stall)
	hdr := "| |"
	sep := "|---|"
	for i := range mains {
		hdr += " " + jobs[i].name + " |"
		sep += "---|"
	}
	fmt.Println(hdr)
	fmt.Println(sep)
	row := func(label string, f func(r *replayResult, a *analysis) string) {
		line := "| " + label + " |"
		for i, r := range mains {
			line += " " + f(r, as[i]) + " |"
		}
		fmt.Println(line)
	}
	pinSum := func(a *analysis, g func(f *fate) int) int {
		n := 0
		for _, k := range pinKinds {
			n += g(a.byKind[k])
		}
		return n
	}
	refusedPins := func(r *replayResult) int {
		n := 0
		for _, k := range pinKinds {
			n += r.refused[k]
		}
		return n
	}
	row("pins submitted (refused while booting)", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("%d (%d)", pinSum(a, func(f *fate) int { return f.n }), refusedPins(r))
	})
	row("pins released by a lever: deadline path + fail-fast", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("%d + %d", pinSum(a, func(f *fate) int { return f.auto }), pinSum(a, func(f *fate) int { return f.failFast }))
	})
	row("pins ended by a restart", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(pinSum(a, func(f *fate) int { return f.restarted }))
	})
	row("pins still held at the end", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(pinSum(a, func(f *fate) int { return f.held }))
	})
	row("pin release latency (lever), median / p99 / max", func(r *replayResult, a *analysis) string {
		var all []time.Duration
		for _, k := range pinKinds {
			all = append(all, a.byKind[k].lat...)
		}
		return dist(all)
	})
	row("false force-fails (healthy, slow, health check, or progressing)", func(r *replayResult, a *analysis) string { return fmt.Sprint(len(a.falseFF)) })
	row("healthy + slow completed / submitted", func(r *replayResult, a *analysis) string {
		h, s := a.byKind[sglangsim.KindHealthy], a.byKind[sglangsim.KindSlow]
		b := a.byKind[sglangsim.KindBlockedByWedge]
		return fmt.Sprintf("%d / %d", h.success+s.success, h.n+s.n+b.n)
	})
	row("rooms queued behind a wedge (healthy or slow)", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].n)
	})
	row("… failed fast (client can retry)", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].failFast)
	})
	row("… failed by the deadline path", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].auto)
	})
	row("… lost in a restart", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].restarted)
	})
	row("… still hung at the end", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].held)
	})
	row("… time to their failure (lever), median / p99 / max", func(r *replayResult, a *analysis) string {
		return dist(a.byKind[sglangsim.KindBlockedByWedge].lat)
	})
	row("… age of the hung ones at the end, median / max", func(r *replayResult, a *analysis) string {
		h := a.byKind[sglangsim.KindBlockedByWedge].heldAge
		if len(h) == 0 {
			return "-"
		}
		return secs(quantile(h, 0.5)) + " / " + secs(maxDur(h))
	})
	row("wedges (stuck handles that froze in flight)", func(r *replayResult, a *analysis) string { return fmt.Sprint(a.wedging) })
	row("… diagnosed (transfer_wedged event)", func(r *replayResult, a *analysis) string {
		if !r.cfg.watchdog {
			return "-"
		}
		return fmt.Sprint(a.diagnosed)
	})
	row("… freeze to diagnosis, median / p99 / max", func(r *replayResult, a *analysis) string { return dist(a.toDiagnosis) })
	row("… still wedged at the end", func(r *replayResult, a *analysis) string { return fmt.Sprint(a.wedgeAtEnd) })
	row("restarts performed", func(r *replayResult, a *analysis) string {
		if !r.cfg.watchdog {
			return "-"
		}
		return fmt.Sprintf("%d (%s)", len(r.restartAt), a2s(r.restarts))
	})
	row("requests lost in restarts (all kinds)", func(r *replayResult, a *analysis) string { return fmt.Sprint(a.restartLost) })
	row("arrivals refused while booting", func(r *replayResult, a *analysis) string {
		n := 0
		for _, v := range r.refused {
			n += v
		}
		return fmt.Sprint(n)
	})
	row("health checks force-failed", func(r *replayResult, a *analysis) string {
		n := 0
		for _, rec := range r.records {
			if rec.Kind == sglangsim.KindHealthCheck && !rec.ForcedAt.IsZero() {
				n++
			}
		}
		return fmt.Sprint(n)
	})
	row("decode-side watchdog", func(r *replayResult, a *analysis) string {
		if r.cfg.watchdog && r.cfg.decode {
			return "on"
		}
		return "off"
	})
	row("decode slot held, pins, median / p99 / max", func(r *replayResult, a *analysis) string {
		var all []time.Duration
		open := 0
		for _, k := range pinKinds {
			all = append(all, a.byKind[k].decodeHold...)
			open += a.byKind[k].decodeOpen
		}
		return holdString(all, open)
	})
	row("… of those the decode-side watchdog released", func(r *replayResult, a *analysis) string {
		var all []time.Duration
		for _, k := range pinKinds {
			all = append(all, a.byKind[k].decodeHoldForced...)
		}
		return dist(all)
	})
	row("decode slot held, rooms behind a wedge, median / p99 / max", func(r *replayResult, a *analysis) string {
		b := a.byKind[sglangsim.KindBlockedByWedge]
		return holdString(b.decodeHold, b.decodeOpen)
	})
	row("decode slot held, healthy, median / p99 / max", func(r *replayResult, a *analysis) string {
		b := a.byKind[sglangsim.KindHealthy]
		return holdString(b.decodeHold, b.decodeOpen)
	})
	row("decode released by a decode force-fail: pins + rooms behind a wedge", func(r *replayResult, a *analysis) string {
		n := 0
		for _, k := range pinKinds {
			n += a.byKind[k].decodeEnd[sglangsim.DecodeForceFail]
		}
		return fmt.Sprintf("%d + %d", n, a.byKind[sglangsim.KindBlockedByWedge].decodeEnd[sglangsim.DecodeForceFail])
	})
	row("decode held as \"transfer may be live\" (then freed by SGLang's timeout)", func(r *replayResult, a *analysis) string {
		if !r.cfg.decode || !r.cfg.watchdog {
			return "-"
		}
		n, t := 0, 0
		for _, f := range a.byKind {
			n += f.heldLive
			t += f.heldThenTimeout
		}
		return fmt.Sprintf("%d (%d)", n, t)
	})
	row("decode force-fails of healthy or slow requests", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindHealthy].decodeEnd[sglangsim.DecodeForceFail] + a.byKind[sglangsim.KindSlow].decodeEnd[sglangsim.DecodeForceFail])
	})
	row("decode pages freed under a live transfer: by a force-fail / by SGLang's timeout", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("%d / %d", a.unsafeFree[sglangsim.DecodeForceFail], a.unsafeFree[sglangsim.DecodeTimeout])
	})
	row("page corruptions (late writes landed): caused by a force-fail / by SGLang's timeout", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("**%d** / %d", a.corrupt[sglangsim.DecodeForceFail], a.corrupt[sglangsim.DecodeTimeout])
	})
	row("force-fail calls (trigger/result)", func(r *replayResult, a *analysis) string { return a2s(r.calls) })
	row("skips", func(r *replayResult, a *analysis) string { return a2s(r.skips) })
	row("decode force-fail calls (result)", func(r *replayResult, a *analysis) string { return a2s(r.decCalls) })
	row("decode skips", func(r *replayResult, a *analysis) string { return a2s(r.decSkips) })
	row("prefill verdict lookups (answer)", func(r *replayResult, a *analysis) string { return a2s(r.lookups) })
	row("pin releases > 3 s after the windows allowed", func(r *replayResult, a *analysis) string {
		n := 0
		for _, d := range a.excess {
			if d > 3*time.Second {
				n++
			}
		}
		return fmt.Sprintf("%d of %d", n, len(a.excess))
	})

	// Per pin mechanism.
	fmt.Printf("\n## Per pin mechanism\n\n")
	fmt.Printf("| configuration | mechanism | submitted | released by a lever (deadline + fail-fast) | ended by a restart | held at the end | release latency median / p99 / max |\n|---|---|---|---|---|---|---|\n")
	for i := range mains {
		for _, k := range pinKinds {
			f := as[i].byKind[k]
			fmt.Printf("| %s | %s | %d | %d (%d + %d) | %d | %d | %s |\n", jobs[i].name, k, f.n, f.auto+f.failFast, f.auto, f.failFast, f.restarted, f.held, dist(f.lat))
		}
	}

	// Decode, per pin mechanism.
	fmt.Printf("\n## Decode side, per pin mechanism (decode deadline %s, SGLang's waiting timeout %s, deferred release %s)\n\n", watchdog.DefaultDecodeDeadline, o.stockTimeout, sglangsim.DeferredReleaseTimeout)
	fmt.Printf("| configuration | class | decode slot held median / p99 / max | … those a decode force-fail released | how decode let go | held as \"transfer may be live\" (freed by SGLang's timeout) | pages freed under a live transfer: force-fail / timeout | corruptions caused: force-fail / timeout |\n|---|---|---|---|---|---|---|---|\n")
	for i, r := range mains {
		for _, k := range append(append([]sglangsim.Kind{}, pinKinds...), sglangsim.KindBlockedByWedge) {
			f := as[i].byKind[k]
			held := "-"
			if r.cfg.watchdog && r.cfg.decode {
				held = fmt.Sprintf("%d (%d)", f.heldLive, f.heldThenTimeout)
			}
			fmt.Printf("| %s | %s | %s | %s | %s | %s | %d / %d | %d / %d |\n", jobs[i].name, k, holdString(f.decodeHold, f.decodeOpen), dist(f.decodeHoldForced), ends(f.decodeEnd), held,
				as[i].unsafeByKind[k][sglangsim.DecodeForceFail], as[i].unsafeByKind[k][sglangsim.DecodeTimeout],
				as[i].corruptByKind[k][sglangsim.DecodeForceFail], as[i].corruptByKind[k][sglangsim.DecodeTimeout])
		}
	}

	// Details worth reading by hand.
	for i, r := range mains {
		a := as[i]
		fmt.Printf("\n### %s\n\n", jobs[i].name)
		for j, m := range a.falseFF {
			if j == 10 {
				fmt.Printf("  ... %d more\n", len(a.falseFF)-10)
				break
			}
			fmt.Printf("  FALSE FORCE-FAIL %s rank %d %s entered %s forced %s trigger %s\n", m.Kind, m.Rank, m.RID, m.EnteredInflight.Sub(epoch), m.ForcedAt.Sub(epoch), r.trigger[m.RID])
		}
		if n := len(a.decodeHealthy); n > 0 {
			starved, inTime, outcomes := 0, 0, map[string]int{}
			for _, m := range a.decodeHealthy {
				if m.EnteredInflight.IsZero() || m.EnteredInflight.After(m.DecodeForcedAt) {
					starved++
				}
				if m.Outcome == sglangsim.OutcomeSuccess && m.Left.Sub(m.DecodeAdmitted) < o.stockTimeout {
					inTime++
				}
				outcomes[string(m.Outcome)]++
			}
			fmt.Printf("  DECODE FORCE-FAILS OF HEALTHY OR SLOW REQUESTS: %d; not yet in prefill's inflight queue when decode released them: %d; their prefill outcome: %s; prefill transfer done within decode's %s timeout (stock decode would have served them): %d\n",
				n, starved, a2s(outcomes), o.stockTimeout, inTime)
		}
		for j, u := range a.undiagnosed {
			if j == 10 {
				fmt.Printf("  ... %d more\n", len(a.undiagnosed)-10)
				break
			}
			fmt.Printf("  WEDGE NOT DIAGNOSED %s\n", u)
		}
		if r.cfg.watchdog {
			fmt.Printf("  transfer_wedged events: %d (%d name no wedging pin: a re-diagnosis after a restart or of a pin queued behind another wedge)\n", len(r.wedges), a.otherWedgeEvs)
			rules := map[string]int{}
			for _, e := range r.wedges {
				rules[e.rule]++
			}
			fmt.Printf("  by rule: %s\n", a2s(rules))
		}
		if len(r.restartAt) > 0 {
			var ts []string
			for _, at := range r.restartAt {
				ts = append(ts, at.Sub(epoch).Round(time.Second).String())
			}
			fmt.Printf("  restarts at: %s\n", strings.Join(ts, ", "))
		}
		shown := 0
		for _, rec := range r.records {
			if !isPin(rec.Kind) || rec.Outcome == sglangsim.OutcomeFailedForced || shown == 6 {
				continue
			}
			shown++
			fmt.Printf("  PIN NOT RELEASED BY A LEVER %s rank %d %s entered %s outcome %s; events: %s\n", rec.Kind, rec.Rank, rec.RID[:12], rec.EnteredInflight.Sub(epoch).Round(100*time.Millisecond), rec.Outcome, strings.Join(r.ridEvents[rec.RID], "; "))
		}
	}

	// Raw metrics with real Prometheus.
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
		pinRules := map[string]bool{"SGLangPrefillInflightQueuePinned": true, "SGLangPrefillKVTransferStalled": true}
		for i, res := range mains {
			if res.series == nil {
				continue
			}
			r := evalRaw(o, dir, jobs[i].name, res.series, epoch, res.end)
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
			fmt.Printf("pins alerted (Pinned or Stalled on the pin's dp_rank while the pin was inside): %d/%d", st.alerted, pinSum(as[i], func(f *fate) int { return f.n }))
			if len(st.delays) > 0 {
				fmt.Printf(", time to alert median %s, min %s, max %s", secs(quantile(st.delays, 0.5)), secs(quantile(st.delays, 0)), secs(maxDur(st.delays)))
			}
			fmt.Printf("; firing episodes with no pin inside their rank (false alerts): %d of %d\n", st.falseAlerts, st.episodes)
		}
	}

	// Sweep.
	if o.sweep {
		fmt.Printf("\n## Sweep: deadline x stall window (same trace, defaults configuration)\n\n")
		fmt.Printf("| deadline | stall window | pins released by a lever | false force-fails | pin release median / p99 / max | rooms behind a wedge failed fast / by deadline / hung | freeze to diagnosis median / max |\n|---|---|---|---|---|---|---|\n")
		sw := append([]*replayResult(nil), results[nMain:]...)
		for _, r := range mains {
			if r.cfg.name == "defaults" {
				sw = append(sw, r)
			}
		}
		sort.Slice(sw, func(i, j int) bool {
			if sw[i].cfg.deadline != sw[j].cfg.deadline {
				return sw[i].cfg.deadline < sw[j].cfg.deadline
			}
			return sw[i].cfg.stall < sw[j].cfg.stall
		})
		for _, r := range sw {
			sa := analyse(r)
			var lat []time.Duration
			rel, n := 0, 0
			for _, k := range pinKinds {
				f := sa.byKind[k]
				lat = append(lat, f.lat...)
				rel += f.auto + f.failFast
				n += f.n
			}
			b := sa.byKind[sglangsim.KindBlockedByWedge]
			fmt.Printf("| %s | %s | %d/%d | %d | %s | %d / %d / %d | %s / %s |\n", r.cfg.deadline, r.cfg.stall, rel, n, len(sa.falseFF), dist(lat),
				b.failFast, b.auto, b.held, secs(quantile(sa.toDiagnosis, 0.5)), secs(maxDur(sa.toDiagnosis)))
		}
	}
	fmt.Printf("\ntotal wall time %s\n", time.Since(t0).Round(100*time.Millisecond))
	return 0
}

// holdString is "median / p99 / max" of decode hold times, saying how
// many were still held at the end (their figure is a lower bound).
func holdString(ds []time.Duration, open int) string {
	if len(ds) == 0 {
		return "-"
	}
	s := dist(ds)
	if open > 0 {
		s += fmt.Sprintf(" (%d still held at the end)", open)
	}
	return s
}

// ends is how decode let go of a class of requests ("" = still held).
func ends(m map[sglangsim.DecodeEnd]int) string {
	out := map[string]int{}
	for k, v := range m {
		if k == "" {
			k = "still_held"
		}
		out[string(k)] = v
	}
	return a2s(out)
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
