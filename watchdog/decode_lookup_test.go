package watchdog

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Issue 18: with a prefill peer that times out, a releasable decode
// request (no transfer started) sorted behind held ones was released once
// in 120 cycles. Requests that need no lookup are decided first, and a
// cycle's lookups stop once half its interval is spent.
func TestDecodeLookupsCannotStarveReleasableRequests(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	// The held ones are younger: youngest first put them ahead before.
	d.set(dreq("held1", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 150, boolp(true)),
		dreq("held2", 12, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 151, boolp(true)),
		dreq("held3", 13, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 152, boolp(true)),
		dreq("free", 14, pluginapi.DecodeQueuePrealloc, pluginapi.PollBootstrapping, 160, boolp(false)))
	var h *decodeHarness
	perCycle := map[int]int{}
	cycle, beforeRelease := 0, 0
	v := &fakeVerdicts{answer: func(string, uint64) (pluginapi.RoomVerdict, error) {
		perCycle[cycle]++
		if len(d.orders()) == 0 {
			beforeRelease++
		}
		h.clk.Advance(600 * time.Millisecond) // the peer's timeout
		return pluginapi.RoomVerdict{}, errors.New("prefill watchdog: context deadline exceeded")
	}}
	h = newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = v })
	for cycle = 0; cycle < 40 && len(d.orders()) == 0; cycle++ {
		h.tick(1)
	}
	if h.rank(RoleDecode).Stuck != 4 {
		t.Fatalf("%d stuck, want all four", h.rank(RoleDecode).Stuck)
	}
	if o := d.orders(); len(o) != 1 || o[0].RID != "free" || o[0].PrefillStopped {
		t.Fatalf("orders %+v, want the request without a transfer released in the first stuck cycle", o)
	}
	if beforeRelease != 0 {
		t.Fatalf("%d lookups before the releasable request was decided, want none", beforeRelease)
	}
	for end := cycle + 3; cycle < end; cycle++ {
		h.tick(1)
		if perCycle[cycle] != 1 {
			t.Fatalf("cycle %d made %d lookups of 600 ms, want one (half the 1 s interval)", cycle, perCycle[cycle])
		}
	}
}

// A lookup runs under what is left of the actuation's lookup time.
func TestDecodeLookupContextCarriesTheBudget(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.set(dreq("held", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 179, boolp(true)))
	var left time.Duration
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) {
		c.Verdicts = verdictFunc(func(ctx context.Context, _ pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error) {
			if dl, ok := ctx.Deadline(); ok {
				left = time.Until(dl)
			}
			return pluginapi.RoomVerdict{Verdict: pluginapi.VerdictLive}, nil
		})
	})
	h.tick(32)
	if left <= 0 || left > 500*time.Millisecond {
		t.Fatalf("lookup deadline in %v, want within half the 1 s interval", left)
	}
}

type verdictFunc func(context.Context, pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error)

func (f verdictFunc) Verdict(ctx context.Context, q pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error) {
	return f(ctx, q)
}

// A decode request's lookup names the prefill ranks its listing gave, so
// that a prefill instance on several nodes is asked where the room's ranks
// run, not only on the bootstrap server's node.
func TestDecodeLookupCarriesPrefillRankAddrs(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	r := dreq("held", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 179, boolp(true))
	r.PrefillRankAddrs = []string{"127.0.0.2:40001", "127.0.0.3:40001"}
	d.set(r)
	var got pluginapi.VerdictQuery
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) {
		c.Verdicts = verdictFunc(func(_ context.Context, q pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error) {
			got = q
			return pluginapi.RoomVerdict{Verdict: pluginapi.VerdictLive}, nil
		})
	})
	h.tick(32)
	if got.RID != "held" || got.BootstrapAddr != "127.0.0.1:8998" || !slices.Equal(got.PrefillRankAddrs, r.PrefillRankAddrs) {
		t.Fatalf("lookup %+v, want the request's bootstrap_addr and prefill_rank_addrs", got)
	}
}
