package watchdog

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// earlySettle is how old a "stopped" verdict must be before it releases
// a decode request early (decodeEarly). The prefill lever marks the room
// Failed, and SGLang's transfer workers (v0.5.18, nixl/conn.py and
// mooncake/conn.py, transfer_worker) then drop every chunk of the room
// they take; a chunk taken before the lever landed is counted outstanding
// from that moment, so the prefill watchdog lists it as an orphan, which
// turns the verdict live. 5 s is five prefill listings at the default 1 s
// interval for such an orphan to show before decode frees the pages. A
// request past the decode deadline needs no such wait: prefill released
// it at least the decode deadline less the prefill deadline ago.
const earlySettle = 5 * time.Second

// startLookups gives one actuation its time for prefill verdict lookups:
// half the cycle interval. A peer that times out then holds up a cycle by
// that much at most, and the requests that need no lookup, decided first,
// never wait for it (issue 18: one releasable request sorted behind held
// ones was released once in 120 cycles). Caller holds w.act.
func (w *Watchdog) startLookups() {
	w.lookupLeft = w.cfg.Interval / 2
}

// needsVerdict tells whether the safety rule must ask the prefill side
// before the decode request can be released: its transfer may have started
// and not finished on some stage.
func needsVerdict(c candidate) bool {
	if c.key.role != RoleDecode {
		return false
	}
	for _, s := range c.stages {
		if decodeSafety(s.poll, s.started) == needVerdict {
			return true
		}
	}
	return false
}

// decodeCleared applies the safety rule to a decode request on every
// stage that holds it: a transfer that may have started and not finished
// is released only when SGLang marked the request Failed or the prefill
// side's verdict is "stopped"; anything else holds it (cleared false, with
// the skip's events). prefillStopped is the assertion the order may carry.
// Once the actuation's lookup time is spent, a request that needs a lookup
// is left, without a skip, to the next cycle. Caller holds w.act.
func (w *Watchdog) decodeCleared(ctx context.Context, c candidate, trigger string) (prefillStopped, cleared bool, held []Event) {
	if !needsVerdict(c) {
		failed := len(c.stages) > 0
		for _, s := range c.stages {
			failed = failed && decodeSafety(s.poll, s.started) == clearFailed
		}
		return failed, true, nil
	}
	if w.lookupLeft <= 0 {
		return false, false, nil
	}
	lookupCtx, cancel := context.WithTimeout(ctx, w.lookupLeft)
	start := w.clock.Now()
	v, err := w.lookupVerdict(lookupCtx, verdictQueryOf(c))
	cancel()
	w.lookupLeft -= w.clock.Now().Sub(start)
	switch {
	case err != nil:
		return false, false, w.skip(c, SkipTransferLive, trigger, "held: transfer may be live: the prefill verdict is not available: "+err.Error())
	case v.Verdict != pluginapi.VerdictStopped:
		return false, false, w.skip(c, SkipTransferLive, trigger, fmt.Sprintf("held: transfer may be live: prefill verdict %s (%s); SGLang's own timeout releases it", v.Verdict, v.Reason))
	case c.early && v.ReleasedSecondsAgo < earlySettle.Seconds():
		return false, false, w.skip(c, SkipTransferLive, trigger, fmt.Sprintf("prefill stopped the transfer %.1fs ago; an early release waits %s for an orphan to show", v.ReleasedSecondsAgo, earlySettle))
	}
	return true, true, nil
}

// verdictQueryOf names the decode request to the prefill side: its rid,
// its room and its youngest stage's age, so that no release from before
// any stage first saw it can answer for it; and where to ask, its prefill
// ranks' hosts.
func verdictQueryOf(c candidate) pluginapi.VerdictQuery {
	age := math.Inf(1)
	for _, s := range c.stages {
		age = min(age, s.age)
	}
	return pluginapi.VerdictQuery{BootstrapAddr: c.stages[0].addr, PrefillRankAddrs: c.stages[0].prefillAddrs, Room: c.key.room, RID: c.key.rid, AgeSeconds: age}
}
