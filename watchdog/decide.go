package watchdog

import (
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Decisions are pure functions of state, configuration and the clock, so
// that they can be tested on a fake clock without HTTP.

// roomStuck tells whether a request is stuck: older than its role's
// deadline, with neither poll nor progress (nor, on decode, its queue)
// changing for the stall window, while the scheduler loop kept
// running (otherwise every room looks frozen and the observations are
// stale), and not one of SGLang's own health checks nor a decode request
// waiting for KV pages (SGLang never times those out: issue 18).
func roomStuck(r *roomState, rk *rankState, now time.Time, cfg *Config) bool {
	if r.health || r.waitingMemory {
		return false
	}
	deadline := cfg.Deadline
	if r.dqueue != "" {
		deadline = cfg.DecodeDeadline
	}
	if r.age < deadline.Seconds() {
		return false
	}
	if now.Sub(r.lastChange) < cfg.StallWindow {
		return false
	}
	return rk.loopAdvancing && rk.iterations > r.iterAtChange
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
	wedgeInFlight  = "in_flight"
	wedgeOrphaned  = "orphaned_transfer"
	wedgeSuspected = "suspected"
)

// unknownQueue keys a wedge whose transfer queue is not known.
const unknownQueue = -1

// transferWedges diagnoses the wedged transfer queues of a rank (in SGLang
// v0.5.18, NixlKVManager.transfer_worker in
// python/sglang/srt/disaggregation/nixl/conn.py handles one chunk at a time
// and polls its handles with no deadline, so a handle that never completes
// holds every later room on its queue):
//   - a room with a transfer in flight that is stuck (old, no change for the
//     stall window while the loop ran) wedges its queue;
//   - an orphaned transfer on queue Q, listed for the stall window, wedges
//     Q while a room on Q has waited the stall window unchanged and no room
//     on Q changed in that window (departures are not counted: aborts and
//     force-fails leave as well);
//   - with an older plugin (no transfer_in_flight), two or more stuck rooms
//     in Transferring make the rank suspected (queue unknown).
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
	out := map[int]*transferWedge{}
	evidence := map[int]bool{}
	waiting := map[int]bool{} // a room on the queue waited the stall window unchanged
	suspects := 0
	var suspectRoom uint64
	for key, r := range rk.rooms {
		stuck := roomStuck(r, rk, now, cfg)
		if r.inFlightKnown && r.inFlight && stuck {
			evidence[r.queue] = true
			if _, ok := out[r.queue]; !ok {
				out[r.queue] = &transferWedge{diagnosed: true, rule: wedgeInFlight, room: key.room}
			}
		}
		if !r.inFlightKnown && stuck && r.poll == "Transferring" {
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
		out[o.queue] = &transferWedge{diagnosed: true, rule: wedgeOrphaned, room: room}
	}
	for q, prev := range rk.wedges {
		if _, ok := out[q]; !ok && prev.diagnosed && evidence[q] {
			out[q] = prev
		}
	}
	if suspects >= 2 {
		if _, ok := out[unknownQueue]; !ok {
			out[unknownQueue] = &transferWedge{rule: wedgeSuspected, room: suspectRoom}
		}
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

// failFastEligible tells whether a room is queued behind a diagnosed
// transfer wedge on its rank and can never finish: its queue is wedged, it
// has no transfer in flight (so its pages are not being written) and it
// has not changed since first sight. Health checks never are.
func failFastEligible(r *roomState, rk *rankState) bool {
	if r.health || !r.inFlightKnown || r.inFlight || r.queue == unknownQueue || !r.lastChange.Equal(r.firstSeen) {
		return false
	}
	w, ok := rk.wedges[r.queue]
	return ok && w.diagnosed && rk.loopAdvancing
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
