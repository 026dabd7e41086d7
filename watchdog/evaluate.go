package watchdog

import (
	"fmt"
	"time"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// evaluate is where observing meets deciding, like blackbox_exporter's
// probe function: with every listing of the cycle folded into state, it
// refreshes the verdicts of each rank listed this cycle through the pure
// rules of decide.go, and logs their transitions. The actuator acts on the
// verdicts it leaves in state (candidates, orderCalls, restartCandidate).
// A rank whose listing failed keeps its verdicts: the actuator does not act
// on a rank that is down. Caller holds w.mu.
func (w *Watchdog) evaluate(results []listingResult, now time.Time) []Event {
	var events []Event
	for i, rk := range w.ranks {
		if results[i].err == nil {
			events = append(events, w.evaluateRank(rk, now)...)
		}
	}
	return events
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
	events = append(events, w.evaluateThreads(rk)...)
	events = append(events, w.evaluateTransfers(rk, now)...)

	rk.stuckCount = 0
	rk.oldest = 0
	if rk.byPoll == nil {
		rk.byPoll = make(map[string]int, len(pluginapi.PollStates))
	}
	clear(rk.byPoll)
	if rk.unactionable == nil {
		rk.unactionable = map[string]int{}
	}
	clear(rk.unactionable)
	for key, r := range rk.rooms {
		rk.byPoll[r.poll]++
		if r.age > rk.oldest {
			rk.oldest = r.age
		}
		stuck := roomStuck(key.room, r, rk, now, &w.cfg)
		if stuck {
			rk.stuckCount++
			if st := w.requests[reqKey{role: rk.role, dp: rk.dpLabel, roomKey: key}]; st != nil && !st.done && st.lastSkip != "" {
				rk.unactionable[st.lastSkip]++
			}
		}
		if stuck && !r.stuck {
			level.Warn(w.logger).Log("msg", "request stuck", "role", rk.role, "rid", key.rid, "room", key.room, "target", rk.status.target,
				"dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "age", fmt.Sprintf("%.1f", r.age), "poll", r.poll, "progress", r.progress,
				"reason", stuckReason(key.room, r, rk, now, &w.cfg))
			events = append(events, w.roomEvent(EventStuck, rk, key, r))
		}
		r.stuck = stuck
		r.early = !stuck && decodeEarly(r, rk, now, &w.cfg)
	}
	return events
}

// stuckReason says, for the log, what made a room stuck.
func stuckReason(room uint64, r *roomState, rk *rankState, now time.Time, cfg *Config) string {
	if ws := rk.workers[r.queue]; rk.reportsTransferProgress && r.dqueue == "" && ws != nil && ws.tracked && ws.inFlight != nil && ws.inFlight.BootstrapRoom == room {
		return fmt.Sprintf("its chunk %d (%d pages) held %.1fs by transfer worker %d, past its allowance of %s at the pace of its link %q", ws.inFlight.Chunk, ws.inFlight.Pages,
			ws.inFlight.Seconds, r.queue, chunkAllowance(ws.inFlight.Pages, ws.speed, ws.speedKnown, cfg).Round(time.Second), ws.link)
	}
	if rk.reportsTransferProgress && r.dqueue == "" && rk.deadWorker(r.queue) && r.chunksQueued > 0 {
		return fmt.Sprintf("its transfer worker %d is dead: its %d chunk(s) queued there will never be sent, and none is in flight", r.queue, r.chunksQueued)
	}
	if rank, q, ws := overduePeerChunk(room, rk, now, cfg); ws != nil && rk.reportsTransferProgress && r.dqueue == "" {
		return fmt.Sprintf("its chunk %d (%d pages) held %.1fs by transfer worker %d of rank %s, past its allowance of %s at the pace of that rank's link %q",
			ws.inFlight.Chunk, ws.inFlight.Pages, ws.inFlight.Seconds, q, rank, chunkAllowance(ws.inFlight.Pages, ws.speed, ws.speedKnown, cfg).Round(time.Second), ws.link)
	}
	return fmt.Sprintf("no change of poll, progress or transfer for %s while the scheduler loop ran", now.Sub(r.lastChange).Round(time.Second))
}

// evaluateTransfers refreshes the rank's transfer wedges, and logs and
// counts each new one. Caller holds w.mu.
func (w *Watchdog) evaluateTransfers(rk *rankState, now time.Time) []Event {
	var events []Event
	wedges := transferWedges(rk, now, &w.cfg)
	for q, tw := range wedges {
		if prev, ok := rk.wedges[q]; ok && prev.diagnosed == tw.diagnosed {
			continue
		}
		rk.wedgeCount++
		msg := "transfer queue wedged: its worker holds a chunk far past what its size needs at its link's measured pace; only a restart of the server clears it"
		fields := []interface{}{"target", rk.status.target, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "pid", rk.server.PID,
			"transfer_queue", q, "rule", tw.rule, "room", tw.room, "diagnosed", tw.diagnosed, "orphaned_transfers", len(rk.orphans)}
		switch {
		case !tw.diagnosed:
			msg = "transfer queue suspected wedged: two or more stuck requests in Transferring, and this plugin does not report transfer_in_flight"
		case !wedgeActionable(tw):
			msg = "transfer queue looks wedged, but this plugin does not report transfer_progress, so a slow transfer cannot be told from a stuck one: no wedge order, no restart; its rooms are released at their deadline"
		default:
			ws := rk.workers[q]
			fields = append(fields, "chunk", tw.chunk, "pages", ws.inFlight.Pages, "held_seconds", fmt.Sprintf("%.1f", ws.inFlight.Seconds),
				"allowance", chunkAllowance(ws.inFlight.Pages, ws.speed, ws.speedKnown, &w.cfg).Round(time.Second), "link", ws.link, "speed_known", ws.speedKnown)
		}
		level.Error(w.logger).Log(append([]interface{}{"msg", msg}, fields...)...)
		events = append(events, Event{Kind: EventTransferWedged, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel,
			Room: tw.room, Queue: q, Reason: tw.rule})
	}
	for q, prev := range rk.wedges {
		if _, ok := wedges[q]; !ok {
			// Its order is no longer renewed: it lapses within its ttl, if
			// the plugin has not voided it already. One closing call
			// collects the rooms it failed since the last renewal.
			if o := rk.orders[q]; o != nil && o.placed && !o.cleared && !rk.holds(q, o.chunk) {
				rk.closing = append(rk.closing, o)
			}
			delete(rk.orders, q)
			level.Info(w.logger).Log("msg", "transfer queue no longer wedged", "target", rk.status.target, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel,
				"transfer_queue", q, "rule", prev.rule, "wedged_for", now.Sub(prev.since).Round(time.Second))
		}
	}
	rk.wedges = wedges
	return events
}
