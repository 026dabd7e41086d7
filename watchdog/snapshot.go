package watchdog

import (
	"sort"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Snapshot is a consistent copy of what the exported metrics show. It holds
// aggregates only, so that building it costs little even with many rooms.
type Snapshot struct {
	// Mode and RestartMode are the modes in force (a mode file's while it
	// holds one); ModeChanges counts their changes since start, and
	// ModeFileErrors the reads of the mode file that found no valid mode.
	Mode           Mode
	RestartMode    Mode
	ModeChanges    uint64
	ModeFileErrors uint64
	Sources        []SourceStatus
	Ranks          []RankSnapshot
	Gauges         []GaugeSnapshot
	// MetricsSampled is false until SGLang's /metrics was read once.
	MetricsSampled bool
	SinceProgress  time.Duration

	// ForceFails and Skips sum over roles; RoleForceFails ([result,
	// trigger, role]) and RoleSkips ([reason, role]) split them, every
	// combination present.
	ForceFails     map[[2]string]uint64
	Skips          map[string]uint64
	RoleForceFails map[[3]string]uint64
	RoleSkips      map[[2]string]uint64
	// Roles are the roles whose role-labelled counters are exported:
	// prefill always, decode once a decode rank was listed.
	Roles []string
	// VerdictLookups counts prefill verdict lookups by answer (every
	// VerdictAnswers value present); LedgerRooms is the size of the
	// ledger of rooms released on prefill.
	VerdictLookups map[string]uint64
	LedgerRooms    int
	Webhook        map[string]uint64
	Restarts       map[string]uint64 // every restart result present
	WedgeOrders    map[string]uint64 // every OrderResults value present
	TrackedRooms   int
	RoomLimitHits  uint64
	LastCycle      time.Duration
}

// SourceStatus is the health of one source. Source is "metrics" or "plugin".
type SourceStatus struct {
	Source, Target string
	Up             bool
	Duration       time.Duration
	Failures       uint64
}

// RankSnapshot is one plugin rank, present once its listing succeeded. Two
// targets that report the same DPRank and PPRank (a collision) each have
// their own; the exporter merges them.
type RankSnapshot struct {
	Target string
	// Role is RolePrefill or RoleDecode. On decode, ByPoll, OldestAge,
	// Stuck and the age histogram are about decode requests (prealloc and
	// transfer queues).
	Role                   string
	DPRank, PPRank, TPRank int
	Queues                 pluginapi.Queues
	ByPoll                 map[string]int // every poll state present
	OldestAge              float64
	Stuck                  int
	LoopStall              time.Duration
	Wedged                 bool
	AgeBuckets             []uint64 // cumulative, per ageBuckets
	AgeCount               uint64
	AgeSum                 float64
	// TransferWedged is true while a transfer queue of the rank is
	// diagnosed or suspected wedged; TransferWedges counts them.
	TransferWedged bool
	TransferWedges uint64
	// Unactionable counts stuck requests by the skip reason that keeps
	// them stuck (every UnactionableReasons value present).
	Unactionable map[string]int
	// DeadThreads counts the rank's KV manager threads listed dead, by
	// role (every pluginapi.ThreadRoles value present); nil when its
	// plugin does not report kv_threads.
	DeadThreads map[string]int
}

// GaugeSnapshot is one SGLang queue gauge.
type GaugeSnapshot struct {
	Key       GaugeKey
	Value     float64
	Unchanged time.Duration
	Pinned    bool
}

// AgeBuckets returns the upper bounds of the inflight age histogram.
func AgeBuckets() []float64 { return append([]float64(nil), ageBuckets...) }

// Snapshot copies the current state.
func (w *Watchdog) Snapshot() Snapshot {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.clock.Now()
	s := Snapshot{
		Mode:           w.mode,
		RestartMode:    w.restartMode,
		ModeChanges:    w.modeChanges,
		ModeFileErrors: w.modeFile.errors,
		ForceFails:     map[[2]string]uint64{},
		Skips:          map[string]uint64{},
		RoleForceFails: map[[3]string]uint64{},
		RoleSkips:      map[[2]string]uint64{},
		VerdictLookups: map[string]uint64{},
		LedgerRooms:    w.ledger.len(),
		Roles:          []string{RolePrefill},
		Webhook:        map[string]uint64{},
		Restarts:       map[string]uint64{},
		WedgeOrders:    map[string]uint64{},
		TrackedRooms:   w.tracked,
		RoomLimitHits:  w.limits,
		LastCycle:      w.lastCycle,
	}
	for _, role := range Roles {
		for _, res := range Results {
			for _, tr := range Triggers {
				n := w.forceFails[[3]string{res, tr, role}]
				s.RoleForceFails[[3]string{res, tr, role}] = n
				s.ForceFails[[2]string{res, tr}] += n
			}
		}
		for _, r := range SkipReasons {
			n := w.skips[[2]string{r, role}]
			s.RoleSkips[[2]string{r, role}] = n
			s.Skips[r] += n
		}
	}
	if w.decodeSeen {
		s.Roles = append(s.Roles, RoleDecode)
	}
	for _, v := range VerdictAnswers {
		s.VerdictLookups[v] = w.lookups[v]
	}
	for k, v := range w.webhook {
		s.Webhook[k] = v
	}
	for _, r := range RestartResults {
		s.Restarts[r] = w.restarts[r]
	}
	for _, r := range OrderResults {
		s.WedgeOrders[r] = w.wedgeOrders[r]
	}
	if m := w.metrics; m != nil && m.status.seen {
		s.Sources = append(s.Sources, sourceStatus("metrics", &m.status))
	}
	if m := w.metrics; m != nil && m.sampled {
		s.MetricsSampled = true
		s.SinceProgress = now.Sub(m.lastProgress)
		for k, g := range m.gauges {
			s.Gauges = append(s.Gauges, GaugeSnapshot{Key: k, Value: g.value, Unchanged: now.Sub(g.lastChange), Pinned: gaugePinned(g, m, now, &w.cfg)})
		}
		sort.Slice(s.Gauges, func(i, j int) bool { return lessGauge(s.Gauges[i].Key, s.Gauges[j].Key) })
	}
	for _, rk := range w.ranks {
		if rk.status.seen {
			s.Sources = append(s.Sources, sourceStatus("plugin", &rk.status))
		}
		if !rk.listed {
			continue
		}
		rs := RankSnapshot{
			Target: rk.status.target, Role: rk.role, TransferWedged: len(rk.wedges) > 0, TransferWedges: rk.wedgeCount, Unactionable: map[string]int{},
			DPRank: rk.dpLabel, PPRank: rk.ppLabel, TPRank: rk.server.TPRank,
			Queues: rk.queues, ByPoll: map[string]int{}, OldestAge: rk.oldest, Stuck: rk.stuckCount,
			LoopStall: now.Sub(rk.loopAdvancedAt), Wedged: rk.wedged,
			AgeBuckets: make([]uint64, len(ageBuckets)), AgeCount: rk.hist.count, AgeSum: rk.hist.sum,
			DeadThreads: rk.deadThreads(),
		}
		for _, p := range pluginapi.PollStates {
			rs.ByPoll[p] = rk.byPoll[p]
		}
		for _, reason := range UnactionableReasons {
			rs.Unactionable[reason] = rk.unactionable[reason]
		}
		var cum uint64
		for i := range ageBuckets {
			if rk.hist.counts != nil {
				cum += rk.hist.counts[i]
			}
			rs.AgeBuckets[i] = cum
		}
		s.Ranks = append(s.Ranks, rs)
	}
	return s
}

func sourceStatus(source string, st *sourceState) SourceStatus {
	return SourceStatus{Source: source, Target: st.target, Up: st.up, Duration: st.duration, Failures: st.failures}
}

func lessGauge(a, b GaugeKey) bool {
	if a.Queue != b.Queue {
		return a.Queue < b.Queue
	}
	if a.DP != b.DP {
		return a.DP < b.DP
	}
	if a.PP != b.PP {
		return a.PP < b.PP
	}
	return a.TP < b.TP
}

// CountWebhook counts one Alertmanager webhook delivery by result.
func (w *Watchdog) CountWebhook(result string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.webhook[result]++
}
