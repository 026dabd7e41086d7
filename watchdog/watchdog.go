package watchdog

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
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
	// DecodeDeadline is the deadline of decode requests (time in the
	// decode prealloc and transfer queues); zero means
	// DefaultDecodeDeadline.
	DecodeDeadline time.Duration
	StallWindow    time.Duration
	PinWindow      time.Duration
	MaxRooms       int

	Mode Mode
	// ModeFile, if set, is a file holding a mode that overrides Mode (and
	// caps RestartMode) while it exists, re-read every cycle (mode.go).
	ModeFile       string
	MaxPerMinute   int
	ConfirmTimeout time.Duration
	// MaxAttempts bounds admin calls per room that end in error; retries
	// back off exponentially from RetryBackoff.
	MaxAttempts  int
	RetryBackoff time.Duration

	// FailFast sends one wedge order per diagnosed wedge of a rank with
	// transfer_progress, and renews it while the wedge holds, so that the
	// plugin fails every room queued behind it at once (auto mode; a dry
	// run in dry-run mode). FailFastPerMinute bounds the new wedge orders
	// over any 60 s (renewals are free), apart from MaxPerMinute.
	FailFast          bool
	FailFastPerMinute int
	// FailFastMinAge: a wedge order never fails a room younger than this
	// (its min_age_seconds); zero means DefaultFailFastMinAge.
	FailFastMinAge time.Duration
	// LinkMargin: a chunk in a transfer worker's hands is overdue after
	// LinkMargin times what its size needs at the slow end of the link's
	// measured speed (chunkAllowance); zero means DefaultLinkMargin.
	LinkMargin float64
	// LinkIdle: a link that neither finished nor held a chunk for this
	// long is forgotten (links.go); zero means DefaultLinkIdle.
	LinkIdle time.Duration
	// DecodePerMinute bounds the decode releases over any 60 s, apart from
	// both prefill budgets; zero means DefaultDecodePerMinute. A decode
	// rank is exempt from one lever per rank and cycle: a released decode
	// request unblocks no other (docs/decode.md, "The rails").
	DecodePerMinute int
	// RestartMode escalates a diagnosed transfer wedge to a restart of the
	// scheduler process (off, the default, dry-run or auto), at most once
	// per RestartMinInterval for all ranks (one pod) and never twice for
	// the same process.
	RestartMode        Mode
	RestartMinInterval time.Duration
	// RestartStateFile, if set, keeps the time of the last restart request
	// across restarts of the watchdog itself (restartstate.go). In auto
	// mode it is written at start, so that a path that cannot be written
	// fails then rather than at the first restart.
	RestartStateFile string

	// Verdicts answers, for a decode request whose transfer started,
	// whether its prefill peer stopped sending. Nil: only this watchdog's
	// own ledger answers (when it watches prefill ranks too); otherwise
	// every such request is held.
	Verdicts VerdictSource
	// LedgerTTL and LedgerSize bound the ledger of rooms released on
	// prefill; zero means DefaultLedgerTTL and DefaultLedgerSize.
	LedgerTTL  time.Duration
	LedgerSize int

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
	case c.Deadline <= 0 || c.DecodeDeadline <= 0 || c.StallWindow <= 0 || c.PinWindow <= 0:
		return errors.New("watchdog: deadlines, stall window and pin window must be positive")
	case c.MaxRooms <= 0:
		return errors.New("watchdog: max rooms must be positive")
	case c.MaxPerMinute < 0:
		return errors.New("watchdog: max force-fails per minute must not be negative")
	case c.ConfirmTimeout <= 0:
		return errors.New("watchdog: confirm timeout must be positive")
	case c.FailFastPerMinute < 0:
		return errors.New("watchdog: max new wedge orders per minute must not be negative")
	case c.FailFastMinAge < 0:
		return errors.New("watchdog: fail-fast min age must not be negative")
	case !(c.LinkMargin >= 1) || math.IsInf(c.LinkMargin, 1):
		return fmt.Errorf("watchdog: link margin must be a finite number of at least 1, not %v", c.LinkMargin)
	case c.LinkIdle < 0:
		return errors.New("watchdog: link idle time must not be negative")
	case c.DecodePerMinute < 0:
		return errors.New("watchdog: max decode releases per minute must not be negative")
	case c.RestartMode != ModeOff && c.RestartMinInterval <= 0:
		return errors.New("watchdog: restart min interval must be positive")
	}
	if _, err := ParseMode(string(c.RestartMode)); err != nil {
		return fmt.Errorf("restart mode: %w", err)
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
	// mode and restartMode are the modes in force: the flags', or the
	// mode file's (mode.go).
	mode        Mode
	restartMode Mode
	modeFile    modeFileState
	modeChanges uint64
	tracked     int
	limits      uint64 // room limit hits
	pending     []*pending
	ready       bool
	// requests holds the actuator's bookkeeping per request (all PP stages).
	requests map[reqKey]*reqState
	// claimed is, per failure counter family, the value up to which rises
	// have been matched to releases: one rise confirms one release.
	claimed map[string]float64
	// collisions is the number of targets per (dp_rank, pp_rank), for
	// logging transitions.
	collisions map[rankID]int
	// missingStages is, per DP rank (pp unused), how many PP stages its
	// listings report beyond those watched, for logging changes.
	missingStages map[rankID]int

	// decodeSeen: a decode rank was listed; only then are the decode
	// series of role-labelled counters exported.
	decodeSeen bool
	forceFails map[[3]string]uint64 // result, trigger, role
	skips      map[[2]string]uint64 // reason, role
	// ledger holds the rooms this watchdog released on prefill, for the
	// verdicts decode-side watchdogs ask for.
	ledger    *ledger
	lookups   map[string]uint64 // prefill verdict lookups by answer
	webhook   map[string]uint64
	lastCycle time.Duration
	lastEnd   time.Time // when the last cycle ended, for liveness

	act sync.Mutex // serialises actuation, the only outward effect
	// callTimes holds, per budget, the requests acted on in the last
	// minute, for the rate limits.
	callTimes [numBudgets][]time.Time
	// lookupLeft is what remains of one actuation's time for prefill
	// verdict lookups (decode_lookup.go); under act.
	lookupLeft time.Duration

	wedgeOrders map[string]uint64 // by OrderResults
	restarts    map[string]uint64
	// restarted holds, per process, the mode of the restart call it had:
	// after a dry run, a switch to auto may still ask for a real one.
	restarted   map[procKey]Mode
	lastRestart time.Time // last real restart call, for the per-pod interval

	scrapeNow chan struct{}
}

// New checks cfg and builds a watchdog.
func New(cfg Config) (*Watchdog, error) {
	if cfg.Logger == nil {
		cfg.Logger = log.NewNopLogger()
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = defaultMaxAttempts
	}
	if cfg.RetryBackoff <= 0 {
		cfg.RetryBackoff = defaultRetryBackoff
	}
	if cfg.RestartMode == "" {
		cfg.RestartMode = ModeOff
	}
	if cfg.DecodeDeadline <= 0 {
		cfg.DecodeDeadline = DefaultDecodeDeadline
	}
	if cfg.DecodePerMinute == 0 {
		cfg.DecodePerMinute = DefaultDecodePerMinute
	}
	if cfg.LedgerTTL <= 0 {
		cfg.LedgerTTL = DefaultLedgerTTL
	}
	if cfg.LedgerSize <= 0 {
		cfg.LedgerSize = DefaultLedgerSize
	}
	if cfg.LinkMargin == 0 {
		cfg.LinkMargin = DefaultLinkMargin
	}
	if cfg.LinkIdle == 0 {
		cfg.LinkIdle = DefaultLinkIdle
	}
	if cfg.FailFastMinAge == 0 {
		cfg.FailFastMinAge = DefaultFailFastMinAge
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	w := &Watchdog{
		cfg:           cfg,
		logger:        cfg.Logger,
		clock:         cfg.Clock,
		mode:          cfg.Mode,
		restartMode:   cfg.RestartMode,
		forceFails:    map[[3]string]uint64{},
		skips:         map[[2]string]uint64{},
		claimed:       map[string]float64{},
		ledger:        newLedger(cfg.LedgerTTL, cfg.LedgerSize),
		lookups:       map[string]uint64{},
		webhook:       map[string]uint64{},
		scrapeNow:     make(chan struct{}, 1),
		requests:      map[reqKey]*reqState{},
		collisions:    map[rankID]int{},
		missingStages: map[rankID]int{},
		restarts:      map[string]uint64{},
		restarted:     map[procKey]Mode{},
		wedgeOrders:   map[string]uint64{},
	}
	for _, p := range cfg.Plugins {
		w.ranks = append(w.ranks, &rankState{
			source:      p,
			status:      sourceState{target: p.Target()},
			rooms:       map[roomKey]*roomState{},
			orphans:     map[uint64]*orphanState{},
			queueChange: map[int]time.Time{},
			workers:     map[int]*workerState{},
			peerWorkers: map[string]map[int]*workerState{},
			links:       linkBook{},
			peerLinks:   map[string]linkBook{},
			peerHeld:    map[uint64]string{},
			peerBehind:  map[uint64][]*workerState{},
			orders:      map[int]*wedgeOrder{},
			departed:    map[roomKey]*roomState{},
			deadSince:   map[threadKey]time.Time{},
			deadLogged:  map[threadKey]bool{},
		})
	}
	if cfg.Metrics != nil {
		w.metrics = &metricsState{status: sourceState{target: cfg.Metrics.Target()}, gauges: map[GaugeKey]*gaugeState{}}
	}
	if cfg.RestartStateFile != "" {
		if err := w.loadRestartState(cfg.RestartStateFile); err != nil {
			return nil, err
		}
		if cfg.RestartMode == ModeAuto {
			if err := saveRestartState(cfg.RestartStateFile, stateOf(w.lastRestart, 0)); err != nil {
				return nil, err
			}
		}
	}
	w.refreshMode()
	return w, nil
}

// Mode returns the current actuator mode.
func (w *Watchdog) Mode() Mode {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mode
}

// SetMode switches the force-fail mode at run time, for an embedder
// without a mode file; a mode file's next read overrides it.
func (w *Watchdog) SetMode(m Mode) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.applyModes(m, w.restartMode, ModeSourceAPI)
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
func (w *Watchdog) Run(ctx context.Context) {
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
			return
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
		m.status.fail(w.logger, now, err, "reading SGLang metrics failed", "metrics")
		w.mu.Unlock()
		return
	}
	m.status.answered(w.logger, now, "SGLang metrics read again", "metrics")
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
		if old, ok := m.counters[fam]; !ok || old != v {
			moved = true
		}
	}
	if len(s.Progress) != len(m.counters) {
		moved = true
	}
	if moved {
		m.lastProgress = now
	}
	m.counters = s.Progress
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

// rankID names a rank by role, DP and PP rank.
type rankID struct {
	role   string
	dp, pp int
}

// RunCycle reads every rank's listing once, updates state, decides and acts.
func (w *Watchdog) RunCycle(ctx context.Context) {
	start := w.clock.Now()
	w.refreshMode()
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
	for i, rk := range w.ranks {
		w.observeListing(rk, results[i], now)
	}
	events := w.evaluate(results, now)
	events = append(events, w.checkCollisions()...)
	w.checkStages()
	w.pruneRequests()
	events = append(events, w.confirm(now)...)
	if w.metrics == nil {
		w.ready = true
	}
	candidates := w.candidates(now, nil)
	orders := w.orderCalls()
	escalation := w.restartCandidate()
	w.mu.Unlock()
	w.emit(events)

	// Orders first: one call releases every room behind a wedge.
	w.emit(w.placeOrders(ctx, orders))
	w.actuate(ctx, candidates, TriggerAuto, false, start.Add(w.cfg.Interval))
	if escalation != nil {
		w.emit(w.restart(ctx, escalation))
	}

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

// checkCollisions logs when two or more targets report the same dp_rank
// and pp_rank. Nothing is hidden: each target keeps its own state and acts
// on its own rooms, and the exporter merges their series. Caller holds w.mu.
func (w *Watchdog) checkCollisions() []Event {
	var events []Event
	now := map[rankID][]string{}
	for _, rk := range w.ranks {
		if rk.listed {
			k := rankID{rk.role, rk.dpLabel, rk.ppLabel}
			now[k] = append(now[k], rk.status.target)
		}
	}
	for k, targets := range now {
		if len(targets) > 1 && w.collisions[k] != len(targets) {
			level.Error(w.logger).Log("msg", "plugin URLs report the same rank: check --plugin.url and the plugin's port mapping", "role", k.role, "dp_rank", k.dp, "pp_rank", k.pp,
				"targets", strings.Join(targets, ","))
			events = append(events, Event{Kind: EventRankCollision, Role: k.role, DPRank: k.dp, PPRank: k.pp, Target: strings.Join(targets, ",")})
		}
	}
	for k, n := range w.collisions {
		if n > 1 && len(now[k]) <= 1 {
			level.Info(w.logger).Log("msg", "rank collision resolved", "role", k.role, "dp_rank", k.dp, "pp_rank", k.pp)
		}
	}
	w.collisions = map[rankID]int{}
	for k, targets := range now {
		w.collisions[k] = len(targets)
	}
	return events
}

// checkStages warns, once per change, when a DP rank's listings report
// more PP stages than the watchdog reads: a request is released only when
// every stage fails it, so the missing stages' URLs must be configured.
// Caller holds w.mu.
func (w *Watchdog) checkStages() {
	size, seen := map[rankID]int{}, map[rankID]map[int]bool{}
	for _, rk := range w.ranks {
		if !rk.listed {
			continue
		}
		dp := rankID{role: rk.role, dp: rk.dpLabel}
		size[dp] = max(size[dp], rk.server.PPSize)
		if seen[dp] == nil {
			seen[dp] = map[int]bool{}
		}
		seen[dp][rk.ppLabel] = true
	}
	for dp, n := range size {
		missing := max(0, n-len(seen[dp]))
		if missing > 0 && w.missingStages[dp] != missing {
			level.Error(w.logger).Log("msg", "PP stages of a DP rank are not watched: force-fails on this DP rank cannot release anything; add a --plugin.url per stage",
				"role", dp.role, "dp_rank", dp.dp, "pp_size", n, "stages_watched", len(seen[dp]))
		}
		w.missingStages[dp] = missing
	}
}

// pruneRequests forgets the bookkeeping of requests no stage holds any
// more. Caller holds w.mu.
func (w *Watchdog) pruneRequests() {
	for key, st := range w.requests {
		if st.acting {
			continue
		}
		held := false
		for _, rk := range w.ranks {
			if rk.listed && rk.role == key.role && rk.dpLabel == key.dp {
				if _, ok := rk.rooms[key.roomKey]; ok {
					held = true
					break
				}
			}
		}
		if !held {
			delete(w.requests, key)
		}
	}
}

func (w *Watchdog) roomEvent(kind EventKind, rk *rankState, key roomKey, r *roomState) Event {
	return Event{Kind: kind, Role: rk.role, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel,
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
