package watchdog

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/go-kit/log/level"
)

// A set lever is not a release: confirm waits for the request to leave
// every stage's listing and SGLang's failure counter to rise.
// TriggerRank lets a firing alert walk a rank's stuck requests through
// the same rails.

// confirm settles pending releases: released once the request left every
// stage's listing and SGLang's transfer-failed counter rose past its value
// at the call; unconfirmed after the confirm timeout. One rise confirms one
// release: k releases pending on one counter need a rise of k, oldest
// baseline first. Caller holds w.mu.
func (w *Watchdog) confirm(now time.Time) []Event {
	var events []Event
	if w.metrics != nil {
		for fam, claimed := range w.claimed {
			if v, ok := w.metrics.counter(fam); ok && w.metrics.status.up && v < claimed {
				// SGLang restarted and its counter began again.
				w.claimed[fam] = v
			}
		}
	}
	sort.SliceStable(w.pending, func(i, j int) bool { return w.pending[i].baseline < w.pending[j].baseline })
	kept := w.pending[:0]
	for _, p := range w.pending {
		gone := p.gone()
		rose := true
		if w.metrics != nil {
			v, ok := w.metrics.counter(p.family)
			rose = ok && w.metrics.status.up && v-max(p.baseline, w.claimed[p.family]) >= 1
		}
		ev := Event{Role: p.key.role, Target: p.rank.status.target, DPRank: p.rank.dpLabel, PPRank: p.rank.ppLabel, RID: p.key.rid, Room: p.key.room, Age: p.age, Poll: p.poll, Trigger: p.trigger}
		switch {
		case gone && rose:
			if w.metrics != nil {
				w.claimed[p.family] = max(p.baseline, w.claimed[p.family]) + 1
			}
			w.forceFails[[3]string{ResultReleased, p.trigger, p.key.role}]++
			ev.Kind, ev.Result = EventReleased, ResultReleased
			level.Info(w.logger).Log("msg", "release confirmed", "role", p.key.role, "counter", p.family, "rid", p.key.rid, "room", p.key.room, "target", p.rank.status.target,
				"dp_rank", p.rank.dpLabel, "pp_rank", p.rank.ppLabel, "stages", len(p.stages), "age", fmt.Sprintf("%.1f", p.age), "poll", p.poll, "trigger", p.trigger,
				"after", now.Sub(p.at).Round(time.Millisecond))
			events = append(events, ev)
		case now.Sub(p.at) >= w.cfg.ConfirmTimeout:
			w.forceFails[[3]string{ResultUnconfirmed, p.trigger, p.key.role}]++
			ev.Kind, ev.Result = EventUnconfirmed, ResultUnconfirmed
			level.Error(w.logger).Log("msg", "release not confirmed", "role", p.key.role, "counter", p.family, "rid", p.key.rid, "room", p.key.room, "target", p.rank.status.target,
				"dp_rank", p.rank.dpLabel, "pp_rank", p.rank.ppLabel, "stages", len(p.stages), "age", fmt.Sprintf("%.1f", p.age), "poll", p.poll, "trigger", p.trigger,
				"left_listing", gone, "counter_rose", rose, "reason", "lever set but release not seen within the confirm timeout (one counter rise per release)")
			events = append(events, ev)
		default:
			if gone {
				// The request is gone; only the counter is missing. Ask for
				// an early /metrics read rather than wait a full interval.
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
	// The alert is about stuck requests; early ones are the cycles' own.
	cands := slices.DeleteFunc(w.candidates(w.clock.Now(), func(rk *rankState) bool { return rk.dpLabel == dpRank && rk.ppLabel == ppRank }),
		func(c candidate) bool { return c.early })
	w.mu.Unlock()
	if !found {
		return 0, fmt.Errorf("no plugin rank with dp_rank %d and pp_rank %d", dpRank, ppRank)
	}
	w.actuate(ctx, cands, TriggerAlert, true, time.Time{})
	return len(cands), nil
}
