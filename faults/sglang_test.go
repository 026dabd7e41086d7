package faults

import (
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// TestFaultSGLangDownAtStartThenUp: SGLang (its /metrics and every plugin
// listener) refuses connections when the watchdog starts, then comes up.
// While down the watchdog keeps cycling, reports every source down and is
// not ready; once up, a request that was pinned all along is force-failed
// only after a full stall window of its own observation.
func TestFaultSGLangDownAtStartThenUp(t *testing.T) {
	e := newEnv(t, envOptions{sim: baseSim(), down: true})
	pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
	// The false-positive case: a slow transfer older than the deadline.
	e.knownSlowGap()
	e.sim.Submit(sglangsim.RequestSpec{Rank: 1, Behavior: sglangsim.BehaviorSlow, Transfer: -1, DecodePort: slowPort})
	e.tick(40)

	if e.wd.Ready() {
		t.Error("ready although SGLang was never read")
	}
	e.wantMetric("metrics down", eq(0), "sglang_watchdog_scrape_success", "source", "metrics")
	e.wantMetric("metrics failures", atLeast(3), "sglang_watchdog_scrape_failures_total", "source", "metrics")
	for _, p := range e.plugins {
		e.wantMetric("plugin down", eq(0), "sglang_watchdog_scrape_success", "source", "plugin", "target", p.url())
		e.wantMetric("plugin failures", atLeast(40), "sglang_watchdog_scrape_failures_total", "source", "plugin", "target", p.url())
	}
	e.wantMetric("nothing tracked", eq(0), "sglang_watchdog_tracked_rooms")
	e.wantLog("level=error", "reading plugin listing failed", "connection refused")
	e.wantLog("level=error", "reading SGLang metrics failed", "connection refused")

	e.upAll()
	upAt := e.clk.Now()
	e.tick(120)

	if !e.wd.Ready() {
		t.Error("not ready after SGLang came up")
	}
	e.wantMetric("metrics up", eq(1), "sglang_watchdog_scrape_success", "source", "metrics")
	for _, p := range e.plugins {
		e.wantMetric("plugin up", eq(1), "sglang_watchdog_scrape_success", "source", "plugin", "target", p.url())
	}
	r := e.record(pin)
	if r.Outcome != sglangsim.OutcomeFailedForced {
		t.Fatalf("pin not released after SGLang came up: %+v", r)
	}
	if waited := r.ForcedAt.Sub(upAt); waited < 30*time.Second {
		t.Errorf("pin force-failed %s after the first listing; a full 30 s stall window must be observed first", waited)
	}
	e.wantMetric("release confirmed", eq(1+e.slowForced()), "sglang_watchdog_force_fails_total", "result", "released", "trigger", "auto")
	if n := e.checkSafe(); n == 0 {
		t.Error("no slow request outlived the deadline: the run did not exercise the false-positive case")
	}
}

// TestFaultSGLangRestart: SGLang restarts while a pinned request is being
// watched (not yet stuck), and the restarted server reuses that room id for
// a new pinned request, and another pinned room's id for a progressing
// one. Nothing of the old requests may be carried over: the vanished rooms
// are never called, the new pinned request waits out its own stall window,
// the progressing one is never touched, counters going back to 0 pin no
// gauge.
func TestFaultSGLangRestart(t *testing.T) {
	// A deadline shorter than the stall window makes the stall window the
	// binding condition, so that inherited state would show.
	e := newEnv(t, envOptions{sim: baseSim(), mutate: func(c *watchdog.Config) { c.Deadline = 20 * time.Second }})
	e.tick(20)
	pinA, roomA := e.sim.Inject(0, sglangsim.PinResurrection)
	pinC, roomC := e.sim.Inject(1, sglangsim.PinAbortBeforeRegister)
	e.tick(25) // both seen for ~24 s: tracked, not yet stuck
	if v, _ := e.metric("sglang_watchdog_tracked_rooms"); v < 2 {
		t.Fatalf("setup: %v rooms tracked before the restart", v)
	}

	e.sim.Restart()
	restartAt := e.clk.Now()
	// The new requests come once the server serves again: while it boots
	// the router's connection is refused.
	e.tick(int(sglangsim.DefaultBootTime / time.Second))
	pinB, _ := e.sim.Submit(sglangsim.RequestSpec{Rank: 0, Behavior: sglangsim.BehaviorPinResurrection, Room: roomA})
	e.knownSlowGap()
	slow, _ := e.sim.Submit(sglangsim.RequestSpec{Rank: 1, Behavior: sglangsim.BehaviorSlow, Transfer: -1, Room: roomC, DecodePort: slowPort})
	e.tick(90)

	for _, rid := range []string{pinA, pinC} {
		if r := e.record(rid); r.Outcome != sglangsim.OutcomeRestarted || !r.ForcedAt.IsZero() {
			t.Errorf("pre-restart request %s: %+v, want lost in the restart and never forced", rid, r)
		}
		if c := callsFor(e.allCalls(), rid); len(c) != 0 {
			t.Errorf("admin call for %s, which vanished in the restart: %+v", rid, c)
		}
	}
	b := e.record(pinB)
	if b.Outcome != sglangsim.OutcomeFailedForced {
		t.Fatalf("new pinned request in the reused room not released: %+v", b)
	}
	if waited := b.ForcedAt.Sub(restartAt); waited < 30*time.Second {
		t.Errorf("new request in reused room %d force-failed %s after the restart: it inherited the old request's stall", roomA, waited)
	}
	if r := e.record(slow); !r.ForcedAt.IsZero() {
		e.knownGap("progressing request in reused room %d was force-failed: %+v", roomC, r)
	}
	for _, p := range e.plugins {
		e.wantMetric("plugin up", eq(1), "sglang_watchdog_scrape_success", "source", "plugin", "target", p.url())
	}
	e.wantMetric("metrics up", eq(1), "sglang_watchdog_scrape_success", "source", "metrics")
	e.wantMetric("no pinned gauge", eq(0), "sglang_watchdog_queue_pinned")
	e.wantMetric("one release", eq(1+e.slowForced()), "sglang_watchdog_force_fails_total", "result", "released", "trigger", "auto")
	if v, _ := e.metric("sglang_watchdog_tracked_rooms"); v > 40 {
		t.Errorf("%v rooms tracked after the restart: the vanished ones were kept", v)
	}
	e.checkSafe()
}

// TestFaultSGLangRestartIsReported: a scheduler restart (the plugin's loop
// counter goes back, a new pid) is handled safely (above) but the watchdog
// says nothing about it: every request it was watching on that rank
// vanished at once and the operator is not told why.
func TestFaultSGLangRestartIsReported(t *testing.T) {
	e := newEnv(t, envOptions{sim: baseSim()})
	e.tick(20)
	e.sim.Inject(0, sglangsim.PinResurrection)
	e.tick(5)
	e.sim.Restart()
	e.tick(2 + int(sglangsim.DefaultBootTime/time.Second)) // the server boots first
	e.wantLog("level=warn", "scheduler restarted", "target="+e.plugins[0].url())
}
