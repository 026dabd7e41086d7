package watchdog

import (
	"fmt"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

type roomKey struct {
	rid  string
	room uint64
}

// reqKey names one request of one DP rank: under pipeline parallelism every
// PP stage of the DP rank lists it, and it is acted on once, on all of them.
type reqKey struct {
	role string
	dp   int
	roomKey
}

// roomState remembers one inflight request on one stage from first sight.
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
	// prefillAddrs: decode's prefill_rank_addrs, shared with the listing.
	prefillAddrs []string
	prompt       int
	// transfer_in_flight and transfer_queue; unknown with an older plugin.
	inFlightKnown bool
	inFlight      bool
	queue         int // transfer queue, -1 when unknown
	// Present when server.transfer_progress: the chunk of this room in
	// its worker's hands (noChunk when none) and its chunks waiting in the
	// queue (0 when unknown). A change of either is transfer activity.
	chunk        int64
	chunksQueued int
	// Attention TP/CP > 1, from peer_transfer_workers: its chunks waiting
	// in the other ranks' queues, and the peer chunks of it in flight
	// (peerHeld).
	peerChunksQueued int
	peerChunks       string
	// Decode requests only: the decode queue (prealloc, transfer) and
	// whether a transfer into the request's pages may have begun (unknown
	// counts as started).
	dqueue  string
	started bool
	// waitingMemory: a prealloc request waiting for decode KV pages,
	// which SGLang never times out; never stuck.
	waitingMemory bool

	stuck bool // last verdict, for logging transitions
	// early: a decode request short of its deadline that a "stopped"
	// verdict of prefill would release now (decodeEarly); never stuck.
	early bool
	seen  uint64 // rank cycle of the last listing that held this room
}

// reqState is the actuator's bookkeeping of one request, shared by its PP
// stages; only the actuator writes it.
type reqState struct {
	acting      bool      // an admin call for this request is under way
	done        bool      // no further call for this request
	dryRan      bool      // a dry run answered would_flip; only a real call may follow
	attempts    int       // calls that ended in error or a group_unwatched refusal
	nextAttempt time.Time // earliest retry after an error
	skipped     map[string]bool
	lastSkip    string // reason of the last skip, cleared by a call
}

// orphanState is an orphaned transfer (a room gone from the queue whose
// chunks are still outstanding) since first sight.
type orphanState struct {
	firstSeen time.Time
	queue     int // -1 when unknown
	seen      uint64
}

// transferWedge is the verdict on one transfer queue of a rank.
type transferWedge struct {
	since     time.Time
	diagnosed bool   // false: suspected (older plugin, no transfer fields)
	rule      string // wedgeInFlight, wedgeOverdue, wedgeOrphaned or wedgeSuspected
	room      uint64 // the evidence: the in-flight or orphaned room
	// chunk is the overdue chunk in the worker's hands (transfer_progress),
	// noChunk for a wedge diagnosed by the stall rules (stallWedges).
	chunk int64
}

// workerState is one transfer worker of a rank with transfer_progress, as
// of the last listing.
type workerState struct {
	tracked  bool
	inFlight *pluginapi.ChunkInFlight // nil while it waits
	// lastFinished is the number of the last finished chunk folded into
	// the rank's links (-1: none yet).
	lastFinished int64
	// link names the link of the chunk in flight ("" while it waits);
	// speed is that link's pace (pages/s), refreshed each cycle;
	// speedKnown is false while the link showed no chunk.
	link       string
	speed      float64
	speedKnown bool
	// chunkSeen is when this watchdog first listed the chunk now in
	// flight: a chunk is judged only once it was watched for the stall
	// window, so that a watchdog that just (re)started acts on nothing it
	// has not seen itself, whatever the plugin says the chunk was held.
	chunkSeen time.Time
}

// wedgeOrder is the watchdog's side of the standing order for one wedged
// queue (POST /admin/wedge_order).
type wedgeOrder struct {
	queue int
	chunk int64
	rule  string // of its wedge, for the log of its closing call
	// placed: the plugin answered ordered at least once (renewals are
	// free); dryRun: a dry run was answered, and is not repeated.
	placed, dryRun bool
	// cleared: the plugin said the worker no longer holds the chunk (409);
	// nothing is renewed until the listing shows another wedge.
	cleared bool
	// budgeted: the order took its slot of the fail-fast budget;
	// rateLimited: the budget kept it back once already (said once).
	budgeted, rateLimited bool
	// baseline is SGLang's transfer-failed counter at the last call: the
	// rooms an answer reports failed were failed since then.
	baseline float64
	// unsupported: the plugin takes no wedge orders (404, 501) or refused
	// this one; the rooms on the queue are left to the deadline path.
	unsupported bool
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
	log      sourceLog // sourcelog.go
}

// rankState is what the watchdog knows of one plugin rank.
type rankState struct {
	source PluginSource
	status sourceState
	// role is RoleDecode when the listing says disaggregation_mode
	// "decode", RolePrefill otherwise.
	role string
	// noDecodeSupport: a decode plugin that lists no decode_requests (one
	// older than the decode side); said once per process.
	noDecodeSupport bool

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
	// gen counts scheduler restarts seen on this target: (target, pid,
	// gen) names one process, even when a restart reuses the pid.
	gen uint64

	orphans map[uint64]*orphanState
	// queueChange is when a known room on each transfer queue last
	// changed poll or progress (or the queue was first seen).
	queueChange map[int]time.Time
	wedges      map[int]*transferWedge
	wedgeCount  uint64
	// reportsTransferProgress: the listing reports transfer_progress, so
	// its rooms are judged by their transfer workers (progressRoomStuck).
	reportsTransferProgress bool
	workers                 map[int]*workerState
	// peerWorkers are the transfer workers of the other ranks of the
	// leader's attention TP/CP group, by rank name; a chunk one
	// of them holds is judged by that rank's own worker and link.
	// peerHeld names, per room, the peer chunks of it in flight;
	// peerBehind lists the peer workers it has a chunk queued behind.
	peerWorkers map[string]map[int]*workerState
	// links are the paces of this rank's links, peerLinks those of each
	// other rank of the group, by rank name (links.go).
	links      linkBook
	peerLinks  map[string]linkBook
	peerHeld   map[uint64]string
	peerBehind map[uint64][]*workerState
	// orders holds the wedge orders of this process by queue; an entry
	// lives as long as the queue's wedge. closing holds the orders whose
	// wedge cleared, for one last call that reports the rooms they failed
	// since their last renewal (the plugin answers 409 with them).
	orders  map[int]*wedgeOrder
	closing []*wedgeOrder
	// departed holds the rooms that left this cycle's listing while an
	// order stood: a plugin fails a room at a scheduler pass, often
	// before the listing read ahead of the call that reports it, and its
	// audit line and ledger entry need what was known of it.
	departed    map[roomKey]*roomState
	leverWarned bool // "no lever works here" was said for this process
	// threadsKnown: the last listing reported kv_threads. deadSince holds
	// each thread it showed dead, with when this watchdog first saw it
	// dead; deadLogged the ones whose death was logged (threads.go).
	threadsKnown bool
	deadSince    map[threadKey]time.Time
	deadLogged   map[threadKey]bool

	// Verdicts of the last successful cycle; kept while the source is down,
	// so that a failing source never reads as "nothing stuck".
	stuckCount int
	wedged     bool
	// unactionable counts stuck requests by the skip reason that keeps
	// them stuck (source_down, unsupported), as of the last evaluation.
	unactionable map[string]int
	byPoll       map[string]int
	oldest       float64
	dpLabel      int
	ppLabel      int
}

// holds tells whether the worker of queue q holds chunk as of the last
// listing. A closing call is sent only when it does not: chunk numbers
// only grow, so the plugin can but answer wedge_cleared, and nothing new
// stands.
func (rk *rankState) holds(q int, chunk int64) bool {
	ws := rk.workers[q]
	return ws != nil && ws.inFlight != nil && ws.inFlight.Chunk == chunk
}

// name is how a verdict names a prefill rank: by its DP and PP ranks,
// never by its plugin URL, since the verdict API answers any decode-side
// caller and the URL is an internal address.
func (rk *rankState) name() string {
	return fmt.Sprintf("prefill rank dp%d/pp%d", rk.dpLabel, rk.ppLabel)
}

// gaugeState tracks one SGLang queue gauge between /metrics reads.
type gaugeState struct {
	value      float64
	lastChange time.Time
	pinned     bool // last verdict, for logging transitions
}

// metricsState is what the watchdog knows from SGLang's /metrics.
type metricsState struct {
	status  sourceState
	sampled bool
	gauges  map[GaugeKey]*gaugeState
	// counters are the progress counters' totals by family, the
	// failure counters that confirm a release among them.
	counters     map[string]float64
	lastProgress time.Time
}

// counter returns the total of one failure counter family.
func (m *metricsState) counter(family string) (float64, bool) {
	v, ok := m.counters[family]
	return v, ok
}

// unsupported tells whether the rank's plugin says no lever works on its
// SGLang version and backend. An absent levers list (older plugin) means
// the version 1 lever is assumed to work.
func (rk *rankState) unsupported() bool {
	return rk.server.Levers != nil && len(rk.server.Levers) == 0
}

// pending is a lever that was set and awaits confirmation of the release.
type pending struct {
	key      reqKey
	rank     *rankState   // the stage the decision was made on
	stages   []*rankState // every stage the lever was set on
	trigger  string
	at       time.Time
	family   string  // the failure counter that confirms this release
	baseline float64 // its total when the lever was set
	age      float64
	poll     string
}

// gone tells whether the request has left every stage it was set on.
func (p *pending) gone() bool {
	for _, rk := range p.stages {
		if _, ok := rk.rooms[p.key.roomKey]; ok {
			return false
		}
	}
	return true
}
