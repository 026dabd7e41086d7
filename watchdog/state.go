package watchdog

import (
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

type roomKey struct {
	rid  string
	room uint64
}

// roomState remembers one inflight request from first sight.
type roomState struct {
	firstSeen  time.Time
	lastChange time.Time // last time poll or progress changed (or first sight)
	// iterAtChange is the rank's loop counter when poll or progress last
	// changed: a stall only counts while the loop kept running after it.
	iterAtChange uint64

	poll     string
	progress int64
	age      float64 // age_seconds from the last listing
	health   bool
	addr     string
	prompt   int

	stuck bool   // last verdict, for logging transitions
	seen  uint64 // rank cycle of the last listing that held this room

	// Actuator bookkeeping; only the actuator writes these.
	acting      bool      // an admin call for this room is under way
	done        bool      // no further call for this room
	dryRan      bool      // a dry run answered would_flip; only a real call may follow
	attempts    int       // calls that ended in error
	nextAttempt time.Time // earliest retry after an error
	skipped     map[string]bool
}

// ageBuckets are the upper bounds of sglang_watchdog_inflight_age_seconds.
var ageBuckets = []float64{1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600}

type ageHistogram struct {
	counts []uint64 // per bucket, not cumulative
	count  uint64
	sum    float64
}

func (h *ageHistogram) observe(v float64) {
	if h.counts == nil {
		h.counts = make([]uint64, len(ageBuckets))
	}
	for i, b := range ageBuckets {
		if v <= b {
			h.counts[i]++
			break
		}
	}
	h.count++
	h.sum += v
}

// sourceState is the health of one source.
type sourceState struct {
	target   string
	seen     bool // at least one read was attempted
	up       bool
	duration time.Duration
	failures uint64
	lastErr  string
}

// rankState is what the watchdog knows of one plugin rank.
type rankState struct {
	source PluginSource
	status sourceState

	listed bool // a listing has succeeded at least once
	server pluginapi.Server
	queues pluginapi.Queues

	iterations     uint64
	loopAdvancedAt time.Time
	// loopAdvancing is true when the counter moved between the last two
	// successful listings: only then are the observations fresh.
	loopAdvancing bool

	rooms map[roomKey]*roomState
	cycle uint64 // successful listings folded so far
	hist  ageHistogram

	// Verdicts of the last successful cycle; kept while the source is down,
	// so that a failing source never reads as "nothing stuck".
	stuck   int
	wedged  bool
	byPoll  map[string]int
	oldest  float64
	dpLabel int
	ppLabel int
}

// gaugeState tracks one SGLang queue gauge between /metrics reads.
type gaugeState struct {
	value      float64
	lastChange time.Time
	pinned     bool // last verdict, for logging transitions
}

// metricsState is what the watchdog knows from SGLang's /metrics.
type metricsState struct {
	status       sourceState
	sampled      bool
	gauges       map[GaugeKey]*gaugeState
	progress     map[string]float64
	lastProgress time.Time
}

func (m *metricsState) transferFailed() (float64, bool) {
	v, ok := m.progress[TransferFailedFamily]
	return v, ok
}

// pending is a lever that was set and awaits confirmation of the release.
type pending struct {
	key      roomKey
	rank     *rankState
	trigger  string
	at       time.Time
	baseline float64 // TransferFailedFamily total when the lever was set
	gone     bool    // the room has left the listing
	age      float64
	poll     string
}
