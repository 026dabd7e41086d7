package watchdog

import (
	"fmt"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Decode releases take slots of their own budget, several on one decode
// rank in one cycle, each re-read before its call; the prefill budget and
// prefill's one lever per rank and cycle are untouched.
func TestDecodeBudgetApartFromPrefill(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	// Two prefill rooms on one rank reach their deadline with the decode
	// requests: one lever per prefill rank and cycle, from their budget.
	p.set(room("p1", 101, 100), room("p2", 102, 100))
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	var reqs []pluginapi.DecodeRequest
	for i := range 5 {
		reqs = append(reqs, dreq(fmt.Sprintf("d%d", i), uint64(11+i), pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(false)))
	}
	d.set(reqs...)
	// The prefill budget alone could not release a single decode request.
	h := newDecodeHarness(t, []*fakePlugin{p}, []*fakeDecode{d}, func(c *Config) { c.MaxPerMinute, c.DecodePerMinute = 1, 3 })
	h.tick(79)
	readsBefore := d.reads
	if n := len(d.orders()); n != 0 {
		t.Fatalf("%d decode calls before the decode deadline", n)
	}
	h.tick(1) // every decode request turns 180 s old in this cycle
	orders := d.orders()
	if len(orders) != 3 {
		t.Fatalf("%d decode calls in the cycle they became stuck, want 3 (the decode budget, on one rank)", len(orders))
	}
	for _, o := range orders {
		if o.PrefillStopped {
			t.Fatalf("order %+v asserts prefill_stopped for a transfer that never started", o)
		}
	}
	if got := d.reads - readsBefore; got != 1+3 {
		t.Fatalf("%d decode listing reads in the cycle, want the cycle's own and one re-read per call (4)", got)
	}
	if got := h.skips(SkipRateLimited); got != 2 {
		t.Fatalf("%d decode requests rate-limited, want the 2 over the decode budget", got)
	}
	// Prefill kept its own slot: p1 was released (in an earlier cycle,
	// past its 60 s deadline and stall window), p2 waits out its budget.
	if n := p.callCount(); n != 1 {
		t.Fatalf("%d prefill calls, want 1: the decode releases took none of its budget", n)
	}
	if got := h.wd.Snapshot().RoleSkips[[2]string{SkipRateLimited, RolePrefill}]; got != 1 {
		t.Fatalf("%d prefill requests rate-limited, want 1", got)
	}
	h.tick(59)
	if n := len(d.orders()); n != 3 {
		t.Fatalf("%d decode calls within the minute, want 3", n)
	}
	h.tick(1)
	if n := len(d.orders()); n != 5 {
		t.Fatalf("%d decode calls once the minute passed, want 5 (once each)", n)
	}
}

// Prefill's deadline releases keep one lever per rank and cycle even when
// decode releases run several on a decode rank in the same cycle.
func TestDecodeBudgetKeepsOneLeverPerPrefillRank(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	h := newDecodeHarness(t, []*fakePlugin{p}, []*fakeDecode{d}, nil)
	h.tick(1)
	p.set(room("p1", 101, 0), room("p2", 102, 0))
	d.set(dreq("d1", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 0, boolp(false)),
		dreq("d2", 12, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 0, boolp(false)))
	for i := 0; i < 120 && p.callCount() == 0; i++ {
		h.tick(1)
	}
	if n := p.callCount(); n != 1 {
		t.Fatalf("%d prefill calls in the cycle its rooms became stuck, want 1 (one lever per prefill rank and cycle)", n)
	}
	h.tick(1)
	if n := p.callCount(); n != 2 {
		t.Fatalf("%d prefill calls a cycle later, want 2", n)
	}
	for i := 0; i < 240 && len(d.orders()) == 0; i++ {
		h.tick(1)
	}
	if n := len(d.orders()); n != 2 {
		t.Fatalf("%d decode calls in the cycle they became stuck, want 2 (both queues, one rank)", n)
	}
}

// Started transfers stay held whatever the decode budget: only a "stopped"
// verdict or a Failed poll releases one, in the same cycle as the others.
func TestDecodeBudgetStillHoldsStartedTransfers(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.set(dreq("live", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(true)),
		dreq("unknown", 12, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, nil),
		dreq("stopped", 13, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(true)),
		dreq("failed", 14, pluginapi.DecodeQueueTransfer, pluginapi.PollFailed, 100, boolp(true)),
		dreq("fresh", 15, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(false)))
	v := &fakeVerdicts{answer: func(_ string, room uint64) (pluginapi.RoomVerdict, error) {
		if room == 13 {
			return pluginapi.RoomVerdict{Room: "13", Verdict: pluginapi.VerdictStopped}, nil
		}
		return pluginapi.RoomVerdict{Room: "x", Verdict: pluginapi.VerdictLive}, nil
	}}
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = v })
	h.tick(80)
	got := map[string]bool{}
	for _, o := range d.orders() {
		got[o.RID] = o.PrefillStopped
	}
	want := map[string]bool{"stopped": true, "failed": true, "fresh": false}
	if len(got) != len(want) {
		t.Fatalf("released %v in one cycle, want %v", got, want)
	}
	for rid, ps := range want {
		if s, ok := got[rid]; !ok || s != ps {
			t.Fatalf("released %v (rid: prefill_stopped), want %v", got, want)
		}
	}
	h.tick(120)
	if n := len(d.orders()); n != 3 {
		t.Fatalf("%d calls after 120 s more; the live and unknown transfers must stay held", n)
	}
	if got := h.skips(SkipTransferLive); got != 2 {
		t.Fatalf("%d transfer_live skips, want 2", got)
	}
}

// Over a saturated decode budget the youngest stuck requests go first
// (among those that need a verdict lookup, as among those that need none):
// SGLang's own 300 s timeout frees the oldest soon anyway. A request over
// the budget costs no verdict lookup and no re-read.
func TestDecodeBudgetYoungestFirstAndFreeWhenSpent(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	// First seen past the decode deadline (a watchdog restart, say): all
	// three become stuck in one cycle, once the stall window has passed.
	d.set(dreq("old", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 260, boolp(true)),
		dreq("mid", 12, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 230, boolp(true)),
		dreq("young", 13, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 200, boolp(true)))
	v := &fakeVerdicts{answer: verdictOf(pluginapi.VerdictStopped)}
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts, c.DecodePerMinute = v, 1 })
	for i := 0; i < 60 && len(d.orders()) == 0; i++ {
		h.tick(1)
	}
	if got := h.rank(RoleDecode).Stuck; got != 3 {
		t.Fatalf("%d stuck, want all three at once", got)
	}
	orders := d.orders()
	if len(orders) != 1 || orders[0].RID != "young" {
		t.Fatalf("orders %+v, want only the youngest", orders)
	}
	lookups, reads := v.count(), d.reads
	h.tick(30)
	if n := len(d.orders()); n != 1 {
		t.Fatalf("%d calls within the minute, want 1", n)
	}
	if v.count() != lookups || d.reads != reads+30 {
		t.Fatalf("%d verdict lookups and %d re-reads for requests over the budget, want none", v.count()-lookups, d.reads-reads-30)
	}
	h.tick(30)
	if orders := d.orders(); len(orders) != 2 || orders[1].RID != "mid" {
		t.Fatalf("orders %+v, want the next youngest once the minute passed", orders)
	}
}
