package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/bench/simplugin"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// The replay: the trace through the simulator under one configuration of
// the real watchdog (or none), with the sources the watchdog reads.

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
	linkMargin    float64 // --watchdog.link-margin; 0: the default
	collectSeries bool
}

// configs are the watchdog configurations of the comparison, by name.
func configs(o options) map[string]replayConfig {
	base := replayConfig{step: o.step, watchdog: true, deadline: o.deadline, stall: o.stall, linkMargin: o.linkMargin, failFast: true, decode: true, decodeBudget: watchdog.DefaultDecodePerMinute, restart: watchdog.ModeOff}
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
	decCalls map[string]int
	decSkips map[string]int
	heldLive map[string]bool
	lookups  map[string]int // prefill verdicts it got, by answer
	// verdicts is the last prefill verdict the decode-side watchdog got
	// for each rid (what a decode release was decided on).
	verdicts   map[string]string
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
	// longest is the longest chunk each link listed in finished: what the
	// link showed of its pace (issue 23's physical limit).
	longest map[string]time.Duration
}

type pinTrack struct {
	seen       bool
	poll       string
	progress   int64
	inFlight   bool
	queue      int
	lastChange time.Time
}

func (p *pinTracker) observe(l *pluginapi.Listing, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	chunks := func(ws []pluginapi.TransferWorker) {
		for _, w := range ws {
			for _, f := range w.Finished {
				p.longest[f.Link] = max(p.longest[f.Link], time.Duration(f.Seconds*float64(time.Second)))
			}
		}
	}
	chunks(l.TransferWorkers)
	for _, peer := range l.PeerTransferWorkers {
		chunks(peer.TransferWorkers)
	}
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
		AttnTP:       t.attnTP, LeaderOnlyView: t.attnTP > 1 && o.tpView == "leader-only", TPUnwatched: t.unwatched(),
	})
	if err != nil {
		return nil, err
	}
	res := &replayResult{cfg: rc, calls: map[string]int{}, skips: map[string]int{}, trigger: map[string]string{},
		restarts: map[string]int{}, refused: map[sglangsim.Kind]int{}, ridEvents: map[string][]string{},
		decCalls: map[string]int{}, decSkips: map[string]int{}, heldLive: map[string]bool{}, lookups: map[string]int{},
		verdicts: map[string]string{}, pins: &pinTracker{pins: map[string]*pinTrack{}, longest: map[string]time.Duration{}}}
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
			LinkMargin: rc.linkMargin,
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
	next, nextLink := 0, 0
	type abort struct {
		at   time.Duration
		rank int
		rid  string
	}
	var aborts []abort // pending client aborts, by time
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
		for nextLink < len(t.links) && t.links[nextLink].at <= el {
			lc := t.links[nextLink]
			nextLink++
			set := func() error { return sim.SetTPLinkSpeed(-1, lc.tp, lc.queue, lc.speed) }
			if lc.port > 0 {
				set = func() error { return sim.SetDestinationSpeed(-1, lc.tp, lc.port, lc.speed) }
			}
			if err := set(); err != nil {
				return nil, err
			}
		}
		for len(aborts) > 0 && aborts[0].at <= el {
			sim.ClientAbort(aborts[0].rank, aborts[0].rid)
			aborts = aborts[1:]
		}
		for next < len(t.arrivals) && t.arrivals[next].at <= el {
			a := t.arrivals[next]
			next++
			spec := sglangsim.RequestSpec{Rank: a.rank, Behavior: a.behavior}
			if a.spec != nil {
				spec = *a.spec
				spec.Rank, spec.Behavior = a.rank, a.behavior
			} else if a.behavior == sglangsim.BehaviorHealthy || a.behavior == sglangsim.BehaviorSlow {
				spec.Bootstrap = 2*time.Millisecond + time.Duration(rng.Float64()*float64(28*time.Millisecond))
			} else if isPinBehavior(a.behavior) {
				spec.PinTPRanks = t.pinTP
			}
			if a.port > 0 {
				spec.DecodePort = a.port
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
			if a.abortAfter > 0 {
				aborts = append(aborts, abort{a.at + a.abortAfter, a.rank, rid})
				slices.SortStableFunc(aborts, func(x, y abort) int { return cmp.Compare(x.at, y.at) })
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
// the real handler, without sockets. It notes each rid's last verdict.
type verdictTransport struct {
	h        http.Handler
	mu       *sync.Mutex
	verdicts map[string]string
}

func (t verdictTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	rec := httptest.NewRecorder()
	t.h.ServeHTTP(rec, r)
	var v pluginapi.RoomVerdict
	if rec.Code == http.StatusOK && json.Unmarshal(rec.Body.Bytes(), &v) == nil && v.RID != "" {
		t.mu.Lock()
		t.verdicts[v.RID] = v.Verdict
		t.mu.Unlock()
	}
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
			Client: &http.Client{Transport: verdictTransport{h: prefill.VerdictHandler(), mu: &sync.Mutex{}, verdicts: res.verdicts}}, Timeout: 500 * time.Millisecond,
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
