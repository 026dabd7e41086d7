package watchdog

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Config holds everything the watchdog needs. main builds it from flags.
type Config struct {
	Clock  clock.Clock
	Logger log.Logger

	Metrics MetricsSource  // nil: no gauge watch
	Plugins []PluginSource // one per rank

	Interval        time.Duration // listing read and decision cycle
	MetricsInterval time.Duration // SGLang /metrics read
	Deadline        time.Duration
	StallWindow     time.Duration
	PinWindow       time.Duration
	MaxRooms        int

	Mode           Mode
	MaxPerMinute   int
	ConfirmTimeout time.Duration
	// MaxAttempts bounds admin calls per room that end in error; retries
	// back off exponentially from RetryBackoff.
	MaxAttempts  int
	RetryBackoff time.Duration

	// OnEvent, if set, is called for every decision and action, outside
	// the watchdog's lock.
	OnEvent func(Event)
}

func (c *Config) validate() error {
	switch {
	case c.Clock == nil:
		return errors.New("watchdog: no clock")
	case c.Interval <= 0:
		return errors.New("watchdog: interval must be positive")
	case c.Metrics != nil && c.MetricsInterval <= 0:
		return errors.New("watchdog: metrics interval must be positive")
	case c.Deadline <= 0 || c.StallWindow <= 0 || c.PinWindow <= 0:
		return errors.New("watchdog: deadline, stall window and pin window must be positive")
	case c.MaxRooms <= 0:
		return errors.New("watchdog: max rooms must be positive")
	case c.MaxPerMinute < 0:
		return errors.New("watchdog: max force-fails per minute must not be negative")
	case c.ConfirmTimeout <= 0:
		return errors.New("watchdog: confirm timeout must be positive")
	}
	_, err := ParseMode(string(c.Mode))
	return err
}

// Watchdog is the loop: sources → state → decisions → actuator.
type Watchdog struct {
	cfg    Config
	logger log.Logger
	clock  clock.Clock

	mu      sync.Mutex // guards everything below
	ranks   []*rankState
	metrics *metricsState
	mode    Mode
	tracked int
	limits  uint64 // room limit hits
	pending []*pending
	ready   bool

	forceFails map[[2]string]uint64 // result, trigger
	skips      map[string]uint64
	webhook    map[string]uint64
	lastCycle  time.Duration
	lastEnd    time.Time // when the last cycle ended, for liveness

	act       sync.Mutex  // serialises actuation, the only outward effect
	callTimes []time.Time // admin calls in the last minute, for the rate limit

	scrapeNow chan struct{}
}

// New checks cfg and builds a watchdog.
func New(cfg Config) (*Watchdog, error) {
	if cfg.Logger == nil {
		cfg.Logger = log.NewNopLogger()
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 3
	}
	if cfg.RetryBackoff <= 0 {
		cfg.RetryBackoff = 10 * time.Second
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	w := &Watchdog{
		cfg:        cfg,
		logger:     cfg.Logger,
		clock:      cfg.Clock,
		mode:       cfg.Mode,
		forceFails: map[[2]string]uint64{},
		skips:      map[string]uint64{},
		webhook:    map[string]uint64{},
		scrapeNow:  make(chan struct{}, 1),
	}
	for _, p := range cfg.Plugins {
		w.ranks = append(w.ranks, &rankState{
			source: p,
			status: sourceState{target: p.Target()},
			rooms:  map[roomKey]*roomState{},
		})
	}
	if cfg.Metrics != nil {
		w.metrics = &metricsState{status: sourceState{target: cfg.Metrics.Target()}, gauges: map[GaugeKey]*gaugeState{}}
	}
	return w, nil
}

// Mode returns the current actuator mode.
func (w *Watchdog) Mode() Mode {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mode
}

// SetMode switches the actuator mode at run time.
func (w *Watchdog) SetMode(m Mode) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if m != w.mode {
		level.Warn(w.logger).Log("msg", "force-fail mode changed", "from", w.mode, "to", m)
	}
	w.mode = m
}

// Ready reports whether the first read of SGLang's /metrics succeeded (or,
// without a metrics source, whether one cycle ran).
func (w *Watchdog) Ready() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.ready
}

// Run reads the sources and acts until ctx ends. Cycles never overlap: the
// next one starts an interval after the previous one started, or right
// after it ended if it overran.
func (w *Watchdog) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	if w.cfg.Metrics != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.metricsLoop(ctx)
		}()
	}
	defer wg.Wait()
	for {
		start := w.clock.Now()
		w.RunCycle(ctx)
		wait := w.cfg.Interval - w.clock.Now().Sub(start)
		select {
		case <-ctx.Done():
			return nil
		case <-w.clock.After(wait):
		}
	}
}

func (w *Watchdog) metricsLoop(ctx context.Context) {
	// Early reads for confirmations are allowed at most this often, so that
	// a burst of releases cannot turn into a burst of expensive scrapes.
	minGap := w.cfg.MetricsInterval / 5
	var last time.Time
	for {
		last = w.clock.Now()
		w.ScrapeMetrics(ctx)
		select {
		case <-ctx.Done():
			return
		case <-w.clock.After(w.cfg.MetricsInterval):
		case <-w.scrapeNow:
			if gap := w.clock.Now().Sub(last); gap < minGap {
				select {
				case <-ctx.Done():
					return
				case <-w.clock.After(minGap - gap):
				}
			}
		}
	}
}

// ScrapeMetrics reads SGLang's /metrics once and folds it into state.
func (w *Watchdog) ScrapeMetrics(ctx context.Context) {
	if w.cfg.Metrics == nil {
		return
	}
	start := w.clock.Now()
	sample, err := w.cfg.Metrics.Scrape(ctx)
	now := w.clock.Now()
	var events []Event

	w.mu.Lock()
	m := w.metrics
	m.status.seen = true
	m.status.duration = now.Sub(start)
	if err != nil {
		m.status.up = false
		m.status.failures++
		m.status.lastErr = err.Error()
		w.mu.Unlock()
		level.Error(w.logger).Log("msg", "reading SGLang metrics failed", "source", "metrics", "target", m.status.target, "err", err)
		return
	}
	m.status.up = true
	m.status.lastErr = ""
	w.ready = true
	w.observeMetrics(sample, now)
	events = append(events, w.evaluateGauges(now)...)
	events = append(events, w.confirm(now)...)
	w.mu.Unlock()
	w.emit(events)
}

// observeMetrics folds a sample into state. Caller holds w.mu.
func (w *Watchdog) observeMetrics(s *MetricsSample, now time.Time) {
	m := w.metrics
	moved := !m.sampled
	for fam, v := range s.Progress {
		if old, ok := m.progress[fam]; !ok || old != v {
			moved = true
		}
	}
	if len(s.Progress) != len(m.progress) {
		moved = true
	}
	if moved {
		m.lastProgress = now
	}
	m.progress = s.Progress
	for k, v := range s.Gauges {
		g, ok := m.gauges[k]
		if !ok {
			m.gauges[k] = &gaugeState{value: v, lastChange: now}
			continue
		}
		if g.value != v {
			g.value = v
			g.lastChange = now
		}
	}
	for k := range m.gauges {
		if _, ok := s.Gauges[k]; !ok {
			delete(m.gauges, k)
		}
	}
	m.sampled = true
}

// evaluateGauges logs pinned-gauge transitions. Caller holds w.mu.
func (w *Watchdog) evaluateGauges(now time.Time) []Event {
	var events []Event
	for k, g := range w.metrics.gauges {
		pinned := gaugePinned(g, w.metrics, now, &w.cfg)
		if pinned && !g.pinned {
			level.Warn(w.logger).Log("msg", "queue gauge pinned", "queue", k.Queue, "dp_rank", k.DP, "pp_rank", k.PP, "tp_rank", k.TP,
				"value", g.value, "unchanged_seconds", int(now.Sub(g.lastChange).Seconds()), "reason", "non-zero and unchanged while no progress counter moved")
			events = append(events, Event{Kind: EventPinned, Gauge: k, Target: w.metrics.status.target})
		} else if !pinned && g.pinned {
			level.Info(w.logger).Log("msg", "queue gauge no longer pinned", "queue", k.Queue, "dp_rank", k.DP, "pp_rank", k.PP, "tp_rank", k.TP, "value", g.value)
		}
		g.pinned = pinned
	}
	return events
}

type listingResult struct {
	listing  *pluginapi.Listing
	err      error
	duration time.Duration
}

// RunCycle reads every rank's listing once, updates state, decides and acts.
func (w *Watchdog) RunCycle(ctx context.Context) {
	start := w.clock.Now()
	results := make([]listingResult, len(w.ranks))
	var wg sync.WaitGroup
	for i, rk := range w.ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := w.clock.Now()
			l, err := rk.source.Inflight(ctx)
			results[i] = listingResult{listing: l, err: err, duration: w.clock.Now().Sub(t0)}
		}()
	}
	wg.Wait()
	now := w.clock.Now()

	w.mu.Lock()
	var events []Event
	for i, rk := range w.ranks {
		events = append(events, w.observeListing(rk, results[i], now)...)
	}
	events = append(events, w.confirm(now)...)
	if w.metrics == nil {
		w.ready = true
	}
	candidates := w.candidates(now, nil)
	w.mu.Unlock()
	w.emit(events)

	w.actuate(ctx, candidates, TriggerAuto, false, start.Add(w.cfg.Interval))

	w.mu.Lock()
	w.lastEnd = w.clock.Now()
	w.lastCycle = w.lastEnd.Sub(start)
	w.mu.Unlock()
}

// LastCycleEnd is when the last watch cycle ended, zero before the first.
// The liveness endpoint reads it to tell a loop that stopped cycling.
func (w *Watchdog) LastCycleEnd() time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastEnd
}

// observeListing folds one rank's listing into state and refreshes the
// rank's verdicts. Caller holds w.mu.
func (w *Watchdog) observeListing(rk *rankState, res listingResult, now time.Time) []Event {
	rk.status.seen = true
	rk.status.duration = res.duration
	if res.err != nil {
		rk.status.up = false
		rk.status.failures++
		rk.status.lastErr = res.err.Error()
		level.Error(w.logger).Log("msg", "reading plugin listing failed", "source", "plugin", "target", rk.status.target, "err", res.err)
		return nil
	}
	l := res.listing
	rk.status.up = true
	rk.status.lastErr = ""
	if rk.listed && (l.Loop.Iterations < rk.iterations || l.Server.PID != rk.server.PID) {
		level.Warn(w.logger).Log("msg", "scheduler restarted: the requests it held are gone", "target", rk.status.target,
			"dp_rank", l.Server.DPRank, "pp_rank", l.Server.PPRank, "old_pid", rk.server.PID, "pid", l.Server.PID,
			"old_iterations", rk.iterations, "iterations", l.Loop.Iterations, "rooms_tracked", len(rk.rooms))
	}
	rk.server = l.Server
	rk.queues = l.Queues
	rk.dpLabel, rk.ppLabel = l.Server.DPRank, l.Server.PPRank

	if !rk.listed || l.Loop.Iterations != rk.iterations {
		rk.loopAdvancedAt = now
	}
	rk.loopAdvancing = rk.listed && l.Loop.Iterations > rk.iterations
	if l.Loop.Iterations < rk.iterations {
		// The scheduler restarted: its counter began again.
		rk.loopAdvancing = false
		for _, r := range rk.rooms {
			r.iterAtChange = 0
		}
	}
	rk.iterations = l.Loop.Iterations
	rk.listed = true

	rk.cycle++
	limitHit := false
	for i := range l.Inflight {
		lr := &l.Inflight[i]
		key := roomKey{lr.RID, lr.BootstrapRoom}
		r, ok := rk.rooms[key]
		if !ok {
			if w.tracked >= w.cfg.MaxRooms || len(rk.rooms) >= max(1, w.cfg.MaxRooms/len(w.ranks)) {
				limitHit = true
				continue
			}
			r = &roomState{firstSeen: now, lastChange: now, iterAtChange: l.Loop.Iterations, poll: lr.Poll, progress: lr.Progress}
			rk.rooms[key] = r
			w.tracked++
		} else if r.poll != lr.Poll || r.progress != lr.Progress {
			r.poll, r.progress = lr.Poll, lr.Progress
			r.lastChange = now
			r.iterAtChange = l.Loop.Iterations
		}
		r.seen = rk.cycle
		r.age = lr.AgeSeconds
		r.health = lr.HealthCheck
		r.addr = lr.BootstrapAddr
		r.prompt = lr.PromptTokens
	}
	if limitHit {
		w.limits++
		level.Error(w.logger).Log("msg", "room limit reached; rooms beyond it are not tracked and never acted on", "target", rk.status.target, "max_rooms", w.cfg.MaxRooms, "listed", len(l.Inflight))
	}
	for key, r := range rk.rooms {
		if r.seen == rk.cycle {
			continue
		}
		rk.hist.observe(r.age)
		delete(rk.rooms, key)
		w.tracked--
		for _, p := range w.pending {
			if p.rank == rk && p.key == key {
				p.gone = true
			}
		}
	}
	return w.evaluateRank(rk, now)
}

// evaluateRank recomputes a rank's verdicts and logs transitions. Caller
// holds w.mu.
func (w *Watchdog) evaluateRank(rk *rankState, now time.Time) []Event {
	var events []Event
	wedged := rankWedged(rk, now, &w.cfg)
	if wedged && !rk.wedged {
		level.Error(w.logger).Log("msg", "scheduler loop wedged: no request is force-failed on this rank until it moves", "target", rk.status.target,
			"dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "iterations", rk.iterations, "stalled_seconds", int(now.Sub(rk.loopAdvancedAt).Seconds()), "rooms", len(rk.rooms))
		events = append(events, Event{Kind: EventWedged, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel})
	} else if !wedged && rk.wedged {
		level.Info(w.logger).Log("msg", "scheduler loop moving again", "target", rk.status.target, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel)
	}
	rk.wedged = wedged

	rk.stuck = 0
	rk.oldest = 0
	if rk.byPoll == nil {
		rk.byPoll = make(map[string]int, len(pluginapi.PollStates))
	}
	clear(rk.byPoll)
	for key, r := range rk.rooms {
		rk.byPoll[r.poll]++
		if r.age > rk.oldest {
			rk.oldest = r.age
		}
		stuck := roomStuck(r, rk, now, &w.cfg)
		if stuck {
			rk.stuck++
		}
		if stuck && !r.stuck {
			level.Warn(w.logger).Log("msg", "request stuck", "rid", key.rid, "room", key.room, "target", rk.status.target,
				"dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "age", fmt.Sprintf("%.1f", r.age), "poll", r.poll, "progress", r.progress,
				"reason", fmt.Sprintf("no change of poll or progress for %s while the scheduler loop ran", now.Sub(r.lastChange).Round(time.Second)))
			events = append(events, w.roomEvent(EventStuck, rk, key, r))
		}
		r.stuck = stuck
	}
	return events
}

func (w *Watchdog) roomEvent(kind EventKind, rk *rankState, key roomKey, r *roomState) Event {
	return Event{Kind: kind, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel,
		RID: key.rid, Room: key.room, Age: r.age, Poll: r.poll, Progress: r.progress}
}

func (w *Watchdog) emit(events []Event) {
	if w.cfg.OnEvent == nil {
		return
	}
	for _, e := range events {
		w.cfg.OnEvent(e)
	}
}
