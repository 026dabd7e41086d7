package faults

import (
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// flood submits n endless progressing requests with prompts short enough
// (256 tokens) that 1500 fit in the rank's KV pool. Since sglangsim follows
// SGLang their listed progress stands still and the watchdog force-fails
// them (a known gap, issue 16: the tests mark it with knownSlowGap).
func flood(e *env, rank, n int) {
	for i := 0; i < n; i++ {
		e.sim.Submit(sglangsim.RequestSpec{Rank: rank, Behavior: sglangsim.BehaviorSlow, Transfer: -1, PromptTokens: 256})
	}
}

// TestFaultRoomFloodIsCapped: a rank lists 1500 progressing rooms with
// --watchdog.max-rooms=500. Tracking stops at the cap, every listing over
// it is counted and logged, memory stays flat while the flood lasts, a pin
// tracked before the flood is still released, and tracking resumes when
// the flood drains.
func TestFaultRoomFloodIsCapped(t *testing.T) {
	e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 2, Seed: 13},
		mutate: func(c *watchdog.Config) { c.MaxRooms = 500 }})
	e.knownSlowGap()
	pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
	e.tick(2)
	flood(e, 0, 1500)
	e.tick(30)
	heap30 := heapInUse()
	hits30, _ := e.metric("sglang_watchdog_room_limit_hits_total")
	e.tick(90)
	heap120 := heapInUse()

	// At most the cap; at least a fair share of it (2 ranks).
	// (Less the flood's rooms force-failed by then: a known gap.)
	floor := 250 - e.slowForced()
	e.wantMetric("tracking capped", func(v float64) bool { return v >= floor && v <= 500 }, "sglang_watchdog_tracked_rooms")
	if hits, _ := e.metric("sglang_watchdog_room_limit_hits_total"); hits-hits30 < 90 {
		t.Errorf("room_limit_hits_total rose by %v over 90 cycles over the cap, want one per listing", hits-hits30)
	}
	e.wantLog("level=error", "room limit reached", "max_rooms=500", "listed=1501")
	if growth := int64(heap120) - int64(heap30); growth > 8*mib {
		t.Errorf("live heap grew by %d KiB in 90 s of a steady flood", growth>>10)
	}
	if r := e.record(pin); r.Outcome != sglangsim.OutcomeFailedForced {
		t.Errorf("the pin tracked before the flood was not released: %+v", r)
	}
	e.checkSafe()
	t.Logf("live heap %d MiB after 30 s of the flood, %d MiB after 120 s", heap30/mib, heap120/mib)

	// The flood drains in a restart; the server boots first.
	e.sim.Restart()
	e.tick(2 + int(sglangsim.DefaultBootTime/time.Second))
	pin2, _ := e.sim.Inject(0, sglangsim.PinAbortBeforeRegister)
	e.tick(70)
	if r := e.record(pin2); r.Outcome != sglangsim.OutcomeFailedForced {
		t.Errorf("tracking did not resume after the flood: %+v", r)
	}
	if v, _ := e.metric("sglang_watchdog_tracked_rooms"); v > 5 {
		t.Errorf("%v rooms tracked after the flood drained", v)
	}
}

// TestFaultRoomFloodOnOneRankBlindsTheOthers: the cap is global, so one
// rank that floods (a bug, a burst, a misbehaving plugin) takes every slot
// and a pinned request on a healthy rank is never tracked, never reported
// stuck and never released while the flood lasts. Each rank should keep a
// share of the cap.
func TestFaultRoomFloodOnOneRankBlindsTheOthers(t *testing.T) {
	e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 2, Seed: 13},
		mutate: func(c *watchdog.Config) { c.MaxRooms = 500 }})
	e.knownSlowGap()
	flood(e, 0, 600)
	e.tick(5)
	pin, _ := e.sim.Inject(1, sglangsim.PinResurrection)
	e.tick(70)
	if r := e.record(pin); r.Outcome != sglangsim.OutcomeFailedForced {
		// The flood's rooms list no progress (SGLang) and look stuck 5 s
		// before the pin: their false force-fails take the whole budget.
		e.knownGap("the pin on the healthy rank was not released: %+v", r)
	}
}

// TestFaultWedgeOutlivesItsRelease: a stuck transfer handle blocks every
// room of its transfer queue behind it while traffic keeps coming, so the
// blocked rooms look stuck too. Releasing the wedging room frees the
// request, not the worker (SGLang v0.5.18: disaggregation/nixl/conn.py): the
// rooms behind it never resume
// until the server restarts, so none of them completes, and failing them
// fails no request that was making progress.
func TestFaultWedgeOutlivesItsRelease(t *testing.T) {
	e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 1, Seed: 17, ArrivalRate: 20, TransferMedian: 30 * time.Millisecond}})
	wedge, _ := e.sim.Inject(0, sglangsim.PinStuckHandle)
	e.tick(180)
	if r := e.record(wedge); r.Outcome != sglangsim.OutcomeFailedForced {
		t.Fatalf("the wedging room was not released: %+v", r)
	}
	blocked := 0
	for _, r := range e.sim.Records() {
		if r.Kind == sglangsim.KindBlockedByWedge {
			blocked++
			if r.Outcome == sglangsim.OutcomeSuccess {
				t.Errorf("a room behind the wedge completed after the wedging room was released: %+v", r)
			}
		}
	}
	if blocked == 0 {
		t.Fatal("setup: no room was blocked behind the wedge")
	}
	e.checkSafe()
}
