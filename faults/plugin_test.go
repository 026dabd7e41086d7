package faults

import (
	"encoding/json"
	"net/http"
	"strconv"
	"sync"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// TestFaultPluginMissingOnOneRank: the plugin answers on rank 0 but not on
// rank 1 (an SGLang without the plugin answers 404 on that port, or nothing
// listens there). Rank 1 is watched through SGLang's gauges only: its pin
// shows as a pinned queue gauge, nothing is ever called on it, and its
// listing is reported down. Rank 0 is still acted on.
func TestFaultPluginMissingOnOneRank(t *testing.T) {
	for _, tc := range []struct {
		name   string
		break1 func(e *env)
		errLog string
	}{
		{"404", func(e *env) {
			e.plugins[1].setHook(answer(http.StatusNotFound, "text/plain", "404 page not found"))
		}, "HTTP 404"},
		{"connection refused", func(e *env) { e.plugins[1].down() }, "connection refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Era newest: a lone stuck request pins the inflight gauge at
			// 1. No traffic, so that no progress counter hides the pin.
			e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 2, Era: sglangsim.EraNewest, Seed: 3}})
			tc.break1(e)
			pin0, _ := e.sim.Inject(0, sglangsim.PinResurrection)
			pin1, _ := e.sim.Inject(1, sglangsim.PinStuckHandle)
			e.tick(240)

			if r := e.record(pin0); r.Outcome != sglangsim.OutcomeFailedForced {
				t.Errorf("rank 0, whose plugin works, was not acted on: %+v", r)
			}
			if r := e.record(pin1); !r.ForcedAt.IsZero() {
				t.Errorf("rank 1 has no readable plugin, yet its request was force-failed: %+v", r)
			}
			if n := len(e.plugins[1].adminCalls()); n != 0 {
				t.Errorf("%d admin calls to rank 1", n)
			}
			p0, p1 := e.plugins[0].url(), e.plugins[1].url()
			e.wantMetric("rank 0 up", eq(1), "sglang_watchdog_scrape_success", "source", "plugin", "target", p0)
			e.wantMetric("rank 1 down", eq(0), "sglang_watchdog_scrape_success", "source", "plugin", "target", p1)
			e.wantMetric("rank 1 failures", atLeast(240), "sglang_watchdog_scrape_failures_total", "source", "plugin", "target", p1)
			e.wantMetric("rank 1 gauge watched", eq(1), "sglang_watchdog_queue_requests",
				"source", "metrics", "queue", "prefill_inflight", "dp_rank", "1")
			e.wantMetric("rank 1 pin seen in the gauge", eq(1), "sglang_watchdog_queue_pinned",
				"queue", "prefill_inflight", "dp_rank", "1")
			if _, ok := e.metric("sglang_watchdog_stuck_requests", "dp_rank", "1"); ok {
				t.Error("stuck_requests exported for rank 1, which was never listed")
			}
			e.wantLog("level=error", "reading plugin listing failed", "target="+p1, tc.errLog)
			e.wantLog("level=warn", "queue gauge pinned", "dp_rank=1")
			e.checkSafe()
		})
	}
}

// flapper rewrites rank listings read by read.
type flapper struct {
	mu    sync.Mutex
	reads int
	fresh [][]byte // every fresh body served, oldest first
}

// TestFaultFlappingListing: a listing that does not tell a consistent
// story. No progressing request may be force-failed, and the watchdog's
// state stays bounded.
//
//   - "room flaps": the pinned and a progressing room vanish on every other
//     read. A room must be seen for a whole stall window to be stuck, so
//     neither is ever failed (the pin stays: safety over liveness).
//   - "lagging replica": every other read is the body served two reads
//     before (two listeners behind one URL, one behind): progress and
//     the loop counter go back and forth. Each step back reads as a
//     scheduler restart and the re-read before the call sees it, so the
//     pin is never failed either.
//   - "every third read fails": the pin is released, once.
func TestFaultFlappingListing(t *testing.T) {
	for _, tc := range []struct {
		name        string
		hook        func(f *flapper, pin, slow string) hookFunc
		wantRelease bool
	}{
		{"room flaps", func(f *flapper, pin, slow string) hookFunc {
			return func(w http.ResponseWriter, r *http.Request, next http.Handler) {
				f.mu.Lock()
				f.reads++
				odd := f.reads%2 == 1
				f.mu.Unlock()
				rec := recorded(next, r)
				if !odd {
					copyResponse(w, rec.Code, rec.Body.Bytes())
					return
				}
				var l pluginapi.Listing
				if err := json.Unmarshal(rec.Body.Bytes(), &l); err != nil {
					panic(err)
				}
				kept := l.Inflight[:0]
				for _, room := range l.Inflight {
					if room.RID != pin && room.RID != slow {
						kept = append(kept, room)
					}
				}
				l.Inflight = kept
				b, _ := json.Marshal(l)
				copyResponse(w, http.StatusOK, b)
			}
		}, false},
		{"lagging replica", func(f *flapper, pin, slow string) hookFunc {
			return func(w http.ResponseWriter, r *http.Request, next http.Handler) {
				f.mu.Lock()
				defer f.mu.Unlock()
				f.reads++
				if f.reads%2 == 0 && len(f.fresh) >= 2 {
					copyResponse(w, http.StatusOK, f.fresh[len(f.fresh)-2])
					return
				}
				rec := recorded(next, r)
				f.fresh = append(f.fresh, rec.Body.Bytes())
				if len(f.fresh) > 3 {
					f.fresh = f.fresh[1:]
				}
				copyResponse(w, rec.Code, rec.Body.Bytes())
			}
		}, false},
		{"every third read fails", func(f *flapper, pin, slow string) hookFunc {
			return func(w http.ResponseWriter, r *http.Request, next http.Handler) {
				f.mu.Lock()
				f.reads++
				fail := f.reads%3 == 0
				f.mu.Unlock()
				if fail {
					answer(http.StatusBadGateway, "text/plain", "bad gateway")(w, r, next)
					return
				}
				next.ServeHTTP(w, r)
			}
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{sim: baseSim()})
			e.knownSlowGap()
			pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
			slow, _ := e.sim.Submit(sglangsim.RequestSpec{Rank: 0, Behavior: sglangsim.BehaviorSlow, Transfer: -1, DecodePort: slowPort})
			f := &flapper{}
			e.plugins[0].setHook(onListing(tc.hook(f, pin, slow)))
			maxTracked := 0.0
			for i := 0; i < 300; i++ {
				e.tick(1)
				v, _ := e.metric("sglang_watchdog_tracked_rooms")
				maxTracked = max(maxTracked, v)
			}
			if r := e.record(slow); !r.ForcedAt.IsZero() {
				e.knownGap("the progressing request was force-failed: %+v", r)
			}
			r := e.record(pin)
			released := r.Outcome == sglangsim.OutcomeFailedForced
			if released != tc.wantRelease {
				t.Errorf("pin released=%v, want %v: %+v", released, tc.wantRelease, r)
			}
			if n := len(callsFor(e.allCalls(), pin)); n > 1 {
				t.Errorf("%d admin calls for the pin, want at most 1", n)
			}
			// Two ranks at 8 req/s with a heavy tail hold a few dozen
			// rooms; the flapping one can at most double that.
			if maxTracked > 200 {
				t.Errorf("tracked rooms reached %v: state is not bounded by what is listed", maxTracked)
			}
			e.wantMetric("the other rank is up", eq(1), "sglang_watchdog_scrape_success", "source", "plugin", "target", e.plugins[1].url())
			hist, _ := e.metric("sglang_watchdog_inflight_age_seconds", "dp_rank", "0")
			skips := e.wd.Snapshot().Skips
			t.Logf("pin outcome %s, admin calls %d, max tracked %v, rank-0 departures observed %v, skips %v",
				r.Outcome, len(e.allCalls()), maxTracked, hist, skips)
			if tc.name == "every third read fails" {
				e.wantMetric("failures counted", atLeast(90), "sglang_watchdog_scrape_failures_total", "source", "plugin", "target", e.plugins[0].url())
				e.wantLog("level=error", "reading plugin listing failed", "HTTP 502")
			}
			e.checkSafe()
		})
	}
}

func copyResponse(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
