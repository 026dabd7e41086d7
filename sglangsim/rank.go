package sglangsim

import (
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// kvPoll mirrors SGLang's KVPoll (facts §3.3, §7.3).
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

const (
	maxBatchTokens   = 65536 // prompt tokens per simulated prefill batch
	chunkTokens      = 1024  // prompt tokens per KV chunk of a healthy transfer
	chunkedPrefill   = 8192  // prompts above this go through chunked prefill
	lognormalSigma   = 1.0   // healthy transfer time: p99.9 = exp(3.09) ~ 22x median
	maxTransferRatio = 100   // cap of a healthy transfer time, in medians
	kvMBPerToken     = 0.125 // Llama-3.1-8B bf16: 32 layers * 8 kv heads * 128 * 2 * 2 bytes
	maxTotalTokens   = 786432
	basePID          = 4242
)

// request is one SGLang Req with its sender, as this simulator models them.
type request struct {
	rid      string
	room     uint64
	addr     string
	prompt   int
	cached   int
	behavior Behavior
	fake     bool // fake sender (health checks)
	shard    int  // transfer-worker shard: room % TransferQueues
	rec      int  // index into rank.records

	arrived       time.Time
	bootstrapDone time.Time
	waitingSince  time.Time
	entered       time.Time

	// The transfer, measured in worker time ("work"), which stands still
	// while the room's shard is wedged by another room.
	pickup     time.Duration // WaitingForInput until the worker picks the room up
	chunkEvery time.Duration
	nChunks    int64 // -1: never finishes
	freezeAt   int64 // pins: chunks sent before the pin takes hold; -1 none
	failAt     time.Duration
	work       time.Duration
	lastUpdate time.Time

	frozen  bool // a pin took hold
	blocked bool // waiting behind a wedged shard at the last pass
	// unblockedAt is the progress when the room last left a wedge: until it
	// sends a chunk after that, it has made no progress anyone could see.
	unblockedAt int64
	wedging     bool // this room's stuck handle holds its shard's worker
	progress    int64
	lastPoll    kvPoll
	leverSet    bool // _send_failed (NIXL) or conclude_state = Failed (Mooncake, fake)
	forced      bool // the lever was set by a force-fail order
}

func (q *request) lever(backend string) string {
	if !q.fake && backend == BackendNIXL {
		return pluginapi.LeverSendFailed
	}
	return pluginapi.LeverConcludeState
}

// record is the compact ground truth of one request (see Record).
type record struct {
	rid         string
	room        uint64
	entered     int64 // unix nanoseconds; 0 = not yet
	left        int64
	forced      int64
	rank        int32
	kind        uint8 // index into kinds
	outcome     uint8 // index into outcomes
	progressing bool
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

// rank is one (dp, pp) prefill scheduler, led by attention-TP rank 0.
type rank struct {
	mu sync.Mutex

	idx, dp, pp int
	pid         int
	rng         *rand.Rand
	running     bool // a Start goroutine drives this rank
	paused      bool

	arrivalRate float64 // requests per second on this rank
	nextArrival time.Time
	hcEvery     time.Duration // this rank's share of the health checks
	nextHC      time.Time

	bootstrapQ []*request
	waitingQ   []*request
	inflight   []*request
	byRID      map[string]*request // the inflight queue by rid
	pending    []*order
	inflightTk int // prompt tokens held by the inflight queue

	iterations uint64 // inflight passes seen by the plugin hook
	lastIter   time.Time
	wedge      [TransferQueues]*request
	wedgeClear [TransferQueues]time.Time

	m       rankMetrics
	records []record
}

func unixSeconds(t time.Time) float64 {
	if t.IsZero() {
		return 0
	}
	return float64(t.UnixNano()) / 1e9
}

// reset puts the rank in the state of a freshly started scheduler (also used
// by Restart and SetScenario). Requests still inside are lost.
func (r *rank) reset(s *Sim, now time.Time, gen int, quiet bool) {
	nowNS := now.UnixNano()
	for _, qs := range [][]*request{r.bootstrapQ, r.waitingQ, r.inflight} {
		for _, q := range qs {
			rc := &r.records[q.rec]
			rc.left = nowNS
			rc.outcome = outcomeIndex(OutcomeRestarted)
		}
	}
	r.bootstrapQ, r.waitingQ, r.inflight = nil, nil, nil
	clear(r.byRID)
	for _, o := range r.pending {
		o.state = orderClaimed
		o.done <- orderResult{503, pluginapi.ForceFailResponse{
			Result: pluginapi.ResultSchedulerUnresponsive, RID: o.req.RID,
			Error: "the scheduler restarted before it picked the order up; the order was withdrawn"}}
	}
	r.pending = nil
	r.inflightTk = 0
	r.iterations = 0
	r.lastIter = time.Time{}
	r.wedge = [TransferQueues]*request{}
	r.wedgeClear = [TransferQueues]time.Time{}
	r.pid = basePID + r.idx + 1000*gen
	r.m = rankMetrics{}

	n := float64(s.opts.DPSize * s.opts.PPSize)
	r.arrivalRate = 0
	if !quiet {
		r.arrivalRate = s.opts.ArrivalRate / n
	}
	r.nextArrival = time.Time{}
	if r.arrivalRate > 0 {
		r.nextArrival = now.Add(r.expInterval())
	}
	r.hcEvery = 0
	r.nextHC = time.Time{}
	if s.opts.HealthCheckEvery > 0 && !quiet {
		r.hcEvery = s.opts.HealthCheckEvery * time.Duration(n)
		r.nextHC = now.Add(s.opts.HealthCheckEvery * time.Duration(r.idx+1))
	}
	// The warm-up request at start-up (fake host) forms a prefill batch, so
	// every gauge is written once (facts §1.6: gauges change only on a log).
	r.logStats(s, now, 0)
}

func (r *rank) expInterval() time.Duration {
	return time.Duration(r.rng.ExpFloat64() / r.arrivalRate * float64(time.Second))
}

func (r *rank) randomRID() string {
	var b [32]byte
	const hex = "0123456789abcdef"
	a, c := r.rng.Uint64(), r.rng.Uint64()
	for i := 0; i < 16; i++ {
		b[i] = hex[a>>(60-4*i)&0xf]
		b[16+i] = hex[c>>(60-4*i)&0xf]
	}
	return string(b[:])
}

func (r *rank) randomRoom() uint64 {
	for {
		if v := r.rng.Uint64(); v != 0 {
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

func (r *rank) drawPrompt() int {
	p := int(2048 * math.Exp(0.7*r.rng.NormFloat64()))
	return min(max(p, 64), 32768)
}

func ceilDiv(a, b time.Duration) int64 {
	if b <= 0 {
		return 1
	}
	return int64((a + b - 1) / b)
}

// newRequest builds a request arriving at `at` and its record.
func (r *rank) newRequest(s *Sim, spec RequestSpec, at time.Time) *request {
	q := &request{behavior: spec.Behavior, arrived: at, freezeAt: -1, nChunks: -1, lastPoll: pollBootstrapping}
	q.bootstrapDone = at.Add(max(spec.Bootstrap, 0))
	kind := KindHealthy
	switch spec.Behavior {
	case BehaviorHealthCheck, BehaviorStuckHealthCheck:
		q.fake = true
		kind = KindHealthCheck
		q.rid = spec.RID
		if q.rid == "" {
			q.rid = "HEALTH_CHECK_" + pyRepr(unixSeconds(at))
		}
		// SGLang sends health checks with no bootstrap port: the address is the bare host.
		q.addr = FakeBootstrapHost
		q.prompt = 1
	case BehaviorSlow:
		kind = KindSlow
	case BehaviorTransferFail:
		kind = KindFailing
	case BehaviorPinResurrection:
		kind = KindPinResurrection
	case BehaviorPinAbortBeforeRegister:
		kind = KindPinAbortBeforeRegister
	case BehaviorPinStuckHandle:
		kind = KindPinStuckHandle
	}
	if !q.fake {
		q.rid = spec.RID
		if q.rid == "" {
			q.rid = r.randomRID()
		}
		q.room = spec.Room
		if q.room == 0 {
			q.room = r.randomRoom()
		}
		q.addr = s.opts.BootstrapAddr
		q.prompt = r.drawPrompt()
		q.cached = int(float64(q.prompt) * 0.3 * r.rng.Float64())
	}
	if spec.PromptTokens > 0 {
		q.prompt = spec.PromptTokens
		q.cached = min(q.cached, q.prompt-1)
	}
	q.shard = int(q.room % TransferQueues)
	r.plan(s, q, spec)
	q.rec = len(r.records)
	r.records = append(r.records, record{rid: q.rid, room: q.room, rank: int32(r.idx),
		kind: kindIndex(kind), outcome: outcomeIndex(OutcomeQueued)})
	// Stages before the scheduler (tokenizer side), observed on arrival.
	ms := func(lo, hi float64) float64 { return (lo + (hi-lo)*r.rng.Float64()) / 1000 }
	r.m.stage(stageTokenize, ms(0.2, 5))
	r.m.stage(stageDispatch, ms(0.05, 0.5))
	r.m.stage(stageRequestProcess, ms(0.5, 3))
	return q
}

// plan fixes how the request's transfer will go.
func (r *rank) plan(s *Sim, q *request, spec RequestSpec) {
	switch q.behavior {
	case BehaviorHealthCheck, BehaviorStuckHealthCheck, BehaviorPinAbortBeforeRegister:
		return
	}
	d := spec.Transfer
	slow := q.behavior == BehaviorSlow
	if d == 0 {
		if slow {
			d = 30*time.Second + time.Duration(r.rng.Float64()*float64(120*time.Second))
		} else {
			d = drawTransfer(r.rng, s.opts.TransferMedian)
		}
	}
	endless := d < 0
	ce := spec.ChunkEvery
	if slow || endless {
		q.pickup = 0
		if ce <= 0 {
			ce = time.Duration(float64(s.opts.SlowChunkEvery) * (0.5 + 0.5*r.rng.Float64()))
		}
	} else {
		q.pickup = d / 50
		if ce <= 0 {
			n := max(int64((q.prompt+chunkTokens-1)/chunkTokens), ceilDiv(d-q.pickup, s.opts.SlowChunkEvery), 1)
			ce = (d - q.pickup) / time.Duration(n)
		}
	}
	q.chunkEvery = max(ce, time.Nanosecond)
	if !endless {
		q.nChunks = max(ceilDiv(d-q.pickup, q.chunkEvery), 1)
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

// pass is one iteration of the PD prefill event loop
// (event_loop_normal_disagg_prefill, facts §3.1, §8).
func (r *rank) pass(s *Sim, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.paused {
		return
	}
	r.m.loopIterations++
	r.arrive(s, now)
	r.popBootstrapped(now)
	batched := r.prefillBatch(s, now)
	if !batched && len(r.inflight) == 0 && now.Sub(r.m.lastLog) > s.opts.IdleRefresh {
		// self_check_during_idle / on_idle: only with an empty inflight queue.
		r.logStats(s, now, 0)
	}
	if s.opts.HookRunsWhenEmpty || len(r.inflight) > 0 {
		r.iterations++
		r.lastIter = now
		r.takeOrders(s, now)
		r.pollInflight(s, now)
	}
}

func (r *rank) arrive(s *Sim, now time.Time) {
	if r.arrivalRate > 0 {
		for !r.nextArrival.After(now) {
			at := r.nextArrival
			b := BehaviorHealthy
			if s.opts.SlowFraction > 0 && r.rng.Float64() < s.opts.SlowFraction {
				b = BehaviorSlow
			}
			boot := 2*time.Millisecond + time.Duration(r.rng.Float64()*float64(28*time.Millisecond))
			r.bootstrapQ = append(r.bootstrapQ, r.newRequest(s, RequestSpec{Behavior: b, Bootstrap: boot}, at))
			r.nextArrival = at.Add(r.expInterval())
		}
	}
	if r.hcEvery > 0 {
		for !r.nextHC.After(now) {
			at := r.nextHC
			r.bootstrapQ = append(r.bootstrapQ, r.newRequest(s, RequestSpec{Behavior: BehaviorHealthCheck}, at))
			r.nextHC = at.Add(r.hcEvery)
		}
	}
}

// popBootstrapped moves bootstrapped requests to the waiting queue
// (PrefillBootstrapQueue.pop_bootstrapped).
func (r *rank) popBootstrapped(now time.Time) {
	kept := r.bootstrapQ[:0]
	for _, q := range r.bootstrapQ {
		if q.bootstrapDone.After(now) {
			kept = append(kept, q)
			continue
		}
		q.waitingSince = now
		q.lastPoll = pollWaitingForInput
		r.m.stage(stageBootstrap, now.Sub(q.arrived).Seconds())
		r.m.stage(stagePrepare, 0.0002+0.0001*float64(q.prompt%7))
		r.waitingQ = append(r.waitingQ, q)
	}
	clear(r.bootstrapQ[len(kept):])
	r.bootstrapQ = kept
}

// prefillBatch forms and runs one prefill batch, and moves its requests into
// the inflight queue (process_batch_result_disagg_prefill). It reports
// whether a batch ran.
func (r *rank) prefillBatch(s *Sim, now time.Time) bool {
	if len(r.waitingQ) == 0 {
		return false
	}
	n, tokens := 0, 0
	for n < len(r.waitingQ) && (n == 0 || tokens+r.waitingQ[n].prompt <= maxBatchTokens) {
		tokens += r.waitingQ[n].prompt
		n++
	}
	batch := r.waitingQ[:n]
	newest := s.opts.Era == EraNewest
	if !newest {
		// v0.5 and older: log_prefill_stats when the batch is formed, before
		// its requests enter the inflight queue (facts §1.6).
		all := r.waitingQ
		r.waitingQ = all[n:]
		r.logStats(s, now, 0)
		r.waitingQ = all
	}
	for _, q := range batch {
		r.m.stage(stageWaiting, now.Sub(q.waitingSince).Seconds())
		fwd := 0.004 + float64(q.prompt-q.cached)*15e-6
		r.m.stage(stageForward, fwd)
		if q.prompt > chunkedPrefill {
			r.m.stage(stageChunkedPrefill, fwd/2)
		}
		r.m.realtimeCompute += float64(q.prompt - q.cached)
		r.m.realtimeCache += float64(q.cached)
		q.entered = now
		q.lastUpdate = now
		r.inflight = append(r.inflight, q)
		r.byRID[q.rid] = q
		r.inflightTk += q.prompt
		rc := &r.records[q.rec]
		rc.entered = now.UnixNano()
		rc.outcome = outcomeIndex(OutcomeInflight)
	}
	rest := copy(r.waitingQ, r.waitingQ[n:])
	clear(r.waitingQ[rest:])
	r.waitingQ = r.waitingQ[:rest]
	if newest {
		// Newest: report_prefill_stats after the batch result put the
		// requests into the inflight queue (facts §3.1); num_running_reqs
		// counts the batch (PR #31495).
		r.logStats(s, now, n)
	}
	return true
}

// logStats is log_prefill_stats / the idle refresh: the only writer of the
// scheduler gauges.
func (r *rank) logStats(s *Sim, now time.Time, running int) {
	m := &r.m
	m.lastLog = now
	g := &m.g
	g[gRunning] = float64(running)
	g[gQueue] = float64(len(r.waitingQ))
	g[gInflight] = float64(len(r.inflight))
	g[gBootstrapQ] = float64(len(r.bootstrapQ))
	used := float64(r.inflightTk)
	g[gUsedTokens] = used
	g[gTokenUsage] = math.Round(used/maxTotalTokens*100) / 100
	g[gMaxTotalTokens] = maxTotalTokens
	g[gUtilization] = -1 // calculate_utilization() on prefill servers (facts §1.3)
	g[gStartup] = 41.7
	g[gLoadWeights] = 12.3
	g[gContextLen] = 131072
	g[gPageSize] = 1
	g[gKVUsed] = used
	g[gKVAvailable] = maxTotalTokens - used
	g[gFullTokenUsage] = g[gTokenUsage]
	if c, p := m.realtimeCache, m.realtimeCompute; c+p > 0 {
		g[gCacheHit] = math.Round(c/(c+p)*1000) / 1000
	}
}

// takeOrders applies the queued force-fail orders at the start of the
// inflight pass (the plugin's hook, clarification 3).
func (r *rank) takeOrders(s *Sim, now time.Time) {
	for _, o := range r.pending {
		o.state = orderClaimed
		st, resp := r.applyOrder(s, o.req, now)
		o.done <- orderResult{st, resp}
	}
	clear(r.pending)
	r.pending = r.pending[:0]
}

// applyOrder decides an order against the live inflight queue and sets the
// lever. Callers hold r.mu.
func (r *rank) applyOrder(s *Sim, req pluginapi.ForceFailRequest, now time.Time) (int, pluginapi.ForceFailResponse) {
	q, ok := r.byRID[req.RID]
	if !ok {
		return notFound(req.RID)
	}
	if req.BootstrapRoom != nil && *req.BootstrapRoom != q.room {
		return roomMismatch(req.RID, q.room)
	}
	room := q.room
	resp := pluginapi.ForceFailResponse{RID: q.rid, BootstrapRoom: &room, Lever: q.lever(s.opts.Backend),
		AppliedUnix: unixSeconds(now)}
	switch {
	case q.leverSet || q.lastPoll == pollFailed:
		resp.Result = pluginapi.ResultAlreadyFailed
	case req.DryRun:
		resp.Result = pluginapi.ResultWouldFlip
	default:
		resp.Result = pluginapi.ResultFlipped
		r.setLever(q, now)
	}
	return 200, resp
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

// setLever pulls the backend's lever on q and records the ground truth.
func (r *rank) setLever(q *request, now time.Time) {
	rc := &r.records[q.rec]
	if !q.fake {
		if w := r.wedge[q.shard]; w != nil && w != q && q.behavior != BehaviorPinAbortBeforeRegister && (q.blocked || q.work < q.pickup) {
			q.blocked = true
			r.markBlocked(q)
		}
	}
	switch kinds[rc.kind] {
	case KindHealthy, KindSlow, KindHealthCheck, KindFailing:
		rc.progressing = true
	case KindBlockedByWedge:
		// A room behind a wedge made no progress; once the wedge cleared it
		// is progressing again from its first new chunk on.
		rc.progressing = !q.blocked && q.progress > q.unblockedAt
	}
	q.leverSet = true
	q.forced = true
	rc.forced = now.UnixNano()
	if q.wedging {
		// Simplification: the worker abandons the stuck handle once the
		// room's lever is set, so the shard recovers.
		r.clearWedge(q, now)
	}
}

func (r *rank) markBlocked(q *request) {
	rc := &r.records[q.rec]
	switch kinds[rc.kind] {
	case KindHealthy, KindSlow, KindFailing:
		rc.kind = kindIndex(KindBlockedByWedge)
	}
}

func (r *rank) clearWedge(q *request, now time.Time) {
	q.wedging = false
	if r.wedge[q.shard] == q {
		r.wedge[q.shard] = nil
		r.wedgeClear[q.shard] = now
	}
}

// pollInflight is process_disagg_prefill_inflight_queue (facts §3.2): poll
// every sender, keep WaitingForInput/Transferring, release Success and Failed.
func (r *rank) pollInflight(s *Sim, now time.Time) {
	kept := r.inflight[:0]
	for _, q := range r.inflight {
		p := r.poll(q, now)
		q.lastPoll = p
		switch p {
		case pollSuccess:
			r.release(s, q, now, true)
		case pollFailed:
			r.release(s, q, now, false)
		default:
			kept = append(kept, q)
		}
	}
	clear(r.inflight[len(kept):])
	r.inflight = kept
}

// poll is the sender's poll() on this pass.
func (r *rank) poll(q *request, now time.Time) kvPoll {
	if q.leverSet {
		// NIXL checks _send_failed first; Mooncake and fake senders return
		// conclude_state once it is set (facts §3.5).
		return pollFailed
	}
	if q.fake {
		if q.behavior == BehaviorStuckHealthCheck {
			return pollWaitingForInput
		}
		return pollSuccess // send() ran at the forward
	}
	if q.behavior == BehaviorPinAbortBeforeRegister {
		// check_status of a room that was never registered (facts §3.4).
		return pollWaitingForInput
	}
	r.advance(q, now)
	if q.frozen {
		return pollTransferring
	}
	if q.work < q.pickup {
		return pollWaitingForInput
	}
	if q.behavior == BehaviorTransferFail && q.work >= q.failAt {
		return pollFailed
	}
	p := int64((q.work - q.pickup) / q.chunkEvery)
	if q.freezeAt >= 0 && p >= q.freezeAt {
		p = q.freezeAt
		q.frozen = true
		if q.behavior == BehaviorPinStuckHandle && r.wedge[q.shard] == nil {
			r.wedge[q.shard] = q
			q.wedging = true
		}
	} else if q.nChunks >= 0 && p >= q.nChunks {
		q.progress = q.nChunks
		return pollSuccess
	}
	q.progress = max(q.progress, p)
	return pollTransferring
}

// advance credits worker time to q unless its shard is wedged by another room.
func (r *rank) advance(q *request, now time.Time) {
	from := q.lastUpdate
	q.lastUpdate = now
	if q.frozen {
		return
	}
	// The shard's worker is serial: a room it had already picked up was
	// ahead of the stuck handle and finishes; the rooms it had not picked up
	// wait behind the handle.
	if w := r.wedge[q.shard]; w != nil && w != q && (q.blocked || q.work < q.pickup) {
		if !q.blocked {
			q.blocked = true
			r.markBlocked(q)
		}
		return
	}
	if q.blocked {
		if c := r.wedgeClear[q.shard]; c.After(from) {
			from = c
		}
		q.blocked = false
		q.unblockedAt = q.progress
	}
	if d := now.Sub(from); d > 0 {
		q.work += d
	}
}

// release takes q out of the inflight queue (the caller drops it from the
// slice) and does what SGLang does on Success or Failed.
func (r *rank) release(s *Sim, q *request, now time.Time, ok bool) {
	if r.byRID[q.rid] == q {
		delete(r.byRID, q.rid)
	}
	r.inflightTk -= q.prompt
	if q.wedging {
		r.clearWedge(q, now)
	}
	rc := &r.records[q.rec]
	rc.left = now.UnixNano()
	if !ok {
		rc.outcome = outcomeIndex(OutcomeFailed)
		if q.forced {
			rc.outcome = outcomeIndex(OutcomeFailedForced)
		}
		r.m.transferFailed++
		return
	}
	rc.outcome = outcomeIndex(OutcomeSuccess)
	m := &r.m
	inflight := now.Sub(q.entered).Seconds()
	m.stage(stageTransfer, inflight)
	if !q.fake {
		// KV-transfer metrics for non-fake requests (facts §3.2).
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
	// Tokenizer side: observe_one_finished_request (facts §1.5).
	m.requests++
	m.promptTokens += float64(q.prompt)
	m.genTokens++
	m.cachedTokens += float64(q.cached)
	e2e := now.Sub(q.arrived).Seconds()
	m.ttft.observe(ttftBuckets, e2e)
	m.e2e.observe(e2eBuckets, e2e)
}

// listing builds the plugin's view of this rank. Callers hold r.mu.
func (r *rank) listing(s *Sim, now time.Time) pluginapi.Listing {
	l := pluginapi.Listing{
		APIVersion: pluginapi.APIVersion,
		Server: pluginapi.Server{PID: r.pid, DPRank: r.dp, PPRank: r.pp, TPRank: 0,
			DisaggregationMode: "prefill", TransferBackend: s.opts.Backend,
			SGLangVersion: eraVersion[s.opts.Era]},
		NowUnix:  unixSeconds(now),
		Loop:     pluginapi.Loop{Iterations: r.iterations, LastIterationUnix: unixSeconds(r.lastIter)},
		Queues:   pluginapi.Queues{Bootstrap: len(r.bootstrapQ), Waiting: len(r.waitingQ), Inflight: len(r.inflight)},
		Inflight: make([]pluginapi.Room, len(r.inflight)),
	}
	nixl := s.opts.Backend == BackendNIXL
	for i, q := range r.inflight {
		progress := q.progress
		if q.fake {
			progress = -1
		}
		l.Inflight[i] = pluginapi.Room{
			RID: q.rid, BootstrapRoom: q.room, BootstrapAddr: q.addr, Poll: q.lastPoll.String(),
			AgeSeconds: now.Sub(q.entered).Seconds(), PromptTokens: q.prompt, Progress: progress,
			SendFailed: nixl && !q.fake && q.leverSet, HealthCheck: q.fake,
		}
	}
	return l
}

var eraVersion = map[string]string{
	EraName: "0.3.5", EraModelName: "0.4.0", EraEngineType: "0.4.9", EraV05: "0.5.9", EraNewest: "0.6.0",
}

// parity builds the parity scene on this (fresh) rank; see SetScenario.
func (r *rank) parity(s *Sim, now time.Time) {
	add := func(spec RequestSpec, addr string, ago time.Duration) {
		entered := now.Add(-ago)
		q := r.newRequest(s, spec, entered)
		q.addr = addr
		q.waitingSince = entered
		q.entered = entered
		q.lastUpdate = entered
		q.lastPoll = r.poll(q, now)
		r.inflight = append(r.inflight, q)
		r.byRID[q.rid] = q
		r.inflightTk += q.prompt
		rc := &r.records[q.rec]
		rc.entered = entered.UnixNano()
		rc.outcome = outcomeIndex(OutcomeInflight)
	}
	add(RequestSpec{RID: "pinned-0001", Room: 9223372036854775001, PromptTokens: 4096,
		Behavior: BehaviorPinResurrection, FreezeAt: 3, ChunkEvery: 100 * time.Millisecond, Transfer: time.Second},
		DefaultBootstrapAddr, 120*time.Second)
	add(RequestSpec{RID: "healthy-0002", Room: 18446744073709551557, PromptTokens: 1024,
		Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: 100 * time.Millisecond},
		"10.0.0.8:8998", 5*time.Second)
	// A health check has no bootstrap port, so its address is the bare host.
	add(RequestSpec{RID: "HEALTH_CHECK_1764403200.0", Behavior: BehaviorStuckHealthCheck},
		FakeBootstrapHost, 200*time.Second)
	r.logStats(s, now, 0)
}
