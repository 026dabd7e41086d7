package watchdog

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func TestDecodeEarly(t *testing.T) {
	cfg := testConfig() // deadline 60 s, stall window 30 s
	now := time.Unix(1_700_000_000, 0)
	rk := &rankState{role: RoleDecode, loopAdvancing: true, iterations: 10}
	base := roomState{dqueue: pluginapi.DecodeQueueTransfer, poll: pluginapi.PollWaitingForInput, started: true, age: 61,
		lastChange: now.Add(-31 * time.Second), iterAtChange: 5}
	for _, tc := range []struct {
		name string
		mut  func(*roomState)
		want bool
	}{
		{"transfer started, past the prefill deadline, stalled", func(*roomState) {}, true},
		{"younger than the prefill deadline: prefill released nothing that young", func(r *roomState) { r.age = 59 }, false},
		{"changed within the stall window", func(r *roomState) { r.lastChange = now.Add(-10 * time.Second) }, false},
		{"loop did not run since the change", func(r *roomState) { r.iterAtChange = 10 }, false},
		{"transfer not started: the deadline rule", func(r *roomState) { r.started = false }, false},
		{"SGLang marked it Failed: the deadline rule", func(r *roomState) { r.poll = pluginapi.PollFailed }, false},
		{"waiting for memory", func(r *roomState) { r.waitingMemory = true }, false},
		{"health check", func(r *roomState) { r.health = true }, false},
		{"a prefill room", func(r *roomState) { r.dqueue = "" }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := base
			tc.mut(&r)
			if got := decodeEarly(&r, rk, now, &cfg); got != tc.want {
				t.Fatalf("decodeEarly = %v, want %v", got, tc.want)
			}
		})
	}
}

// Issue 18: after the prefill watchdog released a pinned room with
// "stopped", its decode side waited for the decode deadline (180 s), and
// the client, whose router waits for both legs, with it. Now it is
// released once the verdict settled: within the prefill deadline + 10 s.
func TestDecodeReleasedSoonAfterPrefillStopped(t *testing.T) {
	h, p, d := combined(t, r2room("a", 11, 0, 0, false))
	d.update("a", func(r *pluginapi.DecodeRequest) { r.AgeSeconds = 0 })
	start := h.clk.Now() // decode's age counts from here, as prefill's does
	released := releasePrefill(t, h, p)
	for len(d.orders()) == 0 && h.clk.Now().Sub(released) < time.Minute {
		h.tick(1)
	}
	o := d.orders()
	if len(o) != 1 || !o[0].PrefillStopped {
		t.Fatalf("decode orders %+v, want one with prefill_stopped", o)
	}
	if age, limit := h.clk.Now().Sub(start), h.wd.cfg.Deadline+10*time.Second; age > limit {
		t.Fatalf("decode released at age %s, want within the prefill deadline + 10 s (%s)", age, limit)
	}
	h.tick(1)
	// One rise for the prefill release (this harness reads both roles'
	// counters from one /metrics), one for the decode release.
	h.rise(TransferFailedFamily, 2)
	if h.forceFails(ResultReleased) != 1 {
		t.Fatalf("force-fails %v, want one decode release confirmed", h.wd.Snapshot().RoleForceFails)
	}
	if got := h.rank(RoleDecode).Stuck; got != 0 {
		t.Fatalf("%d decode requests counted stuck; an early release is of none", got)
	}
}

// Anything but a settled "stopped" holds a decode request short of its
// deadline, silently: it is not stuck, so no skip is counted and no
// listing re-read, until the deadline rule takes over as before.
func TestDecodeEarlyHolds(t *testing.T) {
	stopped := func(ago float64) *fakeVerdicts {
		return &fakeVerdicts{answer: func(string, uint64) (pluginapi.RoomVerdict, error) {
			return pluginapi.RoomVerdict{Room: "11", RID: "a", Verdict: pluginapi.VerdictStopped, ReleasedSecondsAgo: ago}, nil
		}}
	}
	for _, tc := range []struct {
		name     string
		verdicts *fakeVerdicts
		held     bool // still held past the decode deadline
	}{
		{"unknown", &fakeVerdicts{answer: verdictOf(pluginapi.VerdictUnknown)}, true},
		{"live", &fakeVerdicts{answer: verdictOf(pluginapi.VerdictLive)}, true},
		{"in_queue", &fakeVerdicts{answer: verdictOf(pluginapi.VerdictInQueue)}, true},
		{"peer unreachable", &fakeVerdicts{answer: func(string, uint64) (pluginapi.RoomVerdict, error) {
			return pluginapi.RoomVerdict{}, errors.New("connection refused")
		}}, true},
		// Released just now, again and again: an orphan may still show.
		{"stopped, not settled", stopped(1), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newFakeDecode("http://127.0.0.1:30200", 0)
			d.set(dreq("a", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 30, boolp(true)))
			h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = tc.verdicts })
			h.tick(29)
			if n := tc.verdicts.count(); n != 0 {
				t.Fatalf("%d lookups below the prefill deadline, want none", n)
			}
			h.tick(120) // age 179
			if n := len(d.orders()); n != 0 {
				t.Fatalf("%d force-fail calls short of the decode deadline", n)
			}
			if tc.verdicts.count() == 0 || d.reads != 149 {
				t.Fatalf("%d lookups, %d listing reads in 149 cycles; want lookups and no re-read", tc.verdicts.count(), d.reads)
			}
			skips := uint64(0)
			for _, n := range h.wd.Snapshot().RoleSkips {
				skips += n
			}
			if skips != 0 || h.rank(RoleDecode).Stuck != 0 {
				t.Fatalf("%d skips, stuck %d; a request short of its deadline is neither", skips, h.rank(RoleDecode).Stuck)
			}
			h.tick(1) // the decode deadline: stuck, and today's rule
			if got := len(d.orders()) == 0; got != tc.held {
				t.Fatalf("held at the decode deadline: %v, want %v (orders %+v)", got, tc.held, d.orders())
			}
			if tc.held && h.skips(SkipTransferLive) != 1 {
				t.Fatalf("%d transfer_live skips at the decode deadline, want 1", h.skips(SkipTransferLive))
			}
		})
	}
}

// Early candidates look their verdicts up under the actuation's lookup
// time: a peer that times out costs a cycle one lookup, however many
// decode requests wait on it, and the request that needs no lookup is
// still released in the cycle it becomes stuck.
func TestDecodeEarlyLookupsWithinBudget(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	reqs := []pluginapi.DecodeRequest{dreq("free", 10, pluginapi.DecodeQueuePrealloc, pluginapi.PollBootstrapping, 150, boolp(false))}
	for i := range 3 {
		reqs = append(reqs, dreq(fmt.Sprintf("early%d", i), uint64(11+i), pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, float64(100+i), boolp(true)))
	}
	d.set(reqs...)
	var clk interface{ Advance(time.Duration) }
	v := &fakeVerdicts{answer: func(string, uint64) (pluginapi.RoomVerdict, error) {
		clk.Advance(600 * time.Millisecond) // the peer's timeout
		return pluginapi.RoomVerdict{}, errors.New("prefill watchdog: context deadline exceeded")
	}}
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = v })
	clk = h.clk
	h.tick(30) // first seen in the first cycle: the stall window is not over
	if n := v.count() + len(d.orders()); n != 0 {
		t.Fatalf("%d lookups and calls within the stall window", n)
	}
	for i := range 6 {
		before := v.count()
		h.tick(1)
		if got := v.count() - before; got != 1 {
			t.Fatalf("cycle %d made %d lookups of 600 ms, want one (half the 1 s interval)", i, got)
		}
		if o := d.orders(); len(o) != 1 || o[0].RID != "free" {
			t.Fatalf("orders %+v, want the request without a transfer released as it became stuck", o)
		}
	}
}

// A request released early goes before requests stranded at the decode
// deadline when the decode budget cannot take both: behind a wedge,
// fail-fast strands 150 decode requests a minute, which took every slot
// while a pin's client waited for SGLang's timeout (bench/quality).
func TestDecodeEarlyBeforeTheDeadlineFlood(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.set(dreq("flood", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollBootstrapping, 150, boolp(false)),
		dreq("pin", 12, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 60, boolp(true)))
	v := &fakeVerdicts{answer: func(_ string, room uint64) (pluginapi.RoomVerdict, error) {
		return pluginapi.RoomVerdict{Room: "12", RID: "pin", Verdict: pluginapi.VerdictStopped, ReleasedSecondsAgo: 10}, nil
	}}
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts, c.DecodePerMinute = v, 1 })
	for i := 0; i < 60 && len(d.orders()) == 0; i++ {
		h.tick(1)
	}
	if o := d.orders(); len(o) != 1 || o[0].RID != "pin" || !o[0].PrefillStopped {
		t.Fatalf("orders %+v, want the early release to take the one slot", o)
	}
	if got := h.skips(SkipRateLimited); got != 1 {
		t.Fatalf("%d rate_limited skips, want the stuck request over the budget", got)
	}
}
