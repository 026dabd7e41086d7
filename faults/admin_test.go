package faults

import (
	"net"
	"net/http"
	"runtime"
	"sort"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// resetConn drops the connection without an answer.
func resetConn(w http.ResponseWriter, r *http.Request, _ http.Handler) {
	hj, ok := w.(http.Hijacker)
	if !ok {
		panic("no hijacker")
	}
	conn, _, err := hj.Hijack()
	if err != nil {
		return
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	conn.Close()
}

// applyThenHang lets the plugin apply the order, then never answers: the
// lever is set but the watchdog hears nothing back.
func applyThenHang(w http.ResponseWriter, r *http.Request, next http.Handler) {
	recorded(next, r)
	<-r.Context().Done()
}

// maxInWindow is the most calls in any window of length d.
func maxInWindow(calls []adminCall, d time.Duration) int {
	at := make([]time.Time, len(calls))
	for i, c := range calls {
		at[i] = c.at
	}
	sort.Slice(at, func(i, j int) bool { return at[i].Before(at[j]) })
	best := 0
	for i := range at {
		n := 0
		for j := i; j < len(at) && at[j].Sub(at[i]) < d; j++ {
			n++
		}
		best = max(best, n)
	}
	return best
}

// TestFaultAdminCallFailsNeverStorms: the admin call answers 5xx, drops
// the connection or times out, on every rank, for ten minutes, with four
// pinned requests. Each room gets at most MaxAttempts calls, spaced by the
// doubling backoff; no 60 s window holds more than --force-fail.max-per-minute
// calls; every failure is counted and logged.
func TestFaultAdminCallFailsNeverStorms(t *testing.T) {
	for _, tc := range []struct {
		name string
		hook hookFunc
		// applied: the lever is set although the call fails (the answer
		// was lost), so the room leaves after the first call.
		applied bool
	}{
		{"503 scheduler_unresponsive", answer(http.StatusServiceUnavailable, "application/json",
			`{"result":"scheduler_unresponsive","error":"the scheduler loop did not pick the order up within 5s"}`), false},
		{"500 HTML", answer(http.StatusInternalServerError, "text/html", "<html>Internal Server Error</html>"), false},
		{"connection reset", resetConn, false},
		{"timeout before applying", hang, false},
		{"timeout after applying", applyThenHang, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{sim: baseSim(), adminTimeout: 300 * time.Millisecond})
			for _, p := range e.plugins {
				p.setHook(onAdmin(tc.hook))
			}
			// No stuck-handle pin here: the rooms it blocks would pile up
			// behind it for ten minutes (TestFaultManyStuckRooms).
			var pins []string
			for i := 0; i < 4; i++ {
				rid, _ := e.sim.Inject(i%2, []sglangsim.PinKind{sglangsim.PinResurrection, sglangsim.PinAbortBeforeRegister}[i/2])
				pins = append(pins, rid)
			}
			e.tick(600)

			calls := e.allCalls()
			if len(calls) < 4 {
				t.Fatalf("%d admin calls for 4 stuck requests: the rails did not even try", len(calls))
			}
			cfgMax := 3 // watchdog.New's default MaxAttempts
			for _, rid := range pins {
				c := callsFor(calls, rid)
				want := cfgMax
				if tc.applied {
					want = 1
				}
				if len(c) != want {
					t.Errorf("%s: %d calls, want %d", rid, len(c), want)
				}
				for i := 1; i < len(c); i++ {
					minGap := (10 * time.Second) << (i - 1)
					if gap := c[i].at.Sub(c[i-1].at); gap < minGap {
						t.Errorf("%s: retry %d after %s, want at least %s of backoff", rid, i, gap, minGap)
					}
				}
				r := e.record(rid)
				if tc.applied != (r.Outcome == sglangsim.OutcomeFailedForced) {
					t.Errorf("%s: outcome %s", rid, r.Outcome)
				}
			}
			if n := maxInWindow(calls, time.Minute); n > 6 {
				t.Errorf("%d admin calls within 60 s, want at most 6 (--force-fail.max-per-minute)", n)
			}
			errs := e.wantMetric("errors counted", atLeast(4), "sglang_watchdog_force_fails_total", "result", "error", "trigger", "auto")
			if !tc.applied && int(errs) != len(calls) {
				t.Errorf("force_fails_total{result=error} = %v, want one per call (%d)", errs, len(calls))
			}
			e.wantLog("level=error", "force-fail call", "result=error", "retry=true")
			if !tc.applied {
				e.wantLog("level=error", "force-fail call", "result=error", "attempts=3", "retry=false")
				e.wantMetric("still reported stuck", atLeast(1), "sglang_watchdog_stuck_requests")
			} else {
				// The release happened, but its answer was lost: the
				// watchdog counts an error and never a release (see
				// docs/hardening.md, "truthfulness after a lost answer").
				e.wantMetric("no release claimed", eq(0), "sglang_watchdog_force_fails_total", "result", "released", "trigger", "auto")
				e.wantMetric("rooms forgotten", atMost(60), "sglang_watchdog_tracked_rooms")
				t.Logf("lever applied, answer lost: force_fails_total{error}=%v, {released}=0", errs)
			}
			e.checkSafe()
		})
	}
}

// TestFaultWatchdogRestartMidRemediation: the watchdog process restarts
// (a new watchdog.New on the same SGLang) in the middle of a remediation.
// It keeps no state across the restart, so the rule is: a room is acted on
// again only if the new watchdog itself sees it stuck for a full window.
func TestFaultWatchdogRestartMidRemediation(t *testing.T) {
	t.Run("call failed, then restart", func(t *testing.T) {
		e := newEnv(t, envOptions{sim: baseSim()})
		for _, p := range e.plugins {
			p.setHook(onAdmin(answer(http.StatusServiceUnavailable, "application/json", `{"result":"scheduler_unresponsive"}`)))
		}
		pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
		e.tick(65) // one failed call at ~61 s
		if n := len(callsFor(e.allCalls(), pin)); n != 1 {
			t.Fatalf("setup: %d calls before the restart, want 1", n)
		}
		for _, p := range e.plugins {
			p.setHook(nil)
		}
		e.startWatchdog()
		restartAt := e.clk.Now()
		e.tick(60)
		c := callsFor(e.allCalls(), pin)
		if len(c) != 2 {
			t.Fatalf("%d calls in all, want 2 (one per watchdog)", len(c))
		}
		if gap := c[1].at.Sub(restartAt); gap < 30*time.Second {
			t.Errorf("the restarted watchdog called %s after its start, before a full 30 s stall window of its own", gap)
		}
		if r := e.record(pin); r.Outcome != sglangsim.OutcomeFailedForced {
			t.Errorf("pin not released by the restarted watchdog: %+v", r)
		}
		e.wantMetric("new watchdog confirms", eq(1), "sglang_watchdog_force_fails_total", "result", "released", "trigger", "auto")
		e.checkSafe()
	})

	t.Run("lever set, restart before the confirmation", func(t *testing.T) {
		e := newEnv(t, envOptions{sim: baseSim()})
		pin, _ := e.sim.Inject(0, sglangsim.PinAbortBeforeRegister)
		for e.sec < 120 && len(e.allCalls()) == 0 {
			e.tick(1)
		}
		e.startWatchdog() // right after the call, before the room left
		e.tick(120)
		if n := len(callsFor(e.allCalls(), pin)); n != 1 {
			t.Errorf("%d calls for the pin across the restart, want 1", n)
		}
		if r := e.record(pin); r.Outcome != sglangsim.OutcomeFailedForced {
			t.Errorf("pin: %+v", r)
		}
		e.checkSafe()
	})

	t.Run("restart loop", func(t *testing.T) {
		e := newEnv(t, envOptions{sim: baseSim()})
		pin, _ := e.sim.Inject(1, sglangsim.PinStuckHandle)
		e.tick(5)
		runtime.GC()
		goroutines := runtime.NumGoroutine()
		heap0 := heapInUse()
		// A crash-looping watchdog restarts every 20 s for 5 minutes: it
		// never watches a room for a full stall window, so it never acts.
		for i := 0; i < 15; i++ {
			e.startWatchdog()
			e.tick(20)
		}
		if n := len(e.allCalls()); n != 0 {
			t.Errorf("%d admin calls from watchdogs that never saw a full stall window", n)
		}
		runtime.GC()
		if g := runtime.NumGoroutine(); g > goroutines+20 {
			t.Errorf("goroutines grew from %d to %d over 15 restarts", goroutines, g)
		}
		if growth := int64(heapInUse()) - int64(heap0); growth > 16*mib {
			t.Errorf("live heap grew by %d MiB over 15 restarts", growth/mib)
		}
		e.startWatchdog()
		e.tick(40)
		if c := callsFor(e.allCalls(), pin); len(c) != 1 {
			t.Errorf("%d calls once the watchdog stayed up, want 1", len(c))
		}
		e.checkSafe()
	})
}

// TestFaultDryRunThenAutoAcrossRestart: a dry-run watchdog answers
// would_flip once per room; the operator restarts it in auto mode; the room
// is failed once, after the new watchdog's own window.
func TestFaultDryRunThenAutoAcrossRestart(t *testing.T) {
	mode := watchdog.ModeDryRun
	e := newEnv(t, envOptions{sim: baseSim(), mutate: func(c *watchdog.Config) { c.Mode = mode }})
	pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
	e.tick(120)
	c := callsFor(e.allCalls(), pin)
	if len(c) != 1 || !c[0].order.DryRun {
		t.Fatalf("dry run: calls %+v, want one dry run", c)
	}
	e.wantMetric("would_flip", eq(1), "sglang_watchdog_force_fails_total", "result", "would_flip", "trigger", "auto")
	mode = watchdog.ModeAuto
	e.startWatchdog()
	restartAt := e.clk.Now()
	e.tick(60)
	c = callsFor(e.allCalls(), pin)
	if len(c) != 2 || c[1].order.DryRun || c[1].at.Sub(restartAt) < 30*time.Second {
		t.Fatalf("after the restart in auto mode: calls %+v", c)
	}
	if r := e.record(pin); r.Outcome != sglangsim.OutcomeFailedForced {
		t.Errorf("pin: %+v", r)
	}
	e.checkSafe()
}

// TestFaultManyStuckRoomsDoNotStormTheListing: many rooms stuck at once on
// one rank (a wedged transfer shard blocks every room behind it; a bad
// rollout pins many). The rate limit holds the admin calls to 6 a minute,
// but the actuator re-reads the rank's whole listing for every candidate
// before it looks at the rate limit: with N stuck rooms, N listing reads a
// second, each O(N), each one serialized by the plugin inside the
// scheduler process. The re-read must only be made for a call that the
// rate limit lets through.
func TestFaultManyStuckRoomsDoNotStormTheListing(t *testing.T) {
	e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 1, Seed: 21}})
	for i := 0; i < 40; i++ {
		e.sim.Inject(0, sglangsim.PinResurrection)
	}
	e.tick(62) // all 40 stuck from ~61 s
	before := e.plugins[0].listingReads()
	calls0 := len(e.allCalls())
	e.tick(60)
	reads := e.plugins[0].listingReads() - before
	calls := len(e.allCalls()) - calls0
	t.Logf("%d listing reads and %d admin calls in 60 cycles with 40 stuck rooms", reads, calls)
	if calls > 6 {
		t.Errorf("%d admin calls in a minute, want at most 6", calls)
	}
	// One read per cycle, plus one re-read per call made.
	if reads > 60+calls+1 {
		t.Errorf("%d listing reads in 60 cycles with %d calls: the re-read runs for candidates the rate limit refuses", reads, calls)
	}
	e.checkSafe()
}
