package sglangsim

import (
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// kvPoll mirrors SGLang's KVPoll (SGLang v0.5.18: disaggregation/base/conn.py).
type kvPoll int8

const (
	pollFailed          kvPoll = 0
	pollBootstrapping   kvPoll = 1
	pollWaitingForInput kvPoll = 2
	pollTransferring    kvPoll = 3
	pollSuccess         kvPoll = 4
)

func (p kvPoll) String() string {
	switch p {
	case pollFailed:
		return pluginapi.PollFailed
	case pollBootstrapping:
		return pluginapi.PollBootstrapping
	case pollWaitingForInput:
		return pluginapi.PollWaitingForInput
	case pollTransferring:
		return pluginapi.PollTransferring
	case pollSuccess:
		return pluginapi.PollSuccess
	}
	return pluginapi.PollUnknown
}

func (p kvPoll) terminal() bool { return p == pollSuccess || p == pollFailed }

const (
	maxBatchTokens   = 65536 // prompt tokens per simulated prefill batch
	chunkTokens      = 1024  // prompt tokens per KV chunk of a healthy transfer
	chunkedPrefill   = 8192  // prompts above this go through chunked prefill
	lognormalSigma   = 1.0   // healthy transfer time: p99.9 = exp(3.09) ~ 22x median
	maxTransferRatio = 100   // cap of a healthy transfer time, in medians
	kvMBPerToken     = 0.125 // Llama-3.1-8B bf16: 32 layers * 8 kv heads * 128 * 2 * 2 bytes
	basePID          = 4242
)

// request is one SGLang Req as every PP stage of its DP rank holds it: the
// same rid and room everywhere, one sender per stage.
type request struct {
	rid        string
	room       uint64
	addr       string
	prompt     int
	cached     int
	behavior   Behavior
	fake       bool   // fake sender (health checks, warm-up)
	decodePort int    // destination decode endpoint; 0 for the fake sender
	link       string // its destination's name, as the plugin lists a link
	queue      int    // transfer worker queue; -1 for the fake sender
	rec        int    // index into group.records

	arrived       time.Time
	bootstrapDone time.Time // decode sent its metadata: its waiting starts
	waitingSince  time.Time
	entered       time.Time

	// The plan of the transfer, measured in worker time ("work"), which
	// stands still while the room waits behind a wedged worker.
	pickup     time.Duration // WaitingForInput until the worker picks the room up
	chunkEvery time.Duration
	nChunks    int64 // -1: never finishes
	freezeAt   int64 // pins: chunks sent before the pin takes hold; -1 none
	failAt     time.Duration

	senders []*sender // one per PP stage: the attention-TP leader's
	// tp is every attention-TP rank's sender, per PP stage: tp[pp][0] is
	// senders[pp], the others the non-leader ranks' (Options.AttnTP).
	tp      [][]*sender
	holding int // stages whose inflight queue still holds it

	// listed is the progress the plugin lists for every stage's sender:
	// the scheduler's hand-overs, all done before the request enters the
	// inflight queue, so it stands still for the whole stay (see listedProgress).
	listed int64
	// workerProgress: the listing shows the worker's chunks instead (the
	// parity scene only, to match the Python stand-in's hand-set progress).
	workerProgress bool
	// setTransferring: the room's status reads Transferring while its
	// chunks are sent, whatever the backend (the parity scene only: the
	// Python stand-in's senders are set to it by hand).
	setTransferring bool
}

// healthCheck is how the plugin recognises SGLang's own requests: the fake
// bootstrap host, room 0, or the health-check rid prefix (SGLang v0.5.18:
// FAKE_BOOTSTRAP_HOST in disaggregation/utils.py, HEALTH_CHECK_RID_PREFIX in
// constants.py).
func (q *request) healthCheck() bool {
	host, _, _ := strings.Cut(q.addr, ":")
	return q.fake || q.room == 0 || host == FakeBootstrapHost || strings.HasPrefix(q.rid, HealthCheckPrefix)
}

func (q *request) ids() (string, uint64) { return q.rid, q.room }

func (q *request) lever(backend string) string {
	if !q.fake && backend == BackendNIXL {
		return pluginapi.LeverSendFailed
	}
	return pluginapi.LeverConcludeState
}

// sender is one PP stage's KV sender of a request, with what that stage's
// KV manager and transfer worker know of the room.
type sender struct {
	q      *request
	pinned bool // the request's pin holds on this stage and TP rank
	tp     int  // attention-TP rank; 0 is the leader

	work    time.Duration // worker time spent on the room
	started bool          // its queue's worker took the room's first chunk
	frozen  bool          // a pin took hold
	blocked bool          // waiting behind a wedged worker
	// own: mid-2025 NIXL, whose scheduler thread posts each chunk of the
	// room itself and whose poll() reads the room's own handles
	// (disaggregation/nixl/conn.py, v0.5.11): the room is played on a
	// worker of its own, and a stuck handle (ownStuck) holds no other room.
	own      *worker
	ownStuck *sender
	wedging  bool  // this sender's stuck handle holds its queue's worker
	progress int64 // chunks the worker sent (decode's view; not the listing's)
	// outstanding is NIXL's _staging_outstanding for the room: chunks taken
	// off the queue or posted and not settled.
	outstanding int
	// released: this stage's inflight queue let the request go; a chunk
	// still outstanding then settles at orphanUntil (zero: never, a stuck
	// handle), when the worker's time reaches settleWork.
	released    bool
	orphanUntil time.Time
	settleWork  time.Duration
	orphaned    bool // released with a chunk in flight that will settle
	// taken counts the room's chunks its worker took off the queue
	// (skipped ones included); the last one taken is in the worker's hands
	// while the room heads the queue.
	taken int64
	// lastPoll is what the scheduler's last pass read: with attention TP
	// the MIN over the group's ranks (SGLang v0.5.18:
	// disaggregation/utils.py poll_and_all_reduce), which every rank acts
	// on. local is this sender's own poll of that pass, which the plugin
	// lists and its orders check; the same with one rank.
	lastPoll kvPoll
	local    kvPoll

	aborted      bool // abort(): record_failure, conclude_state = Failed
	statusFailed bool // update_status(room, Failed) took
	sendFailed   bool // _send_failed = True
	forced       bool
}

// record is the compact ground truth of one request (see Record).
type record struct {
	rid         string
	room        uint64
	entered     int64 // unix nanoseconds; 0 = not yet
	left        int64
	forced      int64
	decode      int64
	dAdmit      int64
	dForced     int64
	corruptedBy string
	rank        int32
	drank       int32 // -1: never reached decode
	kind        uint8 // index into kinds
	outcome     uint8 // index into outcomes
	dend        uint8 // index into decodeEnds
	unsafe      uint8 // index into decodeEnds
	prefillFree uint8 // index into prefillFrees
	progressing bool
	// wedgeOrdered: a wedge order set the lever.
	wedgeOrdered bool
	queue        int8   // transfer queue; -1: none
	port         uint16 // decode port; 0: none
}

func kindIndex(k Kind) uint8 {
	for i, v := range kinds {
		if v == k {
			return uint8(i)
		}
	}
	return 0
}

func outcomeIndex(o Outcome) uint8 {
	for i, v := range outcomes {
		if v == o {
			return uint8(i)
		}
	}
	return 0
}

func unixTime(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

func (rc *record) export() Record {
	return Record{
		RID:                   rc.rid,
		Room:                  rc.room,
		Rank:                  int(rc.rank),
		Kind:                  kinds[rc.kind],
		EnteredInflight:       unixTime(rc.entered),
		Left:                  unixTime(rc.left),
		Outcome:               outcomes[rc.outcome],
		ForcedAt:              unixTime(rc.forced),
		ProgressingWhenForced: rc.progressing,
		WedgeOrdered:          rc.wedgeOrdered,
		TransferQueue:         int(rc.queue),
		DecodePort:            int(rc.port),
		DecodeReleased:        unixTime(rc.decode),
		DecodeRank:            int(rc.drank),
		DecodeAdmitted:        unixTime(rc.dAdmit),
		DecodeEnd:             decodeEnds[rc.dend],
		DecodeForcedAt:        unixTime(rc.dForced),
		UnsafeFree:            decodeEnds[rc.unsafe],
		PrefillFreedUnder:     prefillFrees[rc.prefillFree],
		CorruptedBy:           rc.corruptedBy,
	}
}

// order is a queued force-fail order (docs/plugin-api.md, clarification 3-4).
type order struct {
	req   pluginapi.ForceFailRequest
	state int // orderPending, orderClaimed or orderWithdrawn; guarded by rank.mu
	done  chan orderResult
}

const (
	orderPending = iota
	orderClaimed
	orderWithdrawn
)

type orderResult struct {
	status int
	resp   pluginapi.ForceFailResponse
}

// group is one DP rank: its PP stages share the requests, the front queues
// and one lock.
type group struct {
	mu     sync.Mutex
	dp     int
	stages []*rank
	rng    *rand.Rand

	arrivalRate float64 // requests per second on this DP rank
	nextArrival time.Time
	hcEvery     time.Duration // this DP rank's share of the health checks
	nextHC      time.Time

	bootstrapQ []*request
	waitingQ   []*request
	records    []record
}

// orphan is a room released while its transfer worker still holds a chunk
// of it (round 2 orphaned_transfers).
type orphan struct {
	room  uint64
	queue int
	until time.Time // when the chunk settles; zero = never (a stuck handle)
}

// rank is one (dp, pp) prefill scheduler process, led by attention-TP rank 0.
type rank struct {
	mu *sync.Mutex // the group's

	g           *group
	idx, dp, pp int
	pid         int
	running     bool // a Start goroutine drives this rank
	paused      bool

	inflight   []*request
	byRID      map[string]*request // the inflight queue by rid
	pending    []*order
	inflightTk int // prompt tokens held by the inflight queue

	iterations uint64 // inflight passes seen by the plugin hook
	lastIter   time.Time
	// xfer is the leader's transfer side; peers the other attention-TP
	// ranks' (Options.AttnTP - 1), each with its own workers.
	xfer
	peers []*xfer
	// orders are the standing wedge orders by queue (round 4).
	orders [TransferQueues]*wedgeOrder

	m rankMetrics
}

func unixSeconds(t time.Time) float64 {
	if t.IsZero() {
		return 0
	}
	return float64(t.UnixNano()) / 1e9
}

// reset puts the DP rank in the state of freshly started scheduler
// processes that serve from `up` on (also used by Restart and SetScenario).
// Requests still inside are lost; decode fails them through its heartbeat.
func (g *group) reset(s *Sim, now, up time.Time, gen int, quiet bool) {
	lose := func(q *request) {
		rc := &g.records[q.rec]
		if o := outcomes[rc.outcome]; o != OutcomeQueued && o != OutcomeInflight {
			return
		}
		rc.left = now.UnixNano()
		rc.outcome = outcomeIndex(OutcomeRestarted)
		if q.fake {
			rc.decode = rc.left // prefill's own health checks never reach decode
		}
	}
	for _, q := range g.bootstrapQ {
		lose(q)
	}
	for _, q := range g.waitingQ {
		lose(q)
	}
	g.bootstrapQ, g.waitingQ = nil, nil
	for _, r := range g.stages {
		for _, q := range r.inflight {
			lose(q)
		}
		r.reset(gen)
	}
	n := float64(s.opts.DPSize)
	g.arrivalRate = 0
	if !quiet {
		g.arrivalRate = s.opts.ArrivalRate / n
	}
	g.nextArrival = time.Time{}
	if g.arrivalRate > 0 {
		// Clients keep sending while the server boots: those arrivals are
		// refused (arrive).
		g.nextArrival = now.Add(g.expInterval())
	}
	g.hcEvery = 0
	g.nextHC = time.Time{}
	if s.opts.HealthCheckEvery > 0 && !quiet {
		g.hcEvery = s.opts.HealthCheckEvery * time.Duration(n)
		g.nextHC = up.Add(s.opts.HealthCheckEvery * time.Duration(g.dp+1))
	}
	// The warm-up request at start-up (fake host) forms a prefill batch, so
	// every gauge is written once (SGLang v0.5.18:
	// managers/scheduler_components/metrics_reporter.py: gauges change only on
	// a log).
	for _, r := range g.stages {
		r.logStats(s, up, 0)
	}
}

// reset empties one scheduler process; its requests' records are the
// group's business.
func (r *rank) reset(gen int) {
	r.inflight = nil
	clear(r.byRID)
	withdrawOrders(r.pending)
	r.pending = nil
	r.inflightTk = 0
	r.iterations = 0
	r.lastIter = time.Time{}
	// The links' speeds are the network's: a restart keeps them.
	r.xfer = xfer{links: r.links}
	for _, x := range r.peers {
		*x = xfer{links: x.links}
	}
	r.orders = [TransferQueues]*wedgeOrder{}
	r.pid = basePID + r.idx + 1000*gen
	r.m = rankMetrics{}
}

func (g *group) expInterval() time.Duration {
	return time.Duration(g.rng.ExpFloat64() / g.arrivalRate * float64(time.Second))
}

func (g *group) randomRID() string {
	var b [32]byte
	const hex = "0123456789abcdef"
	a, c := g.rng.Uint64(), g.rng.Uint64()
	for i := 0; i < 16; i++ {
		b[i] = hex[a>>(60-4*i)&0xf]
		b[16+i] = hex[c>>(60-4*i)&0xf]
	}
	return string(b[:])
}

func (g *group) randomRoom() uint64 {
	for {
		if v := g.rng.Uint64(); v != 0 {
			return v
		}
	}
}

// drawTransfer draws a healthy transfer time: lognormal around the median.
func drawTransfer(rng *rand.Rand, median time.Duration) time.Duration {
	f := math.Exp(lognormalSigma * rng.NormFloat64())
	if f > maxTransferRatio {
		f = maxTransferRatio
	}
	return time.Duration(float64(median) * f)
}

func (g *group) drawPrompt() int {
	p := int(2048 * math.Exp(0.7*g.rng.NormFloat64()))
	return min(max(p, 64), 32768)
}

func ceilDiv(a, b time.Duration) int64 {
	if b <= 0 {
		return 1
	}
	return int64((a + b - 1) / b)
}

// decodePortOf binds a room to one of the deployment's decode endpoints
// without drawing from the random stream (a fixed mix of the room).
func decodePortOf(ports []int, room uint64) int {
	h := room * 0x9E3779B97F4A7C15
	return ports[(h>>32)%uint64(len(ports))]
}

// transferQueue is the queue index the backend's KV manager gives a room
// (SGLang v0.5.18: disaggregation/nixl/conn.py).
func transferQueue(key string, room uint64, decodePort int) int {
	if key == QueueKeyRoom {
		return int(room % TransferQueues)
	}
	// Newest NIXL: the sum of the destination decode ports; one port per
	// simulated endpoint.
	return decodePort % TransferQueues
}

// newRequest builds a request arriving at `at` on rank index `rank` and its
// record.
func (g *group) newRequest(s *Sim, spec RequestSpec, at time.Time, rank int) *request {
	q := &request{behavior: spec.Behavior, arrived: at, freezeAt: -1, nChunks: -1, queue: -1}
	q.bootstrapDone = at.Add(max(spec.Bootstrap, 0))
	kind := kindOf(spec.Behavior)
	if kind == KindHealthCheck {
		q.fake = true
		q.rid = spec.RID
		if q.rid == "" {
			if spec.Warmup {
				q.rid = g.randomRID()
			} else {
				q.rid = HealthCheckPrefix + "_" + pyRepr(unixSeconds(at))
			}
		}
		// SGLang sends health checks with no bootstrap port: the address is the bare host.
		q.addr = FakeBootstrapHost
		q.prompt = 1
	}
	if !q.fake {
		q.rid = spec.RID
		if q.rid == "" {
			q.rid = g.randomRID()
		}
		q.room = spec.Room
		if q.room == 0 {
			q.room = g.randomRoom()
		}
		q.addr = s.opts.BootstrapAddr
		q.prompt = g.drawPrompt()
		q.cached = int(float64(q.prompt) * 0.3 * g.rng.Float64())
		q.decodePort = spec.DecodePort
		if q.decodePort <= 0 {
			q.decodePort = decodePortOf(s.opts.DecodePorts, q.room)
		}
		q.queue = transferQueue(s.opts.QueueKey, q.room, q.decodePort)
		q.link = DestinationName(s.opts.Backend, q.decodePort)
	}
	if spec.PromptTokens > 0 {
		q.prompt = spec.PromptTokens
		q.cached = min(q.cached, q.prompt-1)
	}
	q.listed = listedProgress(s.opts.Backend, q.prompt)
	g.plan(s, q, spec)
	pin := kind.Pin()
	for pp := range g.stages {
		on := pin && (spec.PinStages == nil || containsInt(spec.PinStages, pp))
		row := make([]*sender, s.opts.AttnTP)
		for t := range row {
			row[t] = &sender{q: q, tp: t, pinned: on && (spec.PinTPRanks == nil || containsInt(spec.PinTPRanks, t)),
				lastPoll: pollBootstrapping, local: pollBootstrapping}
		}
		q.senders = append(q.senders, row[0])
		q.tp = append(q.tp, row)
	}
	q.rec = len(g.records)
	g.records = append(g.records, record{rid: q.rid, room: q.room, rank: int32(rank), drank: -1,
		kind: kindIndex(kind), outcome: outcomeIndex(OutcomeQueued), queue: int8(q.queue), port: uint16(q.decodePort)})
	// Stages before the scheduler (tokenizer side), observed on arrival.
	m := &g.stages[0].m
	ms := func(lo, hi float64) float64 { return (lo + (hi-lo)*g.rng.Float64()) / 1000 }
	m.stage(stageTokenize, ms(0.2, 5))
	m.stage(stageDispatch, ms(0.05, 0.5))
	m.stage(stageRequestProcess, ms(0.5, 3))
	return q
}

// kindOf is the ground-truth class of a request submitted with behaviour b.
func kindOf(b Behavior) Kind {
	switch b {
	case BehaviorHealthCheck, BehaviorStuckHealthCheck:
		return KindHealthCheck
	case BehaviorSlow:
		return KindSlow
	case BehaviorTransferFail:
		return KindFailing
	case BehaviorPinResurrection:
		return KindPinResurrection
	case BehaviorPinAbortBeforeRegister:
		return KindPinAbortBeforeRegister
	case BehaviorPinStuckHandle:
		return KindPinStuckHandle
	}
	return KindHealthy
}

// refuse records a request that arrived at `at` while the server booted:
// nobody listened, so it got no sender, no scheduler stage and no decode
// side. Its rid and room are the client's (drawn when the spec has none).
func (g *group) refuse(spec RequestSpec, at time.Time, rank int) (rid string, room uint64) {
	kind := kindOf(spec.Behavior)
	rid, room = spec.RID, spec.Room
	if kind == KindHealthCheck {
		room = 0
		if rid == "" && !spec.Warmup {
			rid = HealthCheckPrefix + "_" + pyRepr(unixSeconds(at))
		}
	} else if room == 0 {
		room = g.randomRoom()
	}
	if rid == "" {
		rid = g.randomRID()
	}
	g.records = append(g.records, record{rid: rid, room: room, rank: int32(rank), drank: -1,
		kind: kindIndex(kind), outcome: outcomeIndex(OutcomeRefusedBooting), left: at.UnixNano(), queue: -1})
	return rid, room
}

func containsInt(xs []int, x int) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// plan fixes how the request's transfer will go.
func (g *group) plan(s *Sim, q *request, spec RequestSpec) {
	if q.fake {
		return
	}
	d := spec.Transfer
	slow := q.behavior == BehaviorSlow
	if d == 0 {
		switch {
		case slow:
			d = 30*time.Second + time.Duration(g.rng.Float64()*float64(120*time.Second))
		case q.behavior == BehaviorPinAbortBeforeRegister:
			// Only the stages the pin does not hold transfer; no draw, so
			// that a pin leaves the random stream as it was.
			d = s.opts.TransferMedian
		default:
			d = drawTransfer(g.rng, s.opts.TransferMedian)
		}
	}
	endless := d < 0
	ce := spec.ChunkEvery
	if slow || endless {
		q.pickup = 0
		if ce <= 0 {
			ce = time.Duration(float64(s.opts.SlowChunkEvery) * (0.5 + 0.5*g.rng.Float64()))
		}
	} else {
		q.pickup = d / 50
		if ce <= 0 {
			n := max(int64((q.prompt+chunkTokens-1)/chunkTokens), ceilDiv(d-q.pickup, s.opts.SlowChunkEvery), 1)
			ce = (d - q.pickup) / time.Duration(n)
		}
	}
	if spec.Chunks > 0 && !endless {
		ce = time.Duration(ceilDiv(d-q.pickup, time.Duration(spec.Chunks)))
	}
	q.chunkEvery = max(ce, time.Nanosecond)
	if !endless {
		q.nChunks = max(ceilDiv(d-q.pickup, q.chunkEvery), 1)
		if spec.Chunks > 0 {
			q.nChunks = int64(spec.Chunks)
		}
	}
	switch q.behavior {
	case BehaviorPinResurrection, BehaviorPinStuckHandle:
		q.freezeAt = int64(spec.FreezeAt)
		if spec.FreezeAt == 0 {
			q.freezeAt = 3
			if q.behavior == BehaviorPinStuckHandle {
				q.freezeAt = 1
			}
		} else if spec.FreezeAt < 0 {
			q.freezeAt = 0
		}
		if q.nChunks >= 0 && q.nChunks <= q.freezeAt {
			q.nChunks = q.freezeAt + 1
		}
	case BehaviorTransferFail:
		q.failAt = q.pickup + (d-q.pickup)/2
	}
}

// pass is one iteration of the PD prefill event loop of one stage
// (event_loop_normal_disagg_prefill, SGLang v0.5.18: disaggregation/prefill.py;
// SGLang plugins/hook_registry.py, v0.5.11 to v0.5.18). Stage 0 carries the
// DP rank's requests from arrival into every stage's inflight queue. It
// reports whether the scheduler process crashed (LeversEarly: the Failed
// branch raised); the caller then restarts the server.
func (r *rank) pass(s *Sim, now time.Time) (crashed bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.paused || s.down(now) {
		return false
	}
	r.m.loopIterations++
	batched := false
	if r.pp == 0 {
		r.g.arrive(s, now)
		r.g.popBootstrapped(s, now)
		batched = r.g.prefillBatch(s, now)
	}
	if !batched && len(r.inflight) == 0 && now.Sub(r.m.lastLog) > s.opts.IdleRefresh {
		// self_check_during_idle / on_idle: only with an empty inflight queue.
		r.logStats(s, now, 0)
	}
	if s.opts.HookRunsWhenEmpty || len(r.inflight) > 0 {
		r.iterations++
		r.lastIter = now
		r.takeOrders(s, now)
		r.applyWedgeOrders(s, now)
		if r.pollInflight(s, now) {
			return true
		}
	}
	r.pruneOrphans(now)
	return false
}

func (g *group) arrive(s *Sim, now time.Time) {
	if g.arrivalRate > 0 {
		for !g.nextArrival.After(now) {
			at := g.nextArrival
			b := BehaviorHealthy
			if s.opts.SlowFraction > 0 && g.rng.Float64() < s.opts.SlowFraction {
				b = BehaviorSlow
			}
			boot := 2*time.Millisecond + time.Duration(g.rng.Float64()*float64(28*time.Millisecond))
			spec := RequestSpec{Behavior: b, Bootstrap: boot}
			g.nextArrival = at.Add(g.expInterval())
			if s.down(at) {
				// The scheduler makes no pass while the server boots, so
				// this pass sees the arrivals of the boot late, by their time.
				g.refuse(spec, at, g.stages[0].idx)
				continue
			}
			q := g.newRequest(s, spec, at, g.stages[0].idx)
			g.bootstrapQ = append(g.bootstrapQ, q)
			s.toDecode(g, q)
		}
	}
	if g.hcEvery > 0 {
		for !g.nextHC.After(now) {
			at := g.nextHC
			g.bootstrapQ = append(g.bootstrapQ, g.newRequest(s, RequestSpec{Behavior: BehaviorHealthCheck}, at, g.stages[0].idx))
			g.nextHC = at.Add(g.hcEvery)
		}
	}
}

// popBootstrapped moves bootstrapped requests to the waiting queue
// (PrefillBootstrapQueue.pop_bootstrapped).
func (g *group) popBootstrapped(s *Sim, now time.Time) {
	m := &g.stages[0].m
	// A bootstrapped request takes a metadata buffer slot, which it holds
	// until it is released; with none free it stays in the bootstrap queue.
	free := 2*s.opts.MaxRunningRequests - len(g.waitingQ) - g.holding()
	kept := g.bootstrapQ[:0]
	for _, q := range g.bootstrapQ {
		if q.bootstrapDone.After(now) || free <= 0 {
			kept = append(kept, q)
			continue
		}
		q.waitingSince = now
		for _, row := range q.tp {
			for _, sd := range row {
				sd.lastPoll, sd.local = pollWaitingForInput, pollWaitingForInput
			}
		}
		m.stage(stageBootstrap, now.Sub(q.arrived).Seconds())
		m.stage(stagePrepare, 0.0002+0.0001*float64(q.prompt%7))
		g.waitingQ = append(g.waitingQ, q)
		free--
	}
	clear(g.bootstrapQ[len(kept):])
	g.bootstrapQ = kept
}

// prefillBatch forms and runs one prefill batch on every stage, and moves
// its requests into every stage's inflight queue
// (process_batch_result_disagg_prefill). It reports whether a batch ran.
func (g *group) prefillBatch(s *Sim, now time.Time) bool {
	if len(g.waitingQ) == 0 {
		return false
	}
	// Every stage holds a request's KV pages and req_to_token slot from its
	// batch until that stage releases it; the stage holding most bounds the
	// batch. The waiting queue is served in order: a head that does not fit
	// blocks the rest (PrefillAdder stops at the first request it cannot
	// add), unless nothing is held at all.
	usedTk, usedReqs := 0, g.holding()
	for _, r := range g.stages {
		usedTk = max(usedTk, r.inflightTk)
	}
	n, tokens := 0, 0
	for n < len(g.waitingQ) && (n == 0 || tokens+g.waitingQ[n].prompt <= maxBatchTokens) {
		p := g.waitingQ[n].prompt
		if usedReqs+n >= s.opts.MaxRunningRequests || (usedTk+tokens+p > s.opts.KVPoolTokens && usedReqs+n > 0) {
			break
		}
		tokens += p
		n++
	}
	if n == 0 {
		return false
	}
	batch := g.waitingQ[:n]
	newest := s.opts.Era == EraNewest
	if !newest {
		// v0.5 and older: log_prefill_stats when the batch is formed, before
		// its requests enter the inflight queue (SGLang v0.5.18:
		// managers/scheduler_components/metrics_reporter.py).
		all := g.waitingQ
		g.waitingQ = all[n:]
		for _, r := range g.stages {
			r.logStats(s, now, 0)
		}
		g.waitingQ = all
	}
	for _, q := range batch {
		fwd := 0.004 + float64(q.prompt-q.cached)*15e-6
		for _, r := range g.stages {
			r.m.stage(stageWaiting, now.Sub(q.waitingSince).Seconds())
			r.m.stage(stageForward, fwd)
			if q.prompt > chunkedPrefill {
				r.m.stage(stageChunkedPrefill, fwd/2)
			}
			r.m.realtimeCompute += float64(q.prompt - q.cached)
			r.m.realtimeCache += float64(q.cached)
			r.admit(q)
		}
		q.entered = now
		for _, r := range g.stages {
			for _, sd := range q.tp[r.pp] {
				r.enqueue(s, sd, now)
			}
		}
		rc := &g.records[q.rec]
		rc.entered = now.UnixNano()
		rc.outcome = outcomeIndex(OutcomeInflight)
	}
	rest := copy(g.waitingQ, g.waitingQ[n:])
	clear(g.waitingQ[rest:])
	g.waitingQ = g.waitingQ[:rest]
	if newest {
		// Newest: report_prefill_stats after the batch result put the
		// requests into the inflight queue (SGLang v0.5.18:
		// disaggregation/prefill.py); num_running_reqs
		// counts the batch (PR #31495).
		for _, r := range g.stages {
			r.logStats(s, now, n)
		}
	}
	return true
}

// holding is the number of requests the stage holding most still holds.
func (g *group) holding() int {
	n := 0
	for _, r := range g.stages {
		n = max(n, len(r.inflight))
	}
	return n
}

// admit appends q to this stage's inflight queue.
func (r *rank) admit(q *request) {
	r.inflight = append(r.inflight, q)
	r.byRID[q.rid] = q
	r.inflightTk += q.prompt
	q.holding++
}

// logStats is log_prefill_stats / the idle refresh: the only writer of the
// scheduler gauges.
func (r *rank) logStats(s *Sim, now time.Time, running int) {
	m := &r.m
	m.lastLog = now
	g := &m.g
	g[gRunning] = float64(running)
	g[gQueue] = float64(len(r.g.waitingQ))
	g[gInflight] = float64(len(r.inflight))
	g[gBootstrapQ] = float64(len(r.g.bootstrapQ))
	used := float64(r.inflightTk)
	g[gUsedTokens] = used
	pool := float64(s.opts.KVPoolTokens)
	g[gTokenUsage] = math.Round(used/pool*100) / 100
	g[gMaxTotalTokens] = pool
	g[gUtilization] = -1 // calculate_utilization() on prefill servers (SGLang v0.5.18: observability/metrics_collector.py)
	g[gStartup] = 41.7
	g[gLoadWeights] = 12.3
	g[gContextLen] = 131072
	g[gPageSize] = 1
	g[gKVUsed] = used
	g[gKVAvailable] = pool - used
	g[gFullTokenUsage] = g[gTokenUsage]
	if c, p := m.realtimeCache, m.realtimeCompute; c+p > 0 {
		g[gCacheHit] = math.Round(c/(c+p)*1000) / 1000
	}
}

// pollInflight is process_disagg_prefill_inflight_queue (SGLang v0.5.18:
// disaggregation/prefill.py, managers/scheduler_pp_mixin.py): poll every sender of this stage that is not terminal yet, then
// release the requests that every stage reports terminal (Success or
// Failed); the others stay. It reports a crash: in LeversEarly the Failed
// branch raises.
func (r *rank) pollInflight(s *Sim, now time.Time) (crashed bool) {
	for _, q := range r.inflight {
		sd := q.senders[r.pp]
		if sd.lastPoll.terminal() {
			continue
		}
		p := r.poll(s, sd, now)
		sd.local = p
		// Every TP rank polls its own sender and the group acts on the MIN
		// (KVPoll orders Failed < ... < Success): Success only once every
		// rank's share landed, Failed on every rank as soon as one fails
		// (SGLang v0.5.18: disaggregation/utils.py
		// poll_and_all_reduce_attn_cp_tp_group, disaggregation/prefill.py
		// process_disagg_prefill_inflight_queue).
		for _, peer := range q.tp[r.pp][1:] {
			pp := r.poll(s, peer, now)
			peer.local, peer.lastPoll = pp, pp
			p = min(p, pp)
		}
		if p == pollFailed && (s.opts.LeverEra == LeversEarly || s.opts.LeverEra == LeversNIXLMid2025 && !q.fake) {
			// Mid-2025 NIXL (v0.4.6 to v0.5.11, disaggregation/nixl/conn.py):
			// NixlKVSender.poll() raises "KVSender transfer encountered an
			// error." on a failed transfer instead of returning Failed, and
			// the exception escapes the scheduler's pass.
			return true
		}
		sd.lastPoll = p
	}
	kept := r.inflight[:0]
	for _, q := range r.inflight {
		done := true
		for _, sd := range q.senders {
			done = done && sd.lastPoll.terminal()
		}
		if done {
			r.release(s, q, now)
		} else {
			kept = append(kept, q)
		}
	}
	clear(r.inflight[len(kept):])
	r.inflight = kept
	return false
}

// poll is the sender's poll() on this pass (SGLang v0.5.18:
// disaggregation/nixl/conn.py, mooncake/conn.py, managers/scheduler.py,
// disaggregation/common/conn.py).
func (r *rank) poll(s *Sim, sd *sender, now time.Time) kvPoll {
	q := sd.q
	if q.fake {
		// FakeKVSender: conclude_state, else Success once send() ran.
		switch {
		case sd.aborted:
			return pollFailed
		case q.behavior == BehaviorStuckHealthCheck:
			return pollWaitingForInput
		}
		return pollSuccess
	}
	if s.opts.Backend == BackendNIXL {
		// Newest NIXL reads _send_failed first and never conclude_state;
		// mid-2025 NIXL has no _send_failed.
		if sd.sendFailed && s.opts.LeverEra != LeversNIXLMid2025 {
			return pollFailed
		}
	} else if sd.aborted {
		return pollFailed // Mooncake: conclude_state
	}
	st, _ := r.status(s, sd, now)
	return st
}

// status is the KV manager's check_status(room) for sd's stage, with the
// room's transfer worker played up to now. present is false for a room
// absent from request_status (it reads WaitingForInput).
func (r *rank) status(s *Sim, sd *sender, now time.Time) (st kvPoll, present bool) {
	q := sd.q
	if sd.pinned && q.behavior == BehaviorPinAbortBeforeRegister {
		// The room was never registered (SGLang v0.5.18: disaggregation/common/conn.py).
		return pollWaitingForInput, false
	}
	if sd.own != nil {
		play(r.xf(sd.tp), sd.own, &sd.ownStuck, func() {}, now)
	} else {
		r.run(r.xf(sd.tp), q.queue, now)
	}
	if sd.statusFailed {
		return pollFailed, true
	}
	if sd.frozen {
		if q.behavior == BehaviorPinStuckHandle {
			return s.sending(q), true
		}
		return pollTransferring, true
	}
	if !sd.started || sd.work < q.pickup {
		sd.outstanding = 0
		return pollWaitingForInput, true
	}
	if q.behavior == BehaviorTransferFail && sd.work >= q.failAt {
		sd.outstanding = 0
		return pollFailed, true
	}
	if sd.own == nil && q.queue >= 0 && r.xf(sd.tp).workers[q.queue].dead {
		// Its worker died between two of its chunks (KillTransferWorker):
		// none is outstanding, and none ever will be.
		sd.outstanding = 0
		return s.sending(q), true
	}
	p := int64((sd.work - q.pickup) / q.chunkEvery)
	if sd.pinned && q.freezeAt >= 0 && p >= q.freezeAt {
		// Resurrection: the transfer failed, then a late update revived the
		// status; nothing is outstanding and the worker went on. (The stuck
		// handle froze in runWorker.)
		sd.progress = max(sd.progress, q.freezeAt)
		sd.frozen = true
		sd.outstanding = 0
		return pollTransferring, true
	}
	if q.nChunks >= 0 && p >= q.nChunks {
		sd.progress = q.nChunks
		sd.outstanding = 0
		return pollSuccess, true
	}
	sd.progress = max(sd.progress, p)
	sd.outstanding = 1
	return s.sending(q), true
}

// sending is what check_status reads while a room's chunks are being sent
// (or held by a stuck handle): NIXL v0.5.18's transfer worker writes
// Transferring as it takes a room's chunk (disaggregation/nixl/conn.py);
// Mooncake's managers (v0.5.11, v0.5.18: mooncake/conn.py) and mid-2025
// NIXL's (v0.5.11: nixl/conn.py, whose poll() reads its handles once sent)
// never write it, so the room reads WaitingForInput until Success. Shown
// with SGLang's own code by e2e/parity_fields_test.go.
func (s *Sim) sending(q *request) kvPoll {
	if q.setTransferring || s.opts.Backend == BackendNIXL && s.opts.LeverEra != LeversNIXLMid2025 {
		return pollTransferring
	}
	return pollWaitingForInput
}

// enqueue puts sd's room on its queue's worker (mid-2025 NIXL: on one of
// its own, see sender.own): the scheduler handed its last chunk over as
// the request entered the inflight queue at `at`.
func (r *rank) enqueue(s *Sim, sd *sender, at time.Time) {
	q := sd.q
	if q.fake || (sd.pinned && q.behavior == BehaviorPinAbortBeforeRegister) {
		return // the fake sender has no queue; an unregistered room sends nothing
	}
	if s.opts.LeverEra == LeversNIXLMid2025 {
		sd.own = &worker{clock: at, fifo: []*sender{sd}}
		return
	}
	// The worker's time up to the hand-over belongs to the rooms queued
	// before it (released ones included, which the worker skips): played
	// first, so that the room gets none of it.
	x := r.xf(sd.tp)
	r.run(x, q.queue, at)
	w := &x.workers[q.queue]
	w.fifo = append(w.fifo, sd)
	r.markBehind(x, q.queue)
}

// doneAt is the worker time at which the worker is done with sd: its last
// chunk settled, its transfer failed, its pin took hold, or (a room whose
// status is Failed) the chunk in flight settled; -1: never (an endless
// transfer).
func (sd *sender) doneAt() time.Duration {
	q := sd.q
	if sd.released {
		// The worker finishes the chunk in flight, if any, then skips the
		// rest (the room is Failed, or done).
		return sd.settleWork
	}
	if sd.statusFailed {
		// The worker skips the chunks of a Failed room (SGLang v0.5.18:
		// disaggregation/nixl/conn.py transfer_worker): it finishes the chunk
		// in flight, if any.
		if !sd.started || sd.work <= q.pickup {
			return sd.work
		}
		return q.pickup + time.Duration(ceilDiv(sd.work-q.pickup, q.chunkEvery))*q.chunkEvery
	}
	if sd.pinned && q.freezeAt >= 0 {
		return q.pickup + time.Duration(q.freezeAt)*q.chunkEvery
	}
	if q.behavior == BehaviorTransferFail {
		return q.failAt
	}
	if q.nChunks < 0 {
		return -1
	}
	return q.pickup + time.Duration(q.nChunks)*q.chunkEvery
}

// listedProgress is what the plugin lists as a non-fake sender's progress:
// NIXL's chunk_id counts the scheduler's send() calls (one per prefill
// chunk: ceil(prompt / chunked_prefill_size)), the common sender's curr_idx
// (Mooncake) the KV pages handed over (page size 1: the prompt's tokens).
// The last chunk is handed over as the request enters the inflight queue,
// so the value stands still for its whole stay there, whatever the
// transfer worker does (SGLang v0.5.18: disaggregation/nixl/conn.py
// NixlKVSender.send, disaggregation/common/conn.py CommonKVSender.send,
// disaggregation/prefill.py).
func listedProgress(backend string, prompt int) int64 {
	if backend == BackendNIXL {
		return int64((prompt + chunkedPrefill - 1) / chunkedPrefill)
	}
	return int64(prompt)
}

func (g *group) markBlocked(q *request) {
	rc := &g.records[q.rec]
	switch kinds[rc.kind] {
	case KindHealthy, KindSlow, KindFailing:
		rc.kind = kindIndex(KindBlockedByWedge)
	}
}

// release takes q out of this stage's inflight queue (the caller drops it
// from the slice) and does what SGLang does on Success or Failed. The last
// stage to release it settles its record.
func (r *rank) release(s *Sim, q *request, now time.Time) {
	sd := q.senders[r.pp]
	if r.byRID[q.rid] == q {
		delete(r.byRID, q.rid)
	}
	r.inflightTk -= q.prompt
	// Every TP rank releases the request on the same pass (they act on
	// the same all-reduced poll). On the ranks whose own status is not
	// Failed, the Failed branch's failure_exception() clears the room
	// (request_status and transfer_infos), so their workers drop its
	// queued chunks too; the chunk a worker holds is not recalled
	// (SGLang v0.5.18: disaggregation/prefill.py
	// handle_inflight_transfer_failure, disaggregation/nixl/conn.py and
	// mooncake/conn.py failure_exception and transfer_worker).
	for _, each := range q.tp[r.pp] {
		r.releaseTransfer(each, now)
	}
	ok := sd.lastPoll == pollSuccess
	m := &r.m
	if !ok {
		m.transferFailed++
	} else {
		inflight := now.Sub(q.entered).Seconds()
		m.stage(stageTransfer, inflight)
		if !q.fake {
			// KV-transfer metrics for non-fake requests (SGLang v0.5.18:
			// disaggregation/prefill.py).
			latencyMS := max(inflight*1000, 0.05)
			mb := float64(q.prompt) * kvMBPerToken
			bootMS := q.bootstrapDone.Sub(q.arrived).Seconds() * 1000
			allocMS := q.entered.Sub(q.waitingSince).Seconds() * 1000
			speed := mb / 1000 / (latencyMS / 1000)
			if s.opts.Era == EraNewest {
				m.kv[kvSpeed].observe(kvBuckets[kvSpeed], speed)
				m.kv[kvLatency].observe(kvBuckets[kvLatency], latencyMS)
				m.kv[kvBootstrap].observe(kvBuckets[kvBootstrap], bootMS)
				m.kv[kvAlloc].observe(kvBuckets[kvAlloc], allocMS)
				m.kv[kvTotalMB].observe(kvBuckets[kvTotalMB], mb)
			} else {
				m.g[gKVSpeed], m.g[gKVLatency], m.g[gKVBootstrap], m.g[gKVAlloc], m.g[gKVTotalMB] =
					speed, latencyMS, bootMS, allocMS, mb
			}
		}
	}
	allOK, forced := true, false
	for _, x := range q.senders {
		allOK = allOK && x.lastPoll == pollSuccess
		forced = forced || x.forced
	}
	if r.pp == 0 && allOK {
		// Tokenizer side: observe_one_finished_request (SGLang v0.5.18:
		// observability/metrics_collector.py).
		m.requests++
		m.promptTokens += float64(q.prompt)
		m.genTokens++
		m.cachedTokens += float64(q.cached)
		e2e := now.Sub(q.arrived).Seconds()
		m.ttft.observe(ttftBuckets, e2e)
		m.e2e.observe(e2eBuckets, e2e)
	}
	q.holding--
	if q.holding > 0 {
		return
	}
	rc := &r.g.records[q.rec]
	rc.left = now.UnixNano()
	switch {
	case allOK:
		rc.outcome = outcomeIndex(OutcomeSuccess)
	case forced:
		rc.outcome = outcomeIndex(OutcomeFailedForced)
	default:
		rc.outcome = outcomeIndex(OutcomeFailed)
	}
	if q.fake {
		rc.decode = rc.left // prefill's own health checks never reach decode
	}
	// Decode frees the others itself (decode.go): nothing on a prefill
	// release tells it (neither the flip nor the Failed branch of SGLang
	// v0.5.18's disaggregation/prefill.py sends decode anything; the
	// KV_STATUS message of later upstream code comes only from the
	// transfer worker).
}

// releaseTransfer lets sd's room go on its TP rank: a chunk still in its
// worker's hands becomes an orphan, which settles when the chunk does
// (never, for a stuck handle).
func (r *rank) releaseTransfer(sd *sender, now time.Time) {
	q := sd.q
	sd.settleWork = sd.work
	if sd.outstanding > 0 && !q.fake {
		// The Failed branch frees the request, not the transfer: the worker
		// still holds the chunk (SGLang v0.5.18: disaggregation/nixl/conn.py,
		// managers/scheduler.py, disaggregation/common/conn.py).
		o := orphan{room: q.room, queue: q.queue}
		live := !sd.wedging && !sd.frozen
		r.g.records[q.rec].freedUnder(live)
		if live {
			rest := q.chunkEvery - (sd.work-q.pickup)%q.chunkEvery
			sd.settleWork = sd.work + rest
			sd.orphaned = true
			// At the link's present speed; the worker corrects it when the
			// chunk settles (settleOrphan).
			if d := realTime(rest, r.xf(sd.tp).links.speedOf(q)); d >= 0 {
				o.until = now.Add(d)
			}
		}
		x := r.xf(sd.tp)
		x.orphans = append(x.orphans, o)
		sd.orphanUntil = o.until
	}
	// The room's chunks stay on its queue: the worker finishes the one in
	// its hands and skips the others when it reaches them (run).
	sd.released = true
}

// freedUnder records that a stage or TP rank freed the request's prefill
// pages with a chunk of it still in a worker's hands; a read still moving
// outranks a hung handle.
func (rc *record) freedUnder(live bool) {
	if live {
		rc.prefillFree = 2
	} else if rc.prefillFree == 0 {
		rc.prefillFree = 1
	}
}

func (r *rank) pruneOrphans(now time.Time) {
	r.xfer.pruneOrphans(now)
	for _, x := range r.peers {
		x.pruneOrphans(now)
	}
}

func (x *xfer) pruneOrphans(now time.Time) {
	kept := x.orphans[:0]
	for _, o := range x.orphans {
		if o.until.IsZero() || o.until.After(now) {
			kept = append(kept, o)
		}
	}
	x.orphans = kept
}

// takeOrders applies the queued force-fail orders at the start of the
// inflight pass (the plugin's hook, clarification 3).
func (r *rank) takeOrders(s *Sim, now time.Time) {
	takeOrders(&r.pending, func(req pluginapi.ForceFailRequest) (int, pluginapi.ForceFailResponse) {
		return r.applyOrder(s, req, now)
	})
}

// withdrawOrders answers the orders a restarting scheduler never picked up.
func withdrawOrders(pending []*order) {
	for _, o := range pending {
		o.state = orderClaimed
		o.done <- orderResult{503, pluginapi.ForceFailResponse{
			Result: pluginapi.ResultSchedulerUnresponsive, RID: o.req.RID,
			Error: "the scheduler restarted before it picked the order up; the order was withdrawn"}}
	}
}

// takeOrders claims and answers every queued order with apply, and empties
// the queue. Callers hold the lock that guards pending.
func takeOrders(pending *[]*order, apply func(pluginapi.ForceFailRequest) (int, pluginapi.ForceFailResponse)) {
	for _, o := range *pending {
		o.state = orderClaimed
		st, resp := apply(o.req)
		o.done <- orderResult{st, resp}
	}
	clear(*pending)
	*pending = (*pending)[:0]
}

// levers are the plugin's levers on this SGLang (server.levers), in the
// order it pulls them, and why the list is short (server.lever_note).
func (s *Sim) levers() ([]string, string) {
	switch s.opts.LeverEra {
	case LeversNIXLMid2025:
		return []string{}, "mid-2025 NIXL: poll() reads neither _send_failed nor conclude_state, and update_status ignores Failed"
	case LeversEarly:
		return []string{}, "this SGLang's prefill Failed branch raises, which would crash the scheduler"
	}
	if s.opts.Backend == BackendNIXL {
		return []string{pluginapi.LeverAbort, pluginapi.LeverSendFailed}, ""
	}
	return []string{pluginapi.LeverAbort}, ""
}

// applyOrder decides an order against the live inflight queue and pulls
// the levers (round 2: health check, transfer succeeded, already failed,
// dry run, flip). Callers hold r.mu.
func (r *rank) applyOrder(s *Sim, req pluginapi.ForceFailRequest, now time.Time) (int, pluginapi.ForceFailResponse) {
	q, code, refusal, refused := lookupOrder(req, r.byRID)
	if refused {
		return code, refusal
	}
	sd := q.senders[r.pp]
	if st, _ := r.status(s, sd, now); st == pollSuccess && !r.sentElsewhere(s, q) {
		room := q.room
		if unwatched := r.unwatchedPeers(s); len(unwatched) > 0 {
			return 409, pluginapi.ForceFailResponse{Result: pluginapi.ResultGroupUnwatched, RID: q.rid, BootstrapRoom: &room,
				Ranks: unwatched, Error: "this rank sent its share of rid " + strconv.Quote(q.rid) +
					"; whether ranks " + strings.Join(unwatched, ", ") + " still send theirs is unknown; nothing was changed"}
		}
		return 409, pluginapi.ForceFailResponse{Result: pluginapi.ResultTransferSucceeded, RID: q.rid, BootstrapRoom: &room,
			Error: "the transfer of rid " + strconv.Quote(q.rid) + " succeeded; the scheduler releases it on its own"}
	}
	levers, _ := s.levers()
	room := q.room
	resp := pluginapi.ForceFailResponse{RID: q.rid, BootstrapRoom: &room, Lever: q.lever(s.opts.Backend),
		AppliedUnix: unixSeconds(now)}
	set := sd.leversSet(levers)
	switch {
	case sd.local == pollFailed || (len(levers) > 0 && len(set) == len(levers)):
		resp.Result = pluginapi.ResultAlreadyFailed
		resp.Levers = set
	case req.DryRun:
		resp.Result = pluginapi.ResultWouldFlip
		resp.Levers = levers
	default:
		resp.Result = pluginapi.ResultFlipped
		resp.Levers = levers
		r.pull(s, q, levers, now)
	}
	return 200, resp
}

func (sd *sender) leversSet(levers []string) []string {
	var set []string
	for _, l := range levers {
		if (l == pluginapi.LeverAbort && sd.aborted) || (l == pluginapi.LeverSendFailed && sd.sendFailed) {
			set = append(set, l)
		}
	}
	return set
}

// listed is a prefill or decode request as a force-fail order finds it.
type listed interface {
	ids() (rid string, room uint64)
	healthCheck() bool
}

// lookupOrder finds the request an order names, or gives the answer the
// plugin gives before any lever is looked at: the rid is not listed, the
// order names another room, or the request is a health check.
func lookupOrder[T listed](req pluginapi.ForceFailRequest, byRID map[string]T) (t T, st int, resp pluginapi.ForceFailResponse, refused bool) {
	t, ok := byRID[req.RID]
	if !ok {
		st, resp = notFound(req.RID)
		return t, st, resp, true
	}
	rid, room := t.ids()
	if req.BootstrapRoom != nil && *req.BootstrapRoom != room {
		st, resp = roomMismatch(req.RID, room)
		return t, st, resp, true
	}
	if t.healthCheck() {
		st, resp = healthCheckAnswer(rid, room)
		return t, st, resp, true
	}
	return t, 0, resp, false
}

func notFound(rid string) (int, pluginapi.ForceFailResponse) {
	return 404, pluginapi.ForceFailResponse{Result: pluginapi.ResultNotFound, RID: rid,
		Error: "no inflight request has rid " + strconv.Quote(rid)}
}

func roomMismatch(rid string, actual uint64) (int, pluginapi.ForceFailResponse) {
	return 409, pluginapi.ForceFailResponse{Result: pluginapi.ResultRoomMismatch, RID: rid, BootstrapRoom: &actual,
		Error: "rid " + strconv.Quote(rid) + " is inflight with bootstrap_room " +
			strconv.FormatUint(actual, 10) + ", not the one given"}
}

func healthCheckAnswer(rid string, room uint64) (int, pluginapi.ForceFailResponse) {
	return 409, pluginapi.ForceFailResponse{Result: pluginapi.ResultHealthCheck, RID: rid, BootstrapRoom: &room,
		Error: "rid " + strconv.Quote(rid) + " is an SGLang health check or warm-up request; it is never force-failed"}
}

// pull pulls the named levers on this stage's sender of q and records the
// ground truth. abort() is CommonKVSender.abort: record_failure,
// update_status(room, Failed), conclude_state = Failed (SGLang v0.5.18:
// managers/scheduler.py, disaggregation/common/conn.py).
func (r *rank) pull(s *Sim, q *request, levers []string, now time.Time) {
	sd := q.senders[r.pp]
	for _, l := range levers {
		switch l {
		case pluginapi.LeverAbort:
			sd.aborted = true
			// The common manager lets Failed overwrite a present room (Success
			// included) and ignores an absent one; mid-2025 NIXL merges with
			// max(), so Failed (0) never takes.
			if !q.fake && s.opts.LeverEra != LeversNIXLMid2025 {
				if _, present := r.status(s, sd, now); present {
					sd.statusFailed = true
				}
			}
		case pluginapi.LeverSendFailed:
			sd.sendFailed = true
		}
	}
	sd.forced = true
	rc := &r.g.records[q.rec]
	switch kinds[rc.kind] {
	case KindHealthy, KindSlow, KindHealthCheck, KindFailing:
		rc.progressing = true
	}
	if rc.forced == 0 {
		rc.forced = now.UnixNano()
	}
}

// listing builds the plugin's view of this rank. Callers hold r.mu.
func (r *rank) listing(s *Sim, now time.Time) pluginapi.Listing {
	levers, note := s.levers()
	nixl := s.opts.Backend == BackendNIXL
	// The newest NIXL and Mooncake managers both shard chunks over worker
	// queues and count each room's outstanding chunks (CommonKVManager's
	// _staging_outstanding); mid-2025 NIXL transfers synchronously and has
	// neither (SGLang v0.5.18: disaggregation/nixl/conn.py,
	// managers/scheduler.py, disaggregation/common/conn.py).
	queues := s.opts.LeverEra != LeversNIXLMid2025
	mid2025 := !queues
	srv := pluginapi.Server{PID: r.pid, DPRank: r.dp, PPRank: r.pp, TPRank: 0,
		DisaggregationMode: "prefill", TransferBackend: s.opts.Backend,
		SGLangVersion: eraVersion[s.opts.Era], Levers: levers, LeverNote: note, PPSize: s.opts.PPSize}
	if queues {
		srv.TransferQueues = intPtr(TransferQueues)
	}
	// transfer_in_flight below is read from that count exactly where it
	// exists, so the listing can say a false proves no chunk in flight.
	tracking := s.tracksTransfers()
	srv.TransferTracking = &tracking
	// Every rank of the attention-TP group sends; the leader reads its own
	// manager and every peer it watches (docs/plugin-api.md, round 5).
	// LeaderOnlyView lists what the watchdog read through round 4: the
	// leader as the only writer.
	peers := r.watchedPeers(s)
	switch {
	case s.opts.LeaderOnlyView:
		srv.TransferRanks, srv.TransferRanksWatched = intPtr(1), intPtr(1)
	case s.opts.AttnTP == 1:
		// A rank is watched only where its manager keeps the count.
		srv.TransferRanks, srv.TransferRanksWatched = intPtr(1), intPtr(0)
		if tracking {
			srv.TransferRanksWatched = intPtr(1)
		}
	case tracking:
		srv.TransferRanks, srv.TransferRanksWatched = intPtr(s.opts.AttnTP), intPtr(1+len(peers))
	default:
		// No manager keeps the count: nobody is watched.
		srv.TransferRanks, srv.TransferRanksWatched = intPtr(s.opts.AttnTP), intPtr(0)
	}
	round4 := s.roundFour()
	if !s.opts.PreRound4Plugin {
		srv.TransferProgress = &round4
	}
	l := pluginapi.Listing{
		APIVersion:        pluginapi.APIVersion,
		Server:            srv,
		NowUnix:           unixSeconds(now),
		Loop:              pluginapi.Loop{Iterations: r.iterations, LastIterationUnix: unixSeconds(r.lastIter)},
		Queues:            pluginapi.Queues{Bootstrap: len(r.g.bootstrapQ), Waiting: len(r.g.waitingQ), Inflight: len(r.inflight)},
		Inflight:          make([]pluginapi.Room, len(r.inflight)),
		OrphanedTransfers: []pluginapi.OrphanedTransfer{},
	}
	if round4 {
		// Played up to now first, so that the rooms' chunks_queued and
		// peer_chunks_queued below agree with the workers. round4 implies
		// worker queues, so a manager keeps the count on every peer listed.
		l.TransferWorkers = r.transferWorkersOf(&r.xfer, now)
		for i, x := range peers {
			workers := r.transferWorkersOf(x, now)
			// The plugin lists the rooms waiting on a peer's queues, as
			// the leader's own rooms name their queue.
			for qi := range workers {
				for _, sd := range x.workers[qi].fifo {
					if sd.chunksQueued() > 0 {
						workers[qi].QueuedRooms = append(workers[qi].QueuedRooms, sd.q.room)
					}
				}
			}
			l.PeerTransferWorkers = append(l.PeerTransferWorkers, pluginapi.PeerWorkers{Rank: peerName(1 + i), TransferWorkers: workers})
		}
	}
	if !s.opts.PreRound4Plugin {
		l.WedgeOrders = r.wedgeOrderStates(now)
	}
	if s.listsThreads() {
		// With worker queues round4 holds: they were played up to now.
		l.KVThreads = r.kvThreads(queues)
	}
	for i, q := range r.inflight {
		sd := q.senders[r.pp]
		progress := q.listed
		if q.workerProgress {
			progress = sd.progress
		}
		if q.fake {
			progress = -1
		}
		poll := sd.local
		if mid2025 && !q.fake && poll == pollSuccess {
			// Once sent, mid-2025 NIXL's poll() reads its transfer handles
			// through the NIXL agent, which only SGLang's pass calls: the
			// plugin lists WaitingForInput (observe.py), which shows where
			// another TP rank still holds the room.
			poll = pollWaitingForInput
		}
		rm := pluginapi.Room{
			RID: q.rid, BootstrapRoom: q.room, BootstrapAddr: q.addr, Poll: poll.String(),
			AgeSeconds: now.Sub(q.entered).Seconds(), PromptTokens: q.prompt, Progress: progress,
			SendFailed: nixl && !q.fake && sd.sendFailed, HealthCheck: q.healthCheck(),
		}
		// The fake sender has no KV manager queue.
		inFlight := tracking && !q.fake && sd.outstanding > 0
		for _, peer := range q.tp[r.pp][1 : 1+len(peers)] {
			inFlight = inFlight || (tracking && !q.fake && peer.outstanding > 0)
		}
		rm.TransferInFlight = &inFlight
		if queues && !q.fake {
			rm.TransferQueue = intPtr(q.queue)
		}
		if round4 && !q.fake {
			rm.ChunksQueued = intPtr(sd.chunksQueued())
			if len(peers) > 0 {
				n := 0
				for _, peer := range q.tp[r.pp][1 : 1+len(peers)] {
					n += peer.chunksQueued()
				}
				rm.PeerChunksQueued = &n
			}
		}
		l.Inflight[i] = rm
	}
	if tracking {
		at := map[uint64]int{} // room -> its entry
		for _, o := range r.orphans {
			if o.until.IsZero() || o.until.After(now) {
				at[o.room] = len(l.OrphanedTransfers)
				l.OrphanedTransfers = append(l.OrphanedTransfers, pluginapi.OrphanedTransfer{
					BootstrapRoom: o.room, TransferQueue: intPtr(o.queue), OutstandingChunks: 1})
			}
		}
		// A room another rank still sends for: summed over the ranks, with
		// no queue (the peers' queues are not the leader's).
		for _, x := range peers {
			for _, o := range x.orphans {
				if !o.until.IsZero() && !o.until.After(now) {
					continue
				}
				if i, ok := at[o.room]; ok {
					l.OrphanedTransfers[i].OutstandingChunks++
					continue
				}
				at[o.room] = len(l.OrphanedTransfers)
				l.OrphanedTransfers = append(l.OrphanedTransfers, pluginapi.OrphanedTransfer{
					BootstrapRoom: o.room, OutstandingChunks: 1})
			}
		}
	}
	return l
}

// sentElsewhere tells whether a non-leader rank the plugin watches still
// has a chunk of q outstanding or waiting in its worker queue (the plugin
// reads both from the rank's published file). The plugin then pulls the
// levers on a room its leader finished: the scheduler acts on the MIN poll
// over the group, so its Success branch waits for that rank (for ever on a
// hung one, or behind one), and SGLang's abort() overwrites the leader's
// Success.
func (r *rank) sentElsewhere(s *Sim, q *request) bool {
	for _, peer := range q.tp[r.pp][1 : 1+len(r.watchedPeers(s))] {
		if peer.outstanding > 0 || peer.chunksQueued() > 0 {
			return true
		}
	}
	return false
}

// watchedPeers are the non-leader ranks whose outstanding chunks the
// leader's plugin reads: all but the last Options.TPUnwatched, none in
// the leader-only view.
func (r *rank) watchedPeers(s *Sim) []*xfer {
	if s.opts.LeaderOnlyView || !s.tracksTransfers() {
		// Where no manager keeps the count a peer publishes nothing to
		// read (v0.5.11: neither Mooncake's nor mid-2025 NIXL's manager
		// has _staging_outstanding).
		return nil
	}
	return r.peers[:len(r.peers)-s.opts.TPUnwatched]
}

// unwatchedPeers names the non-leader ranks the leader's plugin cannot
// read ("tp<R>-cp0"): the last Options.TPUnwatched, or every one where no
// manager keeps the count. The leader-only view (a round 4 plugin) knows
// of no peer at all, and answers as if it were the only writer.
func (r *rank) unwatchedPeers(s *Sim) []string {
	if s.opts.AttnTP == 1 || s.opts.LeaderOnlyView {
		return nil
	}
	first := 1 + len(r.watchedPeers(s))
	var names []string
	for tp := first; tp < s.opts.AttnTP; tp++ {
		names = append(names, peerName(tp))
	}
	return names
}

// tracksTransfers tells whether the prefill KV managers count each room's
// outstanding chunks (_staging_outstanding), which the plugin reads on its
// own rank and the peers publish.
func (s *Sim) tracksTransfers() bool {
	return s.opts.LeverEra != LeversNIXLMid2025 && !s.opts.UntrackedTransfers
}

// peerName is the plugin's name of attention-TP rank tp (no context
// parallelism here).
func peerName(tp int) string { return "tp" + strconv.Itoa(tp) + "-cp0" }

func intPtr(v int) *int { return &v }

var eraVersion = map[string]string{
	EraName: "0.3.5", EraModelName: "0.4.0", EraEngineType: "0.4.9", EraV05: "0.5.9", EraNewest: "0.6.0",
}

// parity builds the parity scene on this (fresh) DP rank; see SetScenario.
func (g *group) parity(s *Sim, now time.Time) {
	add := func(spec RequestSpec, addr string, ago time.Duration) {
		entered := now.Add(-ago)
		q := g.newRequest(s, spec, entered, g.stages[0].idx)
		q.addr = addr
		q.waitingSince = entered
		q.entered = entered
		q.workerProgress, q.setTransferring = true, true
		for _, r := range g.stages {
			for _, sd := range q.tp[r.pp] {
				r.enqueue(s, sd, entered)
				sd.local = r.poll(s, sd, now)
			}
			sd := q.senders[r.pp]
			sd.lastPoll = sd.local
			for _, peer := range q.tp[r.pp][1:] {
				peer.lastPoll = peer.local
				sd.lastPoll = min(sd.lastPoll, peer.local)
			}
			r.admit(q)
		}
		rc := &g.records[q.rec]
		rc.entered = entered.UnixNano()
		rc.outcome = outcomeIndex(OutcomeInflight)
	}
	add(RequestSpec{RID: "pinned-0001", Room: 9223372036854775001, PromptTokens: 4096, DecodePort: 17002,
		Behavior: BehaviorPinResurrection, FreezeAt: 3, ChunkEvery: 100 * time.Millisecond, Transfer: time.Second},
		DefaultBootstrapAddr, 120*time.Second)
	add(RequestSpec{RID: "healthy-0002", Room: 18446744073709551557, PromptTokens: 1024, DecodePort: 17001,
		Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: 100 * time.Millisecond},
		"10.0.0.8:8998", 5*time.Second)
	// A health check has no bootstrap port, so its address is the bare host.
	add(RequestSpec{RID: "HEALTH_CHECK_1764403200.0", Behavior: BehaviorStuckHealthCheck},
		FakeBootstrapHost, 200*time.Second)
	add(RequestSpec{RID: ParityWarmupRID, Behavior: BehaviorStuckHealthCheck, Warmup: true},
		FakeBootstrapHost, 150*time.Second)
	for _, r := range g.stages {
		r.logStats(s, now, 0)
	}
}
