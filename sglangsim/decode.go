package sglangsim

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// DecodeEnd is how a request left the decode server.
type DecodeEnd string

// Ends of Record.DecodeEnd (and causes of Record.UnsafeFree).
const (
	DecodeSuccess = DecodeEnd("success")
	// DecodeTimeout: decode's own SGLANG_DISAGGREGATION_WAITING_TIMEOUT.
	DecodeTimeout = DecodeEnd("timeout")
	// DecodeForceFail: the plugin's decode lever (kv_receiver.abort()).
	DecodeForceFail = DecodeEnd("force_fail")
	// DecodeHeartbeat: decode lost its prefill peer (restart or crash).
	DecodeHeartbeat = DecodeEnd("heartbeat")
	// DecodeRestarted: the decode server itself restarted.
	DecodeRestarted = DecodeEnd("restarted")
)

var decodeEnds = [...]DecodeEnd{"", DecodeSuccess, DecodeTimeout, DecodeForceFail, DecodeHeartbeat, DecodeRestarted}

func decodeEndIndex(e DecodeEnd) uint8 {
	for i, v := range decodeEnds {
		if v == e {
			return uint8(i)
		}
	}
	return 0
}

const (
	// DeferredReleaseTimeout is how long decode holds the pages of a failed
	// request whose abort it notified to prefill, waiting for ABORT_ACK
	// (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE).
	DeferredReleaseTimeout = 30 * time.Second
	decodePID              = 6100
)

// Corruption is a late prefill write that landed in decode pages which
// decode had freed under a live transfer and handed to another request.
type Corruption struct {
	Writer     string // rid whose pages were freed while prefill still wrote
	Room       uint64 // the writer's room
	Victim     string // rid that owned the pages when the write landed
	DecodeRank int
	Cause      DecodeEnd // what freed the writer's pages
	FreedAt    time.Time
	LandedAt   time.Time
}

// dreq is one DecodeRequest of a decode scheduler: the receiver side of a
// prefill request (q), or decode's own health check (q nil).
type dreq struct {
	q        *request
	g        *group
	gen      int // the prefill generation q lives in
	rid      string
	room     uint64
	addr     string
	fake     bool
	stuck    bool // a fake receiver that never reads Success
	bootDone time.Time

	inTransfer bool
	admitted   time.Time
	initTime   time.Time
	slot       int // KV pages (one slot per request); -1 none
	allocAt    time.Time

	poll     kvPoll
	progress int64
	expected int64 // -1 unknown
	started  bool

	waitingMemory bool // handshake done, waiting in prealloc for a free page slot

	aborted       bool // receiver.abort(): conclude_state Failed latched
	abortNotified bool // ABORT sent to the prefill bootstrap targets
	deferredAbort bool // register_deferred_abort_room
	cause         DecodeEnd
	holdUntil     time.Time // deferred release deadline
	freeAt        time.Time // decoding until then after Success
}

func (d *dreq) healthCheck() bool {
	return d.fake || d.room == 0 || d.addr == FakeBootstrapHost || strings.HasPrefix(d.rid, HealthCheckPrefix)
}

func (d *dreq) ids() (string, uint64) { return d.rid, d.room }

// taint is a freed page slot that a prefill write may still land in.
type taint struct {
	slot    int
	writer  *dreq
	cause   DecodeEnd
	freedAt time.Time
}

// drank is one decode scheduler process (one decode DP rank, attention-TP
// leader, PP 1).
type drank struct {
	mu      sync.Mutex
	idx     int
	pid     int
	running bool
	paused  bool

	inboxMu sync.Mutex
	inbox   []*dreq

	prealloc, transfer []*dreq
	byRID              map[string]*dreq
	held               []*dreq // failed, pages held for ABORT_ACK
	decoding           []*dreq // succeeded, decoding until freeAt
	pending            []*order
	iterations         uint64
	lastIter           time.Time
	nextHC             time.Time
	warmups            uint64
	bootAt             time.Time // when this process started serving

	free     []int // freed slots, reused last-freed first
	nextSlot int
	owner    map[int]*dreq
	taints   []taint

	m rankMetrics
}

// pview is what decode can learn of the prefill side of a request.
type pview struct {
	received, expected int64
	posted             bool // a chunk was posted or written
	done               bool // every chunk of every stage delivered
	pending            bool // a posted chunk can still land
	wedged             bool // it waits on a handle that never completes by itself
	deadAt             time.Time
}

// writePending tells whether a chunk of this stage's transfer is posted
// and not settled.
func (sd *sender) writePending(now time.Time) bool {
	if sd.outstanding == 0 {
		return false
	}
	if !sd.released {
		return true
	}
	return sd.orphanUntil.IsZero() || sd.orphanUntil.After(now)
}

func (s *Sim) prefillView(d *dreq, now time.Time) pview {
	v := pview{expected: -1}
	if d.q == nil {
		return v
	}
	v.deadAt = s.deathOf(d.gen)
	alive := v.deadAt.IsZero()
	d.g.mu.Lock()
	defer d.g.mu.Unlock()
	q := d.q
	// NIXL's receiver learns how many chunks a stage sends from that
	// stage's last chunk, and sums them once every stage's has arrived
	// (SGLang v0.5.18: disaggregation/nixl/conn.py, _track_kv_arrival and
	// expected_kvs_per_pp): unknown until then.
	lastArrived := q.nChunks >= 0
	v.done = true
	// Decode's plugin lists its leader's receiver, which the prefill
	// leaders feed (received, posted); the request is done, by decode's own
	// MIN all-reduce, only once every prefill TP rank's share arrived, and
	// a write of any rank can land in the pages.
	for _, row := range q.tp {
		for _, sd := range row {
			if sd.tp == 0 {
				v.received += sd.progress
				v.posted = v.posted || sd.outstanding > 0 || sd.progress > 0
				lastArrived = lastArrived && sd.progress >= q.nChunks
			}
			v.done = v.done && q.nChunks >= 0 && sd.progress >= q.nChunks
			if alive && sd.writePending(now) {
				v.pending = true
				v.wedged = v.wedged || sd.frozen
			}
		}
	}
	if lastArrived {
		v.expected = q.nChunks * int64(len(q.senders))
	}
	return v
}

// deathOf is when the prefill processes of generation gen ended; zero
// while they live. Lock-free: decode asks for every request on every pass.
func (s *Sim) deathOf(gen int) time.Time {
	if p := s.restartTimes.Load(); p != nil && gen < len(*p) {
		return (*p)[gen]
	}
	return time.Time{}
}

func (s *Sim) generation() int {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return s.gen
}

func (s *Sim) decodeDown(now time.Time) bool {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return now.Before(s.decodeDownUntil)
}

// DecodeBooting tells whether the decode server is down after a restart.
func (s *Sim) DecodeBooting() bool { return s.decodeDown(s.clock.Now()) }

// deferredOn is SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE in this
// process; nil where the version has no such thing: every release up to
// v0.5.18 (no DeferredRelease) and the older lever eras.
func (s *Sim) deferredOn() *bool {
	if s.opts.LeverEra != LeversNewest || !s.opts.DeferredRelease {
		return nil
	}
	on := true
	return &on
}

// decodeLevers are the plugin's decode levers and why the list is empty.
func (s *Sim) decodeLevers() ([]string, string) {
	// Mid-2025 NIXL's receiver latches conclude_state = Failed in abort()
	// and its poll() returns it first (v0.4.10 to v0.5.11:
	// disaggregation/common/conn.py CommonKVReceiver.abort, nixl/conn.py
	// NixlKVReceiver.poll): unlike its sender, it has the lever.
	switch s.opts.LeverEra {
	case LeversEarly:
		return []string{}, "this early decode has no receiver abort that its queues release through"
	}
	return []string{pluginapi.LeverAbort}, ""
}

// bootstrapHost is the host of a bootstrap_addr ("host:port"), or the
// whole of it where it has no port.
func (s *Sim) bootstrapHost(addr string) string {
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host
	}
	return addr
}

// decodeRankOf binds a decode endpoint to a decode DP rank.
func (s *Sim) decodeRankOf(port int) int {
	for i, p := range s.opts.DecodePorts {
		if p == port {
			return i % len(s.dranks)
		}
	}
	return port % len(s.dranks)
}

// toDecode hands a new prefill request to its decode rank (the router
// sends it to both servers at once). Callers hold q's group lock.
func (s *Sim) toDecode(g *group, q *request) {
	if q.fake {
		return
	}
	dr := s.dranks[s.decodeRankOf(q.decodePort)]
	d := &dreq{q: q, g: g, gen: s.generation(), rid: q.rid, room: q.room, addr: q.addr, bootDone: q.bootstrapDone,
		admitted: q.arrived, slot: -1, expected: -1, poll: pollBootstrapping}
	rc := &g.records[q.rec]
	rc.drank = int32(dr.idx)
	dr.inboxMu.Lock()
	dr.inbox = append(dr.inbox, d)
	dr.inboxMu.Unlock()
}

// SubmitDecodeHealthCheck sends decode's own health check (rid
// HEALTH_CHECK_<time>), or with warmup a warm-up request (a plain rid), into
// decode rank `rank`: the fake receiver, room 0, host 2.2.2.2, through both
// queues. A stuck one never reads Success. It returns the rid.
func (s *Sim) SubmitDecodeHealthCheck(rank int, warmup, stuck bool) string {
	dr := s.drank(rank)
	now := s.clock.Now()
	dr.mu.Lock()
	d := dr.newHealthCheck(s, now, warmup, stuck)
	dr.mu.Unlock()
	dr.inboxMu.Lock()
	dr.inbox = append(dr.inbox, d)
	dr.inboxMu.Unlock()
	return d.rid
}

func (dr *drank) newHealthCheck(s *Sim, now time.Time, warmup, stuck bool) *dreq {
	rid := HealthCheckPrefix + "_" + pyRepr(unixSeconds(now))
	if warmup {
		// A warm-up request has a plain rid, no HEALTH_CHECK prefix.
		dr.warmups++
		rid = fmt.Sprintf("%016x%016x", uint64(now.UnixNano()), dr.warmups)
	}
	return &dreq{rid: rid, addr: FakeBootstrapHost, fake: true, stuck: stuck, admitted: now, slot: -1, expected: -1,
		poll: pollWaitingForInput}
}

func (s *Sim) drank(i int) *drank {
	if i < 0 || i >= len(s.dranks) {
		panic("sglangsim: decode rank " + strconv.Itoa(i) + " out of range")
	}
	return s.dranks[i]
}

// DecodeRanks is the number of decode ranks (Options.DecodeDPSize).
func (s *Sim) DecodeRanks() int { return len(s.dranks) }

// PauseDecodeLoop stops (or resumes) the scheduler loop of one decode rank.
func (s *Sim) PauseDecodeLoop(rank int, paused bool) {
	dr := s.drank(rank)
	dr.mu.Lock()
	dr.paused = paused
	dr.mu.Unlock()
}

// Corruptions returns every late prefill write that landed in pages decode
// had handed to another request.
func (s *Sim) Corruptions() []Corruption {
	s.hazMu.Lock()
	defer s.hazMu.Unlock()
	return append([]Corruption(nil), s.corruptions...)
}

// withRecord runs f on d's record under its group's lock.
func withRecord(d *dreq, f func(rc *record)) {
	if d.q == nil {
		return
	}
	d.g.mu.Lock()
	f(&d.g.records[d.q.rec])
	d.g.mu.Unlock()
}

// pass is one decode event-loop iteration: orders, then
// process_decode_queue (deferred releases, pop_transferred,
// pop_preallocated), then new requests.
func (dr *drank) pass(s *Sim, now time.Time) {
	dr.mu.Lock()
	defer dr.mu.Unlock()
	if dr.paused || s.decodeDown(now) {
		return
	}
	dr.m.loopIterations++
	dr.iterations++
	dr.lastIter = now
	dr.takeOrders(s, now)
	dr.checkTaints(s, now)
	dr.resolveHeld(s, now)
	ran := dr.finishDecoding(s, now)
	dr.popTransferred(s, now)
	dr.popPreallocated(s, now)
	dr.admit(s, now)
	if ran || now.Sub(dr.m.lastLog) > s.opts.IdleRefresh {
		dr.logStats(now)
	}
}

func (dr *drank) logStats(now time.Time) {
	dr.m.lastLog = now
	dr.m.g[gDecodePrealloc] = float64(len(dr.prealloc))
	dr.m.g[gDecodeTransfer] = float64(len(dr.transfer))
	dr.m.g[gRunning] = float64(len(dr.decoding))
}

func (dr *drank) admit(s *Sim, now time.Time) {
	dr.inboxMu.Lock()
	in := dr.inbox
	dr.inbox = nil
	dr.inboxMu.Unlock()
	if dr.nextHC.IsZero() && s.opts.HealthCheckEvery > 0 {
		dr.nextHC = now.Add(s.opts.HealthCheckEvery * time.Duration(dr.idx+1))
	}
	for s.opts.HealthCheckEvery > 0 && !dr.nextHC.After(now) && !s.isQuiet() {
		in = append(in, dr.newHealthCheck(s, dr.nextHC, false, false))
		dr.nextHC = dr.nextHC.Add(s.opts.HealthCheckEvery * time.Duration(len(s.dranks)))
	}
	for _, d := range in {
		// The request entered decode when the router sent it (decode's
		// loop receives it within milliseconds, whatever the harness's
		// pass length); a decode that was down sees it when it is back.
		if d.admitted.Before(dr.bootAt) {
			d.admitted = dr.bootAt
		}
		dr.prealloc = append(dr.prealloc, d)
		dr.byRID[d.rid] = d
		withRecord(d, func(rc *record) { rc.dAdmit = d.admitted.UnixNano() })
	}
}

func (s *Sim) isQuiet() bool {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return s.quiet
}

// observe updates d's last observation from the prefill view.
func (d *dreq) observe(v pview) {
	if d.fake {
		d.progress = -1
		return
	}
	d.progress = max(d.progress, v.received)
	d.expected = v.expected
	d.started = d.started || v.posted
}

// transferStarted is what the decode plugin reports as transfer_started
// (sglang_watchdog_plugin/decode.py _started): a chunk seen, or the
// destination metadata sent. SGLang sends the metadata before the request
// enters the transfer queue (SGLang v0.5.18 disaggregation/decode.py
// DecodePreallocQueue.pop_preallocated calls kv_receiver.send_metadata),
// and from then on prefill holds the destination pages and may write at
// any time: NIXL sets started_transfer there (v0.5.18 nixl/conn.py
// NixlKVReceiver.send_metadata; init() from v0.4.6 to v0.5.3), Mooncake
// init_time (v0.5.18 mooncake/conn.py MooncakeKVReceiver.send_metadata;
// init() from v0.4.10). A request in the transfer queue has therefore
// started, whether or not prefill's worker has posted a chunk yet. The
// fake receiver of health checks moves no data.
func (d *dreq) transferStarted() bool {
	return !d.fake && (d.inTransfer || d.started || d.poll == pollTransferring)
}

// receiverPoll is the receiver's poll() (SGLang v0.5.18: the receivers'
// poll() in disaggregation/nixl/conn.py and mooncake/conn.py): a latched
// Failed, Success once every chunk arrived, the heartbeat's Failed after a
// prefill death, else WaitingForInput (newest NIXL also while a started
// transfer is incomplete) under the waiting timeout, or Transferring
// (Mooncake, once started), which no timeout covers (Mooncake's poll()
// applies the timeout only in WaitingForInput). It returns the poll,
// the cause of a Failed and when that failure happened.
func (s *Sim) receiverPoll(d *dreq, v pview, now time.Time) (kvPoll, DecodeEnd, time.Time) {
	if d.aborted {
		return pollFailed, DecodeForceFail, now
	}
	if d.fake {
		if d.stuck || !d.inTransfer {
			return pollWaitingForInput, "", now
		}
		return pollSuccess, "", now
	}
	if v.done {
		return pollSuccess, "", now
	}
	p, cause, at := pollWaitingForInput, DecodeEnd(""), now
	if !d.inTransfer && now.Before(d.bootDone) {
		p = pollBootstrapping
	} else if d.inTransfer {
		if dl := d.initTime.Add(s.opts.DecodeWaitingTimeout); !now.Before(dl) {
			p, cause, at = pollFailed, DecodeTimeout, dl
		}
	}
	if !v.deadAt.IsZero() {
		if hb := v.deadAt.Add(HeartbeatDetection); !now.Before(hb) && (p != pollFailed || hb.Before(at)) {
			p, cause, at = pollFailed, DecodeHeartbeat, hb
		}
	}
	return p, cause, at
}

// popTransferred is DecodeTransferQueue.pop_transferred.
func (dr *drank) popTransferred(s *Sim, now time.Time) {
	kept := dr.transfer[:0]
	for _, d := range dr.transfer {
		v := s.prefillView(d, now)
		d.observe(v)
		p, cause, at := s.receiverPoll(d, v, now)
		d.poll = p
		switch p {
		case pollSuccess:
			delete(dr.byRID, d.rid)
			d.freeAt = now.Add(decodeSuccessLag)
			dr.decoding = append(dr.decoding, d)
		case pollFailed:
			delete(dr.byRID, d.rid)
			dr.m.transferFailed++
			dr.fail(s, d, v, cause, at, now)
		default:
			kept = append(kept, d)
		}
	}
	clear(dr.transfer[len(kept):])
	dr.transfer = kept
}

// fail is the transfer queue's Failed path: the client gets a 500; the
// pages are freed, or held for ABORT_ACK when the receiver notified prefill
// and deferred release is on.
func (dr *drank) fail(s *Sim, d *dreq, v pview, cause DecodeEnd, at, now time.Time) {
	if cause == DecodeTimeout && s.opts.LeverEra == LeversNewest {
		d.abortNotified = true // the receiver sends ABORT to prefill on its timeout
	}
	d.cause = cause
	if on := s.deferredOn(); on != nil && *on && d.abortNotified {
		if s.acked(d, v) {
			dr.release(s, d, v, at, now)
			return
		}
		d.holdUntil = at.Add(DeferredReleaseTimeout)
		dr.held = append(dr.held, d)
		return
	}
	dr.release(s, d, v, at, now)
}

// acked tells whether prefill has acknowledged d's ABORT: every stage's
// process is alive and has no chunk of the room outstanding.
func (s *Sim) acked(d *dreq, v pview) bool {
	return d.q == nil || (v.deadAt.IsZero() && !v.pending)
}

func (dr *drank) resolveHeld(s *Sim, now time.Time) {
	kept := dr.held[:0]
	for _, d := range dr.held {
		v := s.prefillView(d, now)
		switch {
		case s.acked(d, v):
			dr.release(s, d, v, now, now)
		case !now.Before(d.holdUntil):
			dr.release(s, d, v, d.holdUntil, now)
		default:
			kept = append(kept, d)
		}
	}
	clear(dr.held[len(kept):])
	dr.held = kept
}

func (dr *drank) finishDecoding(s *Sim, now time.Time) bool {
	ran := len(dr.decoding) > 0
	kept := dr.decoding[:0]
	for _, d := range dr.decoding {
		if d.freeAt.After(now) {
			kept = append(kept, d)
			continue
		}
		d.cause = DecodeSuccess
		dr.release(s, d, pview{}, d.freeAt, now)
	}
	clear(dr.decoding[len(kept):])
	dr.decoding = kept
	return ran
}

// release frees d's slot and pages at `at` (observed at now). A free while
// prefill still has a chunk of the room outstanding is recorded as unsafe
// and taints the slot until the write lands or the writer dies.
func (dr *drank) release(s *Sim, d *dreq, v pview, at, now time.Time) {
	unsafe := false
	if d.slot >= 0 {
		unsafe = v.pending
		if unsafe {
			dr.taints = append(dr.taints, taint{slot: d.slot, writer: d, cause: d.cause, freedAt: at})
		}
		delete(dr.owner, d.slot)
		dr.free = append(dr.free, d.slot)
		d.slot = -1
	}
	withRecord(d, func(rc *record) {
		rc.decode = at.UnixNano()
		rc.dend = decodeEndIndex(d.cause)
		if unsafe && rc.unsafe == 0 {
			rc.unsafe = decodeEndIndex(d.cause)
		}
	})
}

// popPreallocated is DecodePreallocQueue.pop_preallocated: a request whose
// handshake is done gets its pages, sends its metadata (init_time) and
// moves to the transfer queue; a Failed one leaves as a bootstrap failure.
func (dr *drank) popPreallocated(s *Sim, now time.Time) {
	kept := dr.prealloc[:0]
	for _, d := range dr.prealloc {
		v := s.prefillView(d, now)
		p, cause, at := s.receiverPoll(d, v, now)
		d.poll = p
		switch p {
		case pollFailed:
			delete(dr.byRID, d.rid)
			dr.m.bootstrapFailed++
			d.cause = cause
			dr.release(s, d, v, at, now)
		case pollWaitingForInput, pollSuccess:
			if dr.full(s) {
				// No memory: SGLang's pop_preallocated leaves it queued,
				// with no timeout (its waiting timeout starts at
				// send_metadata).
				d.waitingMemory = true
				kept = append(kept, d)
				continue
			}
			waited := d.waitingMemory
			d.waitingMemory = false
			// SGLang's prefill writes nothing before the receiver's
			// metadata (sent right after preallocation), so a receiver
			// reading Success here has been preallocated in SGLang's
			// order of events; only the simulator's prefill, which does
			// not wait for decode, can finish first (a paused or
			// restarting decode). It moves on as it would have, and the
			// transfer queue's next poll reads Success.
			dr.alloc(d, now)
			d.inTransfer = true
			// Preallocation and send_metadata follow the handshake at once,
			// or the pass that found memory for a request that waited; both
			// receivers start the waiting timeout there (SGLang v0.5.18:
			// init_time in send_metadata, disaggregation/nixl/conn.py and
			// mooncake/conn.py).
			d.initTime = d.admitted
			if !d.fake && d.bootDone.After(d.admitted) {
				d.initTime = d.bootDone
			}
			if waited {
				d.initTime = now
			}
			dr.transfer = append(dr.transfer, d)
		default:
			kept = append(kept, d)
		}
	}
	clear(dr.prealloc[len(kept):])
	dr.prealloc = kept
}

// full tells whether every page slot of the rank is taken (DecodeSlots).
func (dr *drank) full(s *Sim) bool {
	return s.opts.DecodeSlots > 0 && len(dr.free) == 0 && dr.nextSlot >= s.opts.DecodeSlots
}

// alloc gives d a page slot, the most recently freed one first (the worst
// case for a late write).
func (dr *drank) alloc(d *dreq, now time.Time) {
	if n := len(dr.free); n > 0 {
		d.slot = dr.free[n-1]
		dr.free = dr.free[:n-1]
	} else {
		d.slot = dr.nextSlot
		dr.nextSlot++
	}
	d.allocAt = now
	dr.owner[d.slot] = d
}

// checkTaints lands late writes: a chunk that settled wrote into its old
// pages, and a wedged handle's write can land at any moment, so it lands
// as soon as the pages have a new owner. A prefill that died writes no more.
func (dr *drank) checkTaints(s *Sim, now time.Time) {
	kept := dr.taints[:0]
	for _, t := range dr.taints {
		v := s.prefillView(t.writer, now)
		owner := dr.owner[t.slot]
		switch {
		case !v.deadAt.IsZero():
		case !v.pending || v.wedged:
			if owner != nil {
				dr.corrupt(s, t, owner, now)
			} else if v.pending {
				kept = append(kept, t)
			}
		default:
			kept = append(kept, t)
		}
	}
	clear(dr.taints[len(kept):])
	dr.taints = kept
}

func (dr *drank) corrupt(s *Sim, t taint, victim *dreq, now time.Time) {
	withRecord(victim, func(rc *record) {
		if rc.corruptedBy == "" {
			rc.corruptedBy = t.writer.rid
		}
	})
	s.hazMu.Lock()
	s.corruptions = append(s.corruptions, Corruption{Writer: t.writer.rid, Room: t.writer.room, Victim: victim.rid,
		DecodeRank: dr.idx, Cause: t.cause, FreedAt: t.freedAt, LandedAt: now})
	s.hazMu.Unlock()
}

// reset empties the decode process (start, RestartDecode): requests are
// lost (their clients got an error), pages and taints go with the process.
func (dr *drank) reset(s *Sim, now time.Time, gen int) {
	lose := func(d *dreq) {
		d.cause = DecodeRestarted
		withRecord(d, func(rc *record) {
			rc.decode = now.UnixNano()
			rc.dend = decodeEndIndex(DecodeRestarted)
		})
	}
	for _, l := range [][]*dreq{dr.prealloc, dr.transfer, dr.held, dr.decoding} {
		for _, d := range l {
			lose(d)
		}
	}
	dr.prealloc, dr.transfer, dr.held, dr.decoding = nil, nil, nil, nil
	dr.byRID = make(map[string]*dreq)
	withdrawOrders(dr.pending)
	dr.pending = nil
	dr.iterations, dr.lastIter = 0, time.Time{}
	dr.free, dr.nextSlot, dr.owner, dr.taints = nil, 0, make(map[int]*dreq), nil
	dr.pid = decodePID + dr.idx + 1000*gen
	dr.bootAt = now.Add(s.opts.BootTime)
	if gen == 0 {
		dr.bootAt = now
	}
	dr.m = rankMetrics{}
	dr.logStats(now)
}

// RestartDecode restarts the decode server (every decode rank): its
// requests are lost, and for BootTime its listeners and /metrics refuse
// connections and it makes no passes. Requests that arrive meanwhile wait
// for it.
func (s *Sim) RestartDecode() {
	now := s.clock.Now()
	s.cfgMu.Lock()
	s.decodeGen++
	gen := s.decodeGen
	s.decodeDownUntil = now.Add(s.opts.BootTime)
	s.cfgMu.Unlock()
	for _, dr := range s.dranks {
		dr.mu.Lock()
		dr.reset(s, now, gen)
		dr.mu.Unlock()
	}
}

func (dr *drank) takeOrders(s *Sim, now time.Time) {
	takeOrders(&dr.pending, func(req pluginapi.ForceFailRequest) (int, pluginapi.ForceFailResponse) {
		return dr.applyOrder(s, req, now)
	})
}

// applyOrder decides a decode order against the live queues (round 3) and
// pulls the lever. Callers hold dr.mu.
func (dr *drank) applyOrder(s *Sim, req pluginapi.ForceFailRequest, now time.Time) (int, pluginapi.ForceFailResponse) {
	d, code, refusal, refused := lookupOrder(req, dr.byRID)
	if refused {
		return code, refusal
	}
	v := s.prefillView(d, now)
	d.observe(v)
	room := d.room
	if v.done {
		return 409, pluginapi.ForceFailResponse{Result: pluginapi.ResultTransferSucceeded, RID: d.rid, BootstrapRoom: &room,
			Error: "the transfer of rid " + strconv.Quote(d.rid) + " succeeded; the scheduler moves it on by itself"}
	}
	failed := d.aborted || d.poll == pollFailed
	if d.transferStarted() && !failed && !req.PrefillStopped {
		return 409, pluginapi.ForceFailResponse{Result: pluginapi.ResultTransferLive, RID: d.rid, BootstrapRoom: &room,
			Error: "the KV transfer into the pages of rid " + strconv.Quote(d.rid) +
				" has started and not finished, and prefill_stopped was not asserted; releasing its pages now could let a late write corrupt another request"}
	}
	resp := pluginapi.ForceFailResponse{RID: d.rid, BootstrapRoom: &room, Lever: pluginapi.LeverConcludeState,
		AppliedUnix: unixSeconds(now)}
	levers := []string{pluginapi.LeverAbort}
	on := s.deferredOn()
	if d.inTransfer && on != nil && *on {
		levers = append(levers, pluginapi.LeverDeferredAbort)
	}
	switch {
	case failed:
		resp.Result = pluginapi.ResultAlreadyFailed
		resp.Levers = []string{pluginapi.LeverAbort}
		if d.deferredAbort {
			resp.Levers = append(resp.Levers, pluginapi.LeverDeferredAbort)
		}
	case req.DryRun:
		resp.Result = pluginapi.ResultWouldFlip
		resp.Levers = levers
	default:
		resp.Result = pluginapi.ResultFlipped
		resp.Levers = levers
		d.aborted = true
		d.abortNotified = s.opts.LeverEra == LeversNewest
		d.deferredAbort = len(levers) > 1 && d.abortNotified
		withRecord(d, func(rc *record) {
			if rc.dForced == 0 {
				rc.dForced = now.UnixNano()
			}
		})
	}
	return 200, resp
}

// decodeListing builds the decode plugin's view of one rank. Callers hold
// dr.mu.
func (dr *drank) listing(s *Sim, now time.Time) pluginapi.Listing {
	levers, note := s.decodeLevers()
	srv := pluginapi.Server{PID: dr.pid, DPRank: dr.idx, PPRank: 0, TPRank: 0,
		DisaggregationMode: pluginapi.ModeDecode, TransferBackend: s.opts.Backend,
		SGLangVersion: eraVersion[s.opts.Era], Levers: levers, LeverNote: note, PPSize: 1,
		DeferredRelease: s.deferredOn()}
	l := pluginapi.Listing{
		APIVersion:        pluginapi.APIVersion,
		Server:            srv,
		NowUnix:           unixSeconds(now),
		Loop:              pluginapi.Loop{Iterations: dr.iterations, LastIterationUnix: unixSeconds(dr.lastIter)},
		Queues:            pluginapi.Queues{Prealloc: len(dr.prealloc), Transfer: len(dr.transfer)},
		Inflight:          []pluginapi.Room{},
		OrphanedTransfers: []pluginapi.OrphanedTransfer{},
		DecodeRequests:    make([]pluginapi.DecodeRequest, 0, len(dr.prealloc)+len(dr.transfer)),
	}
	nixl := s.opts.Backend == BackendNIXL
	add := func(d *dreq, queue string) {
		r := pluginapi.DecodeRequest{RID: d.rid, BootstrapRoom: d.room, BootstrapAddr: d.addr, Queue: queue,
			Poll: d.poll.String(), AgeSeconds: now.Sub(d.admitted).Seconds(), Progress: -1,
			HealthCheck: d.healthCheck(), WaitingForMemory: queue == pluginapi.DecodeQueuePrealloc && d.waitingMemory}
		if nixl && !d.fake {
			r.Progress = d.progress
			if d.expected >= 0 {
				r.ChunksExpected = ptrTo(d.expected)
			}
		}
		r.TransferStarted = ptrTo(d.transferStarted())
		if !d.fake && d.g != nil {
			for _, st := range d.g.stages {
				host := s.bootstrapHost(d.addr)
				if len(s.opts.RankHosts) > 0 {
					host = s.opts.RankHosts[st.idx]
				}
				r.PrefillRankAddrs = append(r.PrefillRankAddrs, net.JoinHostPort(host, strconv.Itoa(KVRankPort(st.idx))))
			}
		}
		l.DecodeRequests = append(l.DecodeRequests, r)
	}
	for _, d := range dr.prealloc {
		add(d, pluginapi.DecodeQueuePrealloc)
	}
	for _, d := range dr.transfer {
		add(d, pluginapi.DecodeQueueTransfer)
	}
	if s.listsThreads() {
		// The decode manager's listener of prefill's status frames and
		// its heartbeat checker of the prefill peers (SGLang v0.5.18:
		// disaggregation/mooncake/conn.py); neither dies here.
		l.KVThreads = []pluginapi.KVThread{{Role: pluginapi.ThreadDecodeListener, Function: "decode_thread", Alive: true},
			{Role: pluginapi.ThreadHeartbeat, Function: "heartbeat_checker", Alive: true}}
	}
	return l
}

func ptrTo[T any](v T) *T { return &v }
