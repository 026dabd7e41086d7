package watchdog

import (
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Decisions are pure functions of state, configuration and the clock, so
// that they can be tested on a fake clock without HTTP.

// roomStuck tells whether a request is stuck. On a prefill rank whose
// plugin reports its transfer workers (server.transfer_progress), a room
// is judged by its transfer (progressRoomStuck); elsewhere by the stall
// rule: older than its role's deadline with neither poll nor progress (nor,
// on decode, its queue) changing for the stall window while the loop ran.
// Health checks never are, nor decode requests waiting for KV pages
// (SGLang never times those out: issue 18).
func roomStuck(room uint64, r *roomState, rk *rankState, now time.Time, cfg *Config) bool {
	switch {
	case r.health || r.waitingMemory:
		return false
	case r.dqueue != "":
		return stalled(r, rk, now, cfg, cfg.DecodeDeadline)
	case rk.reportsTransferProgress:
		return progressRoomStuck(room, r, rk, now, cfg)
	}
	return stalled(r, rk, now, cfg, cfg.Deadline)
}

// stalled is the stall rule: older than deadline, with no change for the
// stall window while the scheduler loop kept running (otherwise every room
// looks frozen and the observations are stale).
func stalled(r *roomState, rk *rankState, now time.Time, cfg *Config, deadline time.Duration) bool {
	if r.age < deadline.Seconds() {
		return false
	}
	if now.Sub(r.lastChange) < cfg.StallWindow {
		return false
	}
	return rk.loopAdvancing && rk.iterations > r.iterAtChange
}

// progressRoomStuck judges a prefill room by its transfer worker. On
// SGLang a room's progress stands still for its whole stay in the inflight
// queue, so the stall rule would take a healthy slow transfer for a stuck
// one. Instead:
//   - its chunk is in the worker's hands: stuck once that chunk is overdue
//     for its size at the link's measured speed (chunkOverdue);
//   - its chunks wait in the queue: not stuck by itself, it waits behind
//     its worker (a wedge of that worker is handled by a wedge order),
//     unless kv_threads shows that worker dead: its chunks will never be
//     posted, so with nothing of it in flight it gets the stall rule;
//   - with attention TP/CP, the same on the other ranks of the group,
//     whose shares SGLang's MIN poll waits for: a chunk another rank holds
//     is judged by that rank's worker and link, a chunk queued there waits
//     unless that queue's worker holds an overdue chunk (behindPeerWedge),
//     and a chunk in flight on a rank whose worker is not listed gets the
//     stall rule with twice the deadline, as an untracked worker here does;
//   - nothing in flight nor queued (a silent pin: the status resurrected to
//     Transferring, an abort race): the stall rule, counted from the last
//     transfer activity seen for the room;
//   - its worker is not tracked (the plugin started while it held a chunk,
//     so in_flight proves nothing): the stall rule with twice the deadline.
func progressRoomStuck(room uint64, r *roomState, rk *rankState, now time.Time, cfg *Config) bool {
	ws := rk.workers[r.queue]
	// On SGLang v0.5.18 NIXL the leader drops the room's transfer info once
	// its share is sent, so its queue is unknown while a peer still sends.
	own := ws != nil && ws.tracked
	young := r.age < cfg.Deadline.Seconds() || !rk.loopAdvancing
	switch {
	case own && young:
		return false
	case own && ws.inFlight != nil && ws.inFlight.BootstrapRoom == room:
		return chunkOverdue(ws, now, cfg)
	case r.chunksQueued > 0 && rk.deadWorker(r.queue):
		// Its worker is dead: its chunks are never posted, and no
		// handle of it is outstanding to wait for. Stuck past the
		// deadline like any room that does not move, but only with
		// nothing of it in flight on any rank, and never once its share
		// here was sent (Success: another rank holds it).
		return r.inFlightKnown && !r.inFlight && r.peerChunks == "" && r.poll != pluginapi.PollSuccess &&
			stalled(r, rk, now, cfg, cfg.Deadline)
	case own && r.chunksQueued > 0:
		return false
	case r.peerChunksQueued > 0 || r.peerChunks != "":
		// Held or queued on other ranks: stuck once any share of it
		// never ends there, whatever the other shares do.
		_, _, pw := overduePeerChunk(room, rk, now, cfg)
		return !young && (pw != nil || behindPeerWedge(room, rk, now, cfg))
	case !own || (r.inFlightKnown && r.inFlight):
		return stalled(r, rk, now, cfg, 2*cfg.Deadline)
	}
	return stalled(r, rk, now, cfg, cfg.Deadline)
}

// behindPeerWedge tells whether a chunk of the room waits in another
// rank's queue whose worker holds a chunk past its allowance. Such a room
// would wait for ever; one behind a live chunk waits its turn. The leader
// fails the rooms behind its own wedges with a wedge order; the orders do
// not reach another rank's queues, so these get a force-fail each.
func behindPeerWedge(room uint64, rk *rankState, now time.Time, cfg *Config) bool {
	for _, ws := range rk.peerBehind[room] {
		if ws != nil && ws.tracked && chunkOverdue(ws, now, cfg) {
			return true
		}
	}
	return false
}

// overduePeerChunk finds a chunk of the room that another rank of the
// group holds past its allowance at that rank's own link speed: its rank,
// queue and worker, or a nil worker. One such chunk is enough: SGLang's
// MIN poll waits for every rank, so the room never ends while it hangs.
func overduePeerChunk(room uint64, rk *rankState, now time.Time, cfg *Config) (string, int, *workerState) {
	for rank, workers := range rk.peerWorkers {
		for q, ws := range workers {
			if ws.inFlight != nil && ws.inFlight.BootstrapRoom == room && chunkOverdue(ws, now, cfg) {
				return rank, q, ws
			}
		}
	}
	return "", 0, nil
}

// chunkOverdue tells whether a tracked worker has held its chunk past the
// chunk's allowance, and this watchdog watched it for the stall window.
func chunkOverdue(ws *workerState, now time.Time, cfg *Config) bool {
	if !ws.tracked || ws.inFlight == nil || now.Sub(ws.chunkSeen) < cfg.StallWindow {
		return false
	}
	allowance := chunkAllowance(ws.inFlight.Pages, ws.speed, ws.speedKnown, cfg)
	return ws.inFlight.Seconds >= allowance.Seconds()
}

// rankWedged tells whether the scheduler loop stopped while requests wait.
// A still counter on an empty queue is normal: older SGLang only calls the
// hooked pass while the queue is non-empty.
func rankWedged(rk *rankState, now time.Time, cfg *Config) bool {
	return len(rk.rooms) > 0 && now.Sub(rk.loopAdvancedAt) >= cfg.StallWindow
}

// gaugePinned tells whether a queue gauge is pinned: non-zero, unchanged for
// the pin window, and no progress signal moved in that window. An idle
// server's gauge is 0; a busy healthy one moves its progress counters.
func gaugePinned(g *gaugeState, m *metricsState, now time.Time, cfg *Config) bool {
	if !m.status.up || g.value == 0 {
		return false
	}
	return now.Sub(g.lastChange) >= cfg.PinWindow && now.Sub(m.lastProgress) >= cfg.PinWindow
}

// Rules of a transfer wedge, as logged.
const (
	// Ranks without transfer_progress, from transfer_in_flight and
	// orphaned_transfers.
	wedgeInFlight  = "in_flight"
	wedgeSuspected = "suspected"
	// Ranks with transfer_progress: the worker's chunk is overdue and its
	// room, still listed, is past the deadline.
	wedgeOverdue = "overdue_chunk"
	// Both: the chunk's room left the queue while the worker still waits
	// on it.
	wedgeOrphaned = "orphaned_transfer"
)

// unknownQueue keys a wedge whose transfer queue is not known.
const unknownQueue = -1

// noChunk is the chunk of a wedge diagnosed without transfer_progress.
const noChunk = -1

// transferWedges diagnoses the wedged transfer queues of a rank (in SGLang
// v0.5.18, the transfer_worker of nixl/conn.py and mooncake/conn.py handles
// one chunk at a time and waits for it with no deadline, so a chunk that
// never completes holds every later room on its queue). Ranks with
// transfer_progress are judged by progressWedges; the others by the
// stall rules (stallWedges):
//   - a room with a transfer in flight that is stuck (old, no change for the
//     stall window while the loop ran) wedges its queue;
//   - an orphaned transfer on queue Q, listed for the stall window, wedges
//     Q while a room on Q has waited the stall window unchanged and no room
//     on Q changed in that window (departures are not counted: aborts and
//     force-fails leave as well);
//   - with an older plugin (no transfer_in_flight), two or more stuck rooms
//     in Transferring make the rank suspected (queue unknown).
//
// Those rules cannot tell a slow chunk from a stuck one, so on such ranks a
// wedge is reported and alerted on but never acted on (no wedge order, no
// restart: wedgeActionable).
//
// A diagnosed wedge holds while its evidence lasts (an orphan or a stuck
// in-flight room on its queue), so that releasing the in-flight room, which
// turns it into an orphan, does not clear and re-count it. While the loop
// does not advance the observations are stale: nothing new is diagnosed and
// the previous verdicts stand.
func transferWedges(rk *rankState, now time.Time, cfg *Config) map[int]*transferWedge {
	if rk.role == RoleDecode {
		// The wedge rules read prefill's transfer fields; decode has none.
		return nil
	}
	if !rk.loopAdvancing {
		return rk.wedges
	}
	var out map[int]*transferWedge
	if rk.reportsTransferProgress {
		out = progressWedges(rk, now, cfg)
	} else {
		out = stallWedges(rk, now, cfg)
	}
	for q, w := range out {
		if prev, ok := rk.wedges[q]; ok && prev.diagnosed == w.diagnosed {
			w.since = prev.since
		} else if w.since.IsZero() {
			w.since = now
		}
	}
	return out
}

// progressWedges diagnoses the wedges of a rank with transfer_progress:
// queue q is wedged when its worker's chunk is overdue (chunkOverdue) and
// the chunk's room is listed and past the deadline, or is not listed (an
// orphan) and the chunk has been held for the deadline. A wedge holds while
// the same chunk stays in the worker's hands, even once its room is gone:
// the order that fails the rooms turns it into an orphan. Nothing else
// (no stall of rooms, no orphan on its own) makes a wedge here.
func progressWedges(rk *rankState, now time.Time, cfg *Config) map[int]*transferWedge {
	out := map[int]*transferWedge{}
	var listed map[uint64]*roomState
	for q, ws := range rk.workers {
		c := ws.inFlight
		if !ws.tracked || c == nil {
			continue
		}
		if prev, ok := rk.wedges[q]; ok && prev.chunk == c.Chunk {
			out[q] = prev
			continue
		}
		if !chunkOverdue(ws, now, cfg) {
			continue
		}
		if listed == nil {
			listed = make(map[uint64]*roomState, len(rk.rooms))
			for key, r := range rk.rooms {
				listed[key.room] = r
			}
		}
		rule := wedgeOverdue
		if r, ok := listed[c.BootstrapRoom]; ok {
			if r.age < cfg.Deadline.Seconds() {
				continue
			}
		} else if c.Seconds < cfg.Deadline.Seconds() {
			continue
		} else {
			rule = wedgeOrphaned
		}
		out[q] = &transferWedge{diagnosed: true, rule: rule, room: c.BootstrapRoom, chunk: c.Chunk}
	}
	return out
}

// stallWedges applies the stall rules of ranks without transfer_progress
// (transferWedges).
func stallWedges(rk *rankState, now time.Time, cfg *Config) map[int]*transferWedge {
	out := map[int]*transferWedge{}
	evidence := map[int]bool{}
	waiting := map[int]bool{} // a room on the queue waited the stall window unchanged
	suspects := 0
	var suspectRoom uint64
	for key, r := range rk.rooms {
		stuck := roomStuck(key.room, r, rk, now, cfg)
		if r.inFlightKnown && r.inFlight && stuck {
			evidence[r.queue] = true
			if _, ok := out[r.queue]; !ok {
				out[r.queue] = &transferWedge{diagnosed: true, rule: wedgeInFlight, room: key.room, chunk: noChunk}
			}
		}
		// A room past its forward pass whose transfer has not concluded:
		// Mooncake and NIXL up to v0.5.11 never write Transferring, their
		// rooms read WaitingForInput for the whole transfer (the
		// field-by-field parity test against their code).
		if !r.inFlightKnown && stuck && (r.poll == pluginapi.PollTransferring || r.poll == pluginapi.PollWaitingForInput) {
			suspects++
			suspectRoom = key.room
		}
		if r.queue != unknownQueue && !r.health && now.Sub(r.lastChange) >= cfg.StallWindow && rk.iterations > r.iterAtChange {
			waiting[r.queue] = true
		}
	}
	for room, o := range rk.orphans {
		if o.queue == unknownQueue {
			continue
		}
		evidence[o.queue] = true
		if _, ok := out[o.queue]; ok || now.Sub(o.firstSeen) < cfg.StallWindow || !waiting[o.queue] {
			continue
		}
		if changed, ok := rk.queueChange[o.queue]; ok && now.Sub(changed) < cfg.StallWindow {
			continue
		}
		out[o.queue] = &transferWedge{diagnosed: true, rule: wedgeOrphaned, room: room, chunk: noChunk}
	}
	for q, prev := range rk.wedges {
		if _, ok := out[q]; !ok && prev.diagnosed && evidence[q] {
			out[q] = prev
		}
	}
	if suspects >= 2 {
		if _, ok := out[unknownQueue]; !ok {
			out[unknownQueue] = &transferWedge{rule: wedgeSuspected, room: suspectRoom, chunk: noChunk}
		}
	}
	return out
}

// wedgeActionable tells whether a wedge may be acted on (a wedge order, a
// restart): only one diagnosed from transfer_progress, whose chunk is
// known to be overdue for its size. The stall rules take a slow healthy
// chunk for a wedge, and act on nothing.
func wedgeActionable(tw *transferWedge) bool {
	return tw.diagnosed && tw.chunk != noChunk
}

// decodeClearance is what the safety rule allows for one decode request.
type decodeClearance int

const (
	// clearNotStarted: no transfer into its pages began, nothing can be
	// writing into them; released without asking prefill.
	clearNotStarted decodeClearance = iota
	// clearFailed: SGLang itself marked the request Failed.
	clearFailed
	// needVerdict: the transfer may have started and not finished; only a
	// "stopped" verdict of the prefill side allows the release.
	needVerdict
)

// decodeSafety applies the safety rule to one stage of a decode request:
// its poll and whether its transfer may have started (unknown counts as
// started).
func decodeSafety(poll string, started bool) decodeClearance {
	switch {
	case poll == pluginapi.PollFailed:
		return clearFailed
	case !started:
		return clearNotStarted
	}
	return needVerdict
}

// decodeEarly tells whether a decode request short of its deadline may be
// released early: prefill may have released its room, and only its
// verdict stands between the client and its error (issue 18: the router
// answers the client once decode answers, so a prefill release otherwise
// still leaves it waiting for the decode deadline). Only a request whose
// transfer may have started qualifies, since its release needs a
// "stopped" verdict, which the actuator asks for; one without a started
// transfer keeps the deadline rule, since nothing says prefill gave up on
// it. It must be older than the prefill deadline (prefill's deadline path
// releases nothing younger, so a lookup before that only costs the peer),
// with the stall rule's other conditions: no change for the stall window
// while the loop ran.
func decodeEarly(r *roomState, rk *rankState, now time.Time, cfg *Config) bool {
	if r.dqueue == "" || r.health || r.waitingMemory || decodeSafety(r.poll, r.started) != needVerdict {
		return false
	}
	return stalled(r, rk, now, cfg, cfg.Deadline)
}
