package watchdog

import (
	"fmt"
	"time"
)

// budget is a rate limit of its own: each counts its requests over any
// 60 s apart from the others.
type budget int

const (
	// budgetDeadline: prefill requests failed after their deadline
	// (MaxPerMinute).
	budgetDeadline budget = iota
	// budgetFailFast: new wedge orders (FailFastPerMinute); one order
	// fails every room behind its wedge, and its renewals are free.
	budgetFailFast
	// budgetDecode: decode releases (DecodePerMinute). Each passed the
	// safety rule (transfer never started, SGLang marked it Failed, or
	// prefill stopped sending), and each prefill release strands one
	// decode request, so they must not compete with prefill for slots.
	budgetDecode
	numBudgets
)

// budget names the rate limit a call for the request takes a slot of.
func (c candidate) budget() budget {
	if c.key.role == RoleDecode {
		return budgetDecode
	}
	return budgetDeadline
}

// limitDetail says, for a skip's log, which budget is spent.
func (w *Watchdog) limitDetail(b budget) string {
	switch b {
	case budgetFailFast:
		return fmt.Sprintf("%d new wedge orders in the last minute already", w.cfg.FailFastPerMinute)
	case budgetDecode:
		return fmt.Sprintf("%d decode releases in the last minute already", w.cfg.DecodePerMinute)
	}
	return fmt.Sprintf("%d force-fail requests in the last minute already", w.cfg.MaxPerMinute)
}

// callAvailable tells whether budget b would let a request through now,
// without taking the slot. Caller holds w.act.
func (w *Watchdog) callAvailable(b budget) bool {
	limit := w.cfg.MaxPerMinute
	switch b {
	case budgetFailFast:
		limit = w.cfg.FailFastPerMinute
	case budgetDecode:
		limit = w.cfg.DecodePerMinute
	}
	now := w.clock.Now()
	kept := w.callTimes[b][:0]
	for _, t := range w.callTimes[b] {
		if now.Sub(t) < time.Minute {
			kept = append(kept, t)
		}
	}
	w.callTimes[b] = kept
	return len(kept) < limit
}

// allowCall takes a slot of budget b over any 60 s. A request takes one
// slot however many PP stages it is called on. Caller holds w.act.
func (w *Watchdog) allowCall(b budget) bool {
	if !w.callAvailable(b) {
		return false
	}
	w.callTimes[b] = append(w.callTimes[b], w.clock.Now())
	return true
}
