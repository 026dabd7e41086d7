package watchdog

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"time"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// The actuator is the only code that changes anything outside this process.
// Every rail lives here: the mode, at most one successful call per room,
// bounded retries after errors, the global rate limit, the re-read of the
// listing right before the call, and the confirmation of the release.

// candidate is a stuck room as seen when the decision was made.
type candidate struct {
	rank     *rankState
	key      roomKey
	poll     string
	progress int64
	age      float64
}

// candidates lists stuck rooms that may be acted on, oldest first. Caller
// holds w.mu.
func (w *Watchdog) candidates(now time.Time, onRank func(*rankState) bool) []candidate {
	var out []candidate
	for _, rk := range w.ranks {
		// Never act on a rank whose last listing failed or whose loop is
		// not running: the observations could be stale.
		if !rk.status.up || rk.wedged || (onRank != nil && !onRank(rk)) {
			continue
		}
		for key, r := range rk.rooms {
			if !r.stuck || r.done || r.acting || now.Before(r.nextAttempt) {
				continue
			}
			out = append(out, candidate{rank: rk, key: key, poll: r.poll, progress: r.progress, age: r.age})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].age != out[j].age {
			return out[i].age > out[j].age
		}
		return out[i].key.rid < out[j].key.rid
	})
	return out
}

// actuate walks the candidates through the rails. asAuto makes a dry-run
// watchdog act for real (the Alertmanager trigger); mode off always wins.
func (w *Watchdog) actuate(ctx context.Context, cands []candidate, trigger string, asAuto bool, until time.Time) {
	if len(cands) == 0 {
		return
	}
	w.act.Lock()
	defer w.act.Unlock()
	flipped := map[*rankState]bool{}
	for _, c := range cands {
		if ctx.Err() != nil {
			return
		}
		// A cycle stops starting calls once its interval is spent: the rest
		// are decided again on the next cycle's listings.
		if !until.IsZero() && !w.clock.Now().Before(until) {
			return
		}
		// A lever set on a rank may unblock its other rooms (a wedged
		// transfer shard): decide on them from the next listing.
		if flipped[c.rank] {
			continue
		}
		evs := w.actOne(ctx, c, trigger, asAuto)
		for _, e := range evs {
			if e.Kind == EventForceFail && (e.Result == pluginapi.ResultFlipped || e.Result == pluginapi.ResultAlreadyFailed) {
				flipped[c.rank] = true
			}
		}
		w.emit(evs)
	}
}

// actOne takes one candidate through the rails.
func (w *Watchdog) actOne(ctx context.Context, c candidate, trigger string, asAuto bool) []Event {
	mode := w.Mode()
	if asAuto && mode != ModeOff {
		mode = ModeAuto
	}
	if mode == ModeOff {
		return w.skip(c, SkipModeOff, trigger, "force-fail mode is off")
	}
	if mode == ModeDryRun && w.dryRan(c) {
		return nil
	}
	// The re-read below costs the plugin a full listing: only make it for
	// a call the rate limit would let through.
	if !w.callAvailable() {
		return w.skip(c, SkipRateLimited, trigger, fmt.Sprintf("%d force-fail calls in the last minute already", w.cfg.MaxPerMinute))
	}
	// Re-read the listing: the request must be there, unchanged, right
	// before the call. Progress that arrived since the decision cancels it.
	l, err := c.rank.source.Inflight(ctx)
	if err != nil {
		return w.skip(c, SkipSourceDown, trigger, "re-reading the listing failed: "+err.Error())
	}
	var now *pluginapi.Room
	for i := range l.Inflight {
		if l.Inflight[i].RID == c.key.rid && l.Inflight[i].BootstrapRoom == c.key.room {
			now = &l.Inflight[i]
			break
		}
	}
	if now == nil {
		return w.skip(c, SkipGone, trigger, "the request left the listing before the call")
	}
	if now.Poll != c.poll || now.Progress != c.progress || l.Loop.Iterations < c.rank.iterations {
		return w.skip(c, SkipProgressed, trigger, fmt.Sprintf("poll %s→%s, progress %d→%d since the decision", c.poll, now.Poll, c.progress, now.Progress))
	}
	if !w.allowCall() {
		return w.skip(c, SkipRateLimited, trigger, fmt.Sprintf("%d force-fail calls in the last minute already", w.cfg.MaxPerMinute))
	}

	w.mu.Lock()
	r, ok := c.rank.rooms[c.key]
	if !ok || r.done || r.acting {
		w.mu.Unlock()
		return nil
	}
	r.acting = true
	// The baseline for confirming the release is taken before the call: a
	// /metrics read landing between the release and the answer would
	// otherwise already count it, and the counter would never rise past it.
	baseline := 0.0
	if w.metrics != nil {
		baseline, _ = w.metrics.transferFailed()
	}
	w.mu.Unlock()

	room := c.key.room
	reason := fmt.Sprintf("sglang-watchdog: stuck %.0fs in %s with no progress for %s", now.AgeSeconds, now.Poll, w.cfg.StallWindow)
	order := pluginapi.ForceFailRequest{RID: c.key.rid, BootstrapRoom: &room, Reason: reason, DryRun: mode == ModeDryRun}
	status, resp, err := c.rank.source.ForceFail(ctx, order)
	at := w.clock.Now()

	w.mu.Lock()
	defer w.mu.Unlock()
	r.acting = false
	result, wait := classify(status, resp, err)
	logger := level.Info(w.logger)
	if result == ResultError || result == ResultRejected || result == ResultNotFound {
		logger = level.Error(w.logger)
	}
	fields := []interface{}{"msg", "force-fail call", "rid", c.key.rid, "room", c.key.room, "target", c.rank.status.target,
		"dp_rank", c.rank.dpLabel, "pp_rank", c.rank.ppLabel, "age", fmt.Sprintf("%.1f", now.AgeSeconds), "poll", now.Poll,
		"progress", now.Progress, "mode", mode, "trigger", trigger, "http_status", status, "reason", reason}
	if resp != nil {
		fields = append(fields, "plugin_result", resp.Result, "lever", resp.Lever)
	}
	if err != nil {
		fields = append(fields, "err", err)
	}
	ev := Event{Kind: EventForceFail, Target: c.rank.status.target, DPRank: c.rank.dpLabel, PPRank: c.rank.ppLabel,
		RID: c.key.rid, Room: c.key.room, Age: now.AgeSeconds, Poll: now.Poll, Progress: now.Progress, Trigger: trigger}
	switch {
	case wait:
		r.done = true
		w.pending = append(w.pending, &pending{key: c.key, rank: c.rank, trigger: trigger, at: at, baseline: baseline, age: now.AgeSeconds, poll: now.Poll})
		ev.Result = resp.Result
		logger.Log(append(fields, "result", "awaiting_confirmation")...)
	case result == ResultError:
		r.attempts++
		if r.attempts >= w.cfg.MaxAttempts {
			r.done = true
		} else {
			r.nextAttempt = at.Add(w.cfg.RetryBackoff << (r.attempts - 1))
		}
		w.forceFails[[2]string{result, trigger}]++
		ev.Result = result
		logger.Log(append(fields, "result", result, "attempts", r.attempts, "retry", !r.done)...)
	case result == ResultWouldFlip:
		r.dryRan = true
		w.forceFails[[2]string{result, trigger}]++
		ev.Result = result
		logger.Log(append(fields, "result", result)...)
	default:
		r.done = true
		w.forceFails[[2]string{result, trigger}]++
		ev.Result = result
		logger.Log(append(fields, "result", result)...)
	}
	return []Event{ev}
}

// dryRan tells whether the room already had its dry run: a dry run is
// made once per room, and a switch to auto mode may still act on it.
func (w *Watchdog) dryRan(c candidate) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	r, ok := c.rank.rooms[c.key]
	return !ok || r.dryRan
}

// classify maps an admin-call answer to a result. wait is true when the
// lever is set and the release still has to be confirmed.
func classify(status int, resp *pluginapi.ForceFailResponse, err error) (result string, wait bool) {
	if err != nil || resp == nil {
		return ResultError, false
	}
	switch {
	case status == http.StatusOK && (resp.Result == pluginapi.ResultFlipped || resp.Result == pluginapi.ResultAlreadyFailed):
		return "", true
	case status == http.StatusOK && resp.Result == pluginapi.ResultWouldFlip:
		return ResultWouldFlip, false
	case status == http.StatusNotFound:
		return ResultNotFound, false
	case status == http.StatusBadRequest || status == http.StatusUnauthorized || status == http.StatusConflict:
		return ResultRejected, false
	default:
		return ResultError, false
	}
}

// callAvailable tells whether the rate limit would let a call through now,
// without taking the slot. Caller holds w.act.
func (w *Watchdog) callAvailable() bool {
	now := w.clock.Now()
	kept := w.callTimes[:0]
	for _, t := range w.callTimes {
		if now.Sub(t) < time.Minute {
			kept = append(kept, t)
		}
	}
	w.callTimes = kept
	return len(w.callTimes) < w.cfg.MaxPerMinute
}

// allowCall takes a slot of the global limit on admin calls over any 60 s.
// Caller holds w.act.
func (w *Watchdog) allowCall() bool {
	if !w.callAvailable() {
		return false
	}
	w.callTimes = append(w.callTimes, w.clock.Now())
	return true
}

// skip counts a reason once per room, so that a request waiting out the
// rate limit is not counted every cycle.
func (w *Watchdog) skip(c candidate, reason, trigger, detail string) []Event {
	w.mu.Lock()
	defer w.mu.Unlock()
	r, ok := c.rank.rooms[c.key]
	if !ok {
		return nil
	}
	if r.skipped == nil {
		r.skipped = map[string]bool{}
	}
	if r.skipped[reason] {
		return nil
	}
	r.skipped[reason] = true
	w.skips[reason]++
	level.Warn(w.logger).Log("msg", "stuck request not force-failed", "rid", c.key.rid, "room", c.key.room, "target", c.rank.status.target,
		"dp_rank", c.rank.dpLabel, "pp_rank", c.rank.ppLabel, "age", fmt.Sprintf("%.1f", c.age), "poll", c.poll,
		"skip", reason, "trigger", trigger, "reason", detail)
	return []Event{{Kind: EventSkipped, Target: c.rank.status.target, DPRank: c.rank.dpLabel, PPRank: c.rank.ppLabel,
		RID: c.key.rid, Room: c.key.room, Age: c.age, Poll: c.poll, Progress: c.progress, Reason: reason, Trigger: trigger}}
}

// confirm settles pending releases: released once the room left the
// listing and SGLang's transfer-failed counter rose past its value at the
// flip; unconfirmed after the confirm timeout. Caller holds w.mu.
func (w *Watchdog) confirm(now time.Time) []Event {
	var events []Event
	kept := w.pending[:0]
	for _, p := range w.pending {
		rose := true
		if w.metrics != nil {
			v, ok := w.metrics.transferFailed()
			rose = ok && w.metrics.status.up && v > p.baseline
		}
		ev := Event{Target: p.rank.status.target, DPRank: p.rank.dpLabel, PPRank: p.rank.ppLabel, RID: p.key.rid, Room: p.key.room, Age: p.age, Poll: p.poll, Trigger: p.trigger}
		switch {
		case p.gone && rose:
			w.forceFails[[2]string{ResultReleased, p.trigger}]++
			ev.Kind, ev.Result = EventReleased, ResultReleased
			level.Info(w.logger).Log("msg", "release confirmed", "rid", p.key.rid, "room", p.key.room, "target", p.rank.status.target,
				"dp_rank", p.rank.dpLabel, "pp_rank", p.rank.ppLabel, "age", fmt.Sprintf("%.1f", p.age), "poll", p.poll, "trigger", p.trigger,
				"after", now.Sub(p.at).Round(time.Millisecond))
			events = append(events, ev)
		case now.Sub(p.at) >= w.cfg.ConfirmTimeout:
			w.forceFails[[2]string{ResultUnconfirmed, p.trigger}]++
			ev.Kind, ev.Result = EventUnconfirmed, ResultUnconfirmed
			level.Error(w.logger).Log("msg", "release not confirmed", "rid", p.key.rid, "room", p.key.room, "target", p.rank.status.target,
				"dp_rank", p.rank.dpLabel, "pp_rank", p.rank.ppLabel, "age", fmt.Sprintf("%.1f", p.age), "poll", p.poll, "trigger", p.trigger,
				"left_listing", p.gone, "counter_rose", rose, "reason", "lever set but release not seen within the confirm timeout")
			events = append(events, ev)
		default:
			if p.gone {
				// The room is gone; only the counter is missing. Ask for an
				// early /metrics read rather than wait a full interval.
				select {
				case w.scrapeNow <- struct{}{}:
				default:
				}
			}
			kept = append(kept, p)
		}
	}
	w.pending = kept
	return events
}

// TriggerRank force-fails the stuck requests of one rank on behalf of a
// firing alert, through the same rails as auto mode. It returns how many
// stuck requests it walked through the rails.
func (w *Watchdog) TriggerRank(ctx context.Context, dpRank, ppRank int) (int, error) {
	w.mu.Lock()
	if w.mode == ModeOff {
		w.mu.Unlock()
		return 0, fmt.Errorf("force-fail mode is off")
	}
	found := false
	for _, rk := range w.ranks {
		if rk.listed && rk.dpLabel == dpRank && rk.ppLabel == ppRank {
			found = true
		}
	}
	cands := w.candidates(w.clock.Now(), func(rk *rankState) bool { return rk.dpLabel == dpRank && rk.ppLabel == ppRank })
	w.mu.Unlock()
	if !found {
		return 0, fmt.Errorf("no plugin rank with dp_rank %d and pp_rank %d", dpRank, ppRank)
	}
	w.actuate(ctx, cands, TriggerAlert, true, time.Time{})
	return len(cands), nil
}
