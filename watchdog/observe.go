package watchdog

import (
	"fmt"
	"time"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Observing: each cycle's listings folded into state, one rank at a time.
// Nothing here judges a request; the pace of each link (links.go) is an
// observation too, learned from the chunks the listings show finished.

// listingResult is one rank's listing as the cycle read it.
type listingResult struct {
	listing  *pluginapi.Listing
	err      error
	duration time.Duration
}

// observeListing folds one rank's listing into state: the rank, its rooms,
// its transfer workers with their links' pace, its orphans. It decides
// nothing: evaluate does, once every listing of the cycle is folded.
// Caller holds w.mu.
func (w *Watchdog) observeListing(rk *rankState, res listingResult, now time.Time) {
	rk.status.seen = true
	rk.status.duration = res.duration
	if res.err != nil {
		rk.status.fail(w.logger, now, res.err, "reading plugin listing failed", "plugin")
		return
	}
	l := res.listing
	rk.status.answered(w.logger, now, "plugin listing read again", "plugin")
	if rk.listed && (l.Loop.Iterations < rk.iterations || l.Server.PID != rk.server.PID) {
		level.Warn(w.logger).Log("msg", "scheduler restarted: the requests it held are gone", "target", rk.status.target,
			"dp_rank", l.Server.DPRank, "pp_rank", l.Server.PPRank, "old_pid", rk.server.PID, "pid", l.Server.PID,
			"old_iterations", rk.iterations, "iterations", l.Loop.Iterations, "rooms_tracked", len(rk.rooms))
		// A new process: its transfer workers and orphans are new too, and
		// so are the group's other ranks, restarted with it. What its links
		// showed is forgotten: a restart is often the answer to a link
		// that changed, and the first-chunk rule is the cautious one.
		rk.gen++
		rk.leverWarned = false
		rk.noDecodeSupport = false
		clear(rk.orphans)
		clear(rk.queueChange)
		clear(rk.wedges)
		clear(rk.workers)
		clear(rk.peerWorkers)
		clear(rk.links)
		clear(rk.peerLinks)
		clear(rk.orders)
		clear(rk.deadSince)
		clear(rk.deadLogged)
	}
	rk.server = l.Server
	rk.role = RoleOf(l)
	w.decodeSeen = w.decodeSeen || rk.role == RoleDecode
	if rk.role == RoleDecode && l.DecodeRequests == nil && !rk.noDecodeSupport {
		rk.noDecodeSupport = true
		level.Error(w.logger).Log("msg", "decode plugin without decode support (no decode_requests in its listing): nothing on this rank is watched or acted on; upgrade the plugin",
			"target", rk.status.target, "dp_rank", l.Server.DPRank, "pp_rank", l.Server.PPRank, "pid", l.Server.PID)
	}
	if rk.unsupported() && !rk.leverWarned {
		rk.leverWarned = true
		level.Error(w.logger).Log("msg", "no force-fail lever works on this SGLang version and backend: stuck requests on this rank are detected and alerted on, never force-failed",
			"target", rk.status.target, "dp_rank", l.Server.DPRank, "pp_rank", l.Server.PPRank, "pid", l.Server.PID,
			"sglang_version", l.Server.SGLangVersion, "transfer_backend", l.Server.TransferBackend, "lever_note", l.Server.LeverNote)
	}
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

	rk.reportsTransferProgress = rk.role == RolePrefill && l.Server.TransferProgress != nil && *l.Server.TransferProgress
	observeWorkers(rk, l.TransferWorkers, l.PeerTransferWorkers, now, w.cfg.LinkIdle)
	observeThreads(rk, l.KVThreads, now)

	rk.cycle++
	limitHit := false
	listed := entries(l)
	for i := range listed {
		lr := &listed[i]
		key := lr.key()
		r, ok := rk.rooms[key]
		if !ok {
			if w.tracked >= w.cfg.MaxRooms || len(rk.rooms) >= max(1, w.cfg.MaxRooms/len(w.ranks)) {
				limitHit = true
				continue
			}
			r = &roomState{firstSeen: now, lastChange: now, iterAtChange: l.Loop.Iterations, poll: lr.poll, progress: lr.progress,
				dqueue: lr.dqueue, started: lr.started, chunk: rk.chunkOf(lr), chunksQueued: lr.chunksQueued,
				peerChunksQueued: lr.peerChunksQueued, peerChunks: rk.peerHeld[lr.room]}
			rk.rooms[key] = r
			w.tracked++
		} else if r.poll != lr.poll || r.progress != lr.progress || r.dqueue != lr.dqueue || r.started != lr.started {
			// On decode, moving between queues or a transfer beginning is
			// progress too.
			r.poll, r.progress, r.dqueue, r.started = lr.poll, lr.progress, lr.dqueue, lr.started
			r.lastChange = now
			r.iterAtChange = l.Loop.Iterations
			if r.queue != unknownQueue {
				rk.queueChange[r.queue] = now
			}
		}
		inFlightKnown, inFlight := lr.inFlight != nil, lr.inFlight != nil && *lr.inFlight
		if ok && (inFlightKnown != r.inFlightKnown || inFlight != r.inFlight) {
			// A chunk taken up or settled is the transfer worker moving.
			r.lastChange = now
			r.iterAtChange = l.Loop.Iterations
			if r.queue != unknownQueue {
				rk.queueChange[r.queue] = now
			}
		}
		chunk, peerChunks := rk.chunkOf(lr), rk.peerHeld[lr.room]
		if ok && (chunk != r.chunk || lr.chunksQueued != r.chunksQueued || peerChunks != r.peerChunks || lr.peerChunksQueued != r.peerChunksQueued) {
			// So is a chunk of the room taken up, finished or queued, on
			// any rank of the group.
			r.lastChange = now
			r.iterAtChange = l.Loop.Iterations
		}
		r.chunk, r.chunksQueued = chunk, lr.chunksQueued
		r.peerChunks, r.peerChunksQueued = peerChunks, lr.peerChunksQueued
		r.inFlightKnown, r.inFlight = inFlightKnown, inFlight
		r.queue = queueIndex(lr.queue)
		if _, ok := rk.queueChange[r.queue]; !ok && r.queue != unknownQueue {
			rk.queueChange[r.queue] = now
		}
		r.seen = rk.cycle
		r.age = lr.age
		r.health = lr.health
		r.waitingMemory = lr.waitingMemory
		r.addr = lr.addr
		r.prefillAddrs = lr.prefillAddrs
		r.prompt = lr.prompt
	}
	if limitHit {
		w.limits++
		level.Error(w.logger).Log("msg", "room limit reached; rooms beyond it are not tracked and never acted on", "target", rk.status.target, "max_rooms", w.cfg.MaxRooms, "listed", len(listed))
	}
	clear(rk.departed)
	for key, r := range rk.rooms {
		if r.seen == rk.cycle {
			continue
		}
		rk.hist.observe(r.age)
		if len(rk.orders) > 0 {
			rk.departed[key] = r
		}
		delete(rk.rooms, key)
		w.tracked--
	}
	for _, o := range l.OrphanedTransfers {
		w.ledger.orphaned(o.BootstrapRoom)
		st, ok := rk.orphans[o.BootstrapRoom]
		if !ok {
			st = &orphanState{firstSeen: now}
			rk.orphans[o.BootstrapRoom] = st
		}
		st.queue = queueIndex(o.TransferQueue)
		st.seen = rk.cycle
		if _, ok := rk.queueChange[st.queue]; !ok && st.queue != unknownQueue {
			rk.queueChange[st.queue] = now
		}
	}
	for room, o := range rk.orphans {
		if o.seen != rk.cycle {
			delete(rk.orphans, room)
		}
	}
}

// observeWorkers folds a listing's transfer_workers, and those of the
// other ranks of its attention TP/CP group, into the rank's state, and
// paces each chunk in flight by its own link, as that rank sees it. A rank
// without transfer_progress keeps none.
func observeWorkers(rk *rankState, listed []pluginapi.TransferWorker, peers []pluginapi.PeerWorkers, now time.Time, idle time.Duration) {
	clear(rk.peerHeld)
	clear(rk.peerBehind)
	if !rk.reportsTransferProgress {
		clear(rk.workers)
		clear(rk.peerWorkers)
		clear(rk.links)
		clear(rk.peerLinks)
		return
	}
	observeRankWorkers(rk.workers, listed, now)
	observeLinks(rk.links, rk.workers, listed, now, idle)
	seen := make(map[string]bool, len(peers))
	for _, p := range peers {
		seen[p.Rank] = true
		workers := rk.peerWorkers[p.Rank]
		if workers == nil {
			workers = map[int]*workerState{}
			rk.peerWorkers[p.Rank] = workers
		}
		book := rk.peerLinks[p.Rank]
		if book == nil {
			book = linkBook{}
			rk.peerLinks[p.Rank] = book
		}
		observeRankWorkers(workers, p.TransferWorkers, now)
		observeLinks(book, workers, p.TransferWorkers, now, idle)
		for _, tw := range p.TransferWorkers {
			if c := tw.InFlight; c != nil && tw.Tracked {
				rk.peerHeld[c.BootstrapRoom] += fmt.Sprintf("%s/%d/%d;", p.Rank, tw.TransferQueue, c.Chunk)
			}
			for _, room := range tw.QueuedRooms {
				rk.peerBehind[room] = append(rk.peerBehind[room], workers[tw.TransferQueue])
			}
		}
	}
	// A rank whose file went stale keeps its links (they age out on
	// their own); its workers say nothing while unwatched.
	for name := range rk.peerWorkers {
		if !seen[name] {
			delete(rk.peerWorkers, name)
		}
	}
	for name, book := range rk.peerLinks {
		if !seen[name] {
			book.forget(now, idle)
		}
		if len(book) == 0 {
			delete(rk.peerLinks, name)
		}
	}
}

// observeRankWorkers folds one rank's transfer_workers into workers.
func observeRankWorkers(workers map[int]*workerState, listed []pluginapi.TransferWorker, now time.Time) {
	seen := make(map[int]bool, len(listed))
	for i := range listed {
		tw := &listed[i]
		ws := workers[tw.TransferQueue]
		if ws == nil {
			ws = &workerState{lastFinished: -1}
			workers[tw.TransferQueue] = ws
		}
		seen[tw.TransferQueue] = true
		ws.tracked = tw.Tracked
		if tw.InFlight != nil && (ws.inFlight == nil || ws.inFlight.Chunk != tw.InFlight.Chunk) {
			ws.chunkSeen = now
		}
		ws.inFlight = nil
		if tw.InFlight != nil {
			c := *tw.InFlight
			ws.inFlight = &c
		}
	}
	for q := range workers {
		if !seen[q] {
			delete(workers, q)
		}
	}
}

// chunkOf returns the number of the listed room's chunk in its worker's
// hands, noChunk when none (or without transfer_progress).
func (rk *rankState) chunkOf(e *entry) int64 {
	if ws := rk.workers[queueIndex(e.queue)]; ws != nil && ws.inFlight != nil && ws.inFlight.BootstrapRoom == e.room {
		return ws.inFlight.Chunk
	}
	return noChunk
}

func queueIndex(q *int) int {
	if q == nil {
		return unknownQueue
	}
	return *q
}
