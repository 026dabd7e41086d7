package watchdog

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func (f *fakePlugin) Restart(_ context.Context, req pluginapi.RestartRequest) (int, *pluginapi.RestartResponse, error) {
	f.mu.Lock()
	f.restarts = append(f.restarts, req)
	answer := f.restartAnswer
	f.mu.Unlock()
	if answer != nil {
		return answer(req)
	}
	if req.DryRun {
		return http.StatusOK, &pluginapi.RestartResponse{Result: pluginapi.ResultWouldRestart, PID: req.PID}, nil
	}
	return http.StatusAccepted, &pluginapi.RestartResponse{Result: pluginapi.ResultRestarting, PID: req.PID}, nil
}

func (f *fakePlugin) restartCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.restarts)
}

// multi is a watchdog over several fake plugins that age together.
type multi struct {
	*harness
	plugins []*fakePlugin
}

func newMulti(t *testing.T, plugins []*fakePlugin, mutate func(*Config)) *multi {
	t.Helper()
	h := newHarness(t, func(c *Config) {
		c.Plugins = nil
		for _, p := range plugins {
			c.Plugins = append(c.Plugins, p)
		}
		if mutate != nil {
			mutate(c)
		}
	})
	return &multi{harness: h, plugins: plugins}
}

func (m *multi) tick(n int) {
	for i := 0; i < n; i++ {
		m.clk.Advance(time.Second)
		for _, p := range m.plugins {
			p.age(time.Second)
		}
		m.wd.RunCycle(context.Background())
	}
}

func (m *multi) eventsOf(kind EventKind) []Event {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []Event
	for _, e := range m.events {
		if e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

func boolp(b bool) *bool { return &b }
func intp(i int) *int    { return &i }

// r2room is a room as a round-2 plugin lists it.
func r2room(rid string, roomID uint64, age float64, queue int, inFlight bool) pluginapi.Room {
	r := room(rid, roomID, age)
	r.TransferQueue = intp(queue)
	r.TransferInFlight = boolp(inFlight)
	return r
}

// ppStages builds the PP stages of one DP rank. A force-fail flips the
// request on its stage only; the request leaves every stage's listing once
// every stage holding it has flipped (sglang-SGLang v0.5.18:
// managers/scheduler_pp_mixin.py).
func ppStages(dp, pp int) []*fakePlugin {
	var stages []*fakePlugin
	flipped := map[string]map[int]bool{}
	for i := 0; i < pp; i++ {
		p := newFakePlugin(fmt.Sprintf("http://127.0.0.1:%d", 28100+dp*pp+i), dp)
		p.server.PPRank, p.server.PPSize, p.server.PID = i, pp, 100+i
		stages = append(stages, p)
	}
	for i, p := range stages {
		p.answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
			if req.DryRun {
				return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultWouldFlip, RID: req.RID}, nil
			}
			if flipped[req.RID] == nil {
				flipped[req.RID] = map[int]bool{}
			}
			flipped[req.RID][i] = true
			all := true
			for _, s := range stages {
				if holds(s, req.RID) && !flipped[req.RID][s.server.PPRank] {
					all = false
				}
			}
			if all {
				for _, s := range stages {
					s.drop(req.RID)
				}
			}
			return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultFlipped, RID: req.RID, Levers: []string{pluginapi.LeverAbort}}, nil
		}
	}
	return stages
}

func holds(p *fakePlugin, rid string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range p.rooms {
		if r.RID == rid {
			return true
		}
	}
	return false
}

func (f *fakePlugin) drop(rid string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	kept := f.rooms[:0]
	for _, r := range f.rooms {
		if r.RID != rid {
			kept = append(kept, r)
		}
	}
	f.rooms = kept
}

func metricsWith(v float64) *fakeMetrics {
	m := &fakeMetrics{}
	m.addProgress(TransferFailedFamily, v)
	return m
}

// --- Pipeline parallelism -------------------------------------------------

func TestPPFailsOnEveryStageCountsOnceReleasesAfterBoth(t *testing.T) {
	stages := ppStages(0, 2)
	m := metricsWith(5)
	h := newMulti(t, stages, func(c *Config) { c.Metrics = m; c.MaxPerMinute = 1 })
	h.wd.ScrapeMetrics(context.Background())
	// r is stuck on stage 0 only; stage 1 finished its part. s is a second
	// request of the same DP rank, for the rate limit.
	done := room("r", 7, 0)
	done.Poll = pluginapi.PollSuccess
	stages[0].set(room("r", 7, 0), room("s", 8, 0))
	stages[1].set(done, room("s", 8, 0))
	h.tick(60)
	if stages[0].callCount() != 1 || stages[1].callCount() != 1 {
		t.Fatalf("calls per stage = %d, %d; want the request failed on both stages", stages[0].callCount(), stages[1].callCount())
	}
	if holds(stages[0], "r") || holds(stages[1], "r") {
		t.Fatal("the fake did not release the request after both stages flipped")
	}
	h.tick(1)
	if h.count(ResultReleased, TriggerAuto) != 0 {
		t.Fatal("released before the counter rose")
	}
	// One request took the one slot of max-per-minute = 1, whatever its
	// stages: s waits.
	if h.wd.Snapshot().Skips[SkipRateLimited] != 1 || stages[0].callCount() != 1 {
		t.Fatalf("second request within the minute: skips %v, calls %d", h.wd.Snapshot().Skips, stages[0].callCount())
	}
	m.addProgress(TransferFailedFamily, 1)
	h.wd.ScrapeMetrics(context.Background())
	if got := h.count(ResultReleased, TriggerAuto); got != 1 {
		t.Fatalf("released = %d, want the request counted once", got)
	}
}

func TestPPNotReleasedUntilGoneFromEveryStage(t *testing.T) {
	stages := ppStages(0, 2)
	m := metricsWith(5)
	h := newMulti(t, stages, func(c *Config) { c.Metrics = m })
	h.wd.ScrapeMetrics(context.Background())
	// Stage 1 flips but keeps listing the request (its release waits for a
	// stage that never becomes terminal).
	stages[1].answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
		return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultFlipped, RID: req.RID}, nil
	}
	stages[0].set(room("r", 7, 0))
	stages[1].set(room("r", 7, 0))
	h.tick(60)
	stages[0].drop("r")
	m.addProgress(TransferFailedFamily, 1)
	h.tick(1)
	h.wd.ScrapeMetrics(context.Background())
	if h.count(ResultReleased, TriggerAuto) != 0 {
		t.Fatal("counted released while stage 1 still lists the request")
	}
	h.tick(60)
	if h.count(ResultUnconfirmed, TriggerAuto) != 1 {
		t.Fatalf("unconfirmed = %d, want 1", h.count(ResultUnconfirmed, TriggerAuto))
	}
}

func TestPPMixedAnswersAreOneResult(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		resp   *pluginapi.ForceFailResponse
		want   string
	}{
		{"unavailable", http.StatusServiceUnavailable, &pluginapi.ForceFailResponse{Result: pluginapi.ResultSchedulerUnresponsive}, ResultError},
		{"room mismatch", http.StatusConflict, &pluginapi.ForceFailResponse{Result: pluginapi.ResultRoomMismatch}, ResultRejected},
		{"transfer succeeded", http.StatusConflict, &pluginapi.ForceFailResponse{Result: pluginapi.ResultTransferSucceeded}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stages := ppStages(0, 2)
			stages[0].answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
				return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultFlipped, RID: req.RID}, nil
			}
			stages[1].answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
				return tc.status, tc.resp, nil
			}
			h := newMulti(t, stages, func(c *Config) { c.Metrics = metricsWith(0) })
			stages[0].set(room("r", 7, 0))
			stages[1].set(room("r", 7, 0))
			h.tick(60)
			var total uint64
			for _, res := range Results {
				total += h.count(res, TriggerAuto)
			}
			evs := h.eventsOf(EventForceFail)
			if len(evs) != 1 || !strings.Contains(evs[0].Stages, "pp0=flipped(200)") || !strings.Contains(evs[0].Stages, "pp1="+tc.resp.Result) {
				t.Fatalf("events %+v, want one with per-stage detail", evs)
			}
			if tc.want == "" {
				// Stage 1 is terminal already: the flip on stage 0 may
				// release the request, so it awaits confirmation.
				if total != 0 || evs[0].Result != pluginapi.ResultFlipped {
					t.Fatalf("counted %d results, event %q; want awaiting confirmation", total, evs[0].Result)
				}
				return
			}
			if total != 1 || h.count(tc.want, TriggerAuto) != 1 {
				t.Fatalf("results %v, want one %s for the request", h.wd.Snapshot().ForceFails, tc.want)
			}
		})
	}
}

func TestPPStageDownBlocksTheRequest(t *testing.T) {
	stages := ppStages(0, 2)
	h := newMulti(t, stages, nil)
	stages[0].set(room("r", 7, 0))
	stages[1].set(room("r", 7, 0))
	h.tick(1)
	stages[1].mu.Lock()
	stages[1].listErr = errors.New("connection refused")
	stages[1].mu.Unlock()
	h.tick(60)
	if stages[0].callCount() != 0 {
		t.Fatal("failed the request on one stage while another stage was down")
	}
	if h.wd.Snapshot().Skips[SkipSourceDown] != 1 {
		t.Fatalf("skips %v, want source_down", h.wd.Snapshot().Skips)
	}
}

// --- Plugin answers of round 2 ----------------------------------------------

func TestRound2AnswersMapToResults(t *testing.T) {
	for _, tc := range []struct {
		status int
		result string
		want   string
		calls  int // over two minutes: never retried
	}{
		{http.StatusNotImplemented, pluginapi.ResultUnsupported, ResultUnsupported, 1},
		{http.StatusConflict, pluginapi.ResultHealthCheck, ResultRejected, 1},
		{http.StatusConflict, pluginapi.ResultTransferSucceeded, ResultRejected, 1},
	} {
		h := newHarness(t, nil)
		h.plugin.answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
			return tc.status, &pluginapi.ForceFailResponse{Result: tc.result, RID: req.RID, Error: "refused"}, nil
		}
		h.plugin.set(room("r", 1, 0))
		h.tick(180)
		if h.count(tc.want, TriggerAuto) != 1 || h.plugin.callCount() != tc.calls {
			t.Errorf("%d %s: results %v after %d calls, want one %s", tc.status, tc.result, h.wd.Snapshot().ForceFails, h.plugin.callCount(), tc.want)
		}
	}
}

func TestEmptyLeversNeverCalls(t *testing.T) {
	h := newHarness(t, nil)
	h.plugin.server.Levers = []string{}
	h.plugin.server.LeverNote = "mid-2025 NIXL: poll() reads neither _send_failed nor conclude_state"
	h.plugin.set(room("r", 1, 0), room("s", 2, 0))
	h.tick(120)
	if h.plugin.callCount() != 0 {
		t.Fatalf("%d calls on a rank whose levers are empty", h.plugin.callCount())
	}
	s := h.wd.Snapshot()
	if s.Skips[SkipUnsupported] != 2 || s.Ranks[0].Stuck != 2 || s.Ranks[0].Unactionable[SkipUnsupported] != 2 {
		t.Fatalf("skips %v, stuck %d, unactionable %v; want both counted unsupported", s.Skips, s.Ranks[0].Stuck, s.Ranks[0].Unactionable)
	}
	// An absent list (older plugin) is not "no lever".
	h2 := newHarness(t, nil)
	h2.plugin.set(room("r", 1, 0))
	h2.tick(60)
	if h2.plugin.callCount() != 1 {
		t.Fatal("an older plugin without levers was not acted on")
	}
}

// --- Confirmation -------------------------------------------------------------

// Two ranks flipped in one cycle and both rooms left, but the counter rose
// by one: one release is confirmed, the other is not.
func TestOneCounterRiseConfirmsOneRelease(t *testing.T) {
	a, b := newFakePlugin("http://127.0.0.1:28100", 0), newFakePlugin("http://127.0.0.1:28101", 1)
	m := metricsWith(5)
	h := newMulti(t, []*fakePlugin{a, b}, func(c *Config) { c.Metrics = m })
	h.wd.ScrapeMetrics(context.Background())
	a.set(room("ra", 1, 0))
	b.set(room("rb", 2, 0))
	h.tick(60)
	if a.callCount() != 1 || b.callCount() != 1 {
		t.Fatalf("calls %d, %d", a.callCount(), b.callCount())
	}
	h.tick(1)
	m.addProgress(TransferFailedFamily, 1)
	h.wd.ScrapeMetrics(context.Background())
	h.tick(60)
	h.wd.ScrapeMetrics(context.Background())
	if r, u := h.count(ResultReleased, TriggerAuto), h.count(ResultUnconfirmed, TriggerAuto); r != 1 || u != 1 {
		t.Fatalf("released %d, unconfirmed %d; want 1 and 1 for a rise of 1", r, u)
	}
}

// --- A source that flaps --------------------------------------------------------

// A listing that fails every other read makes the re-read before the call
// fail every time: nothing is done, and the request is shown as stuck and
// not actionable.
func TestFlappingSourceIsExposed(t *testing.T) {
	h := newHarness(t, nil)
	h.plugin.set(room("r", 1, 0))
	h.plugin.beforeRead = func(read int) {
		h.plugin.mu.Lock()
		defer h.plugin.mu.Unlock()
		h.plugin.listErr = nil
		if read%2 == 0 {
			h.plugin.listErr = errors.New("connection reset")
		}
	}
	h.tick(200)
	s := h.wd.Snapshot()
	if h.plugin.callCount() != 0 || s.Skips[SkipSourceDown] != 1 {
		t.Fatalf("calls %d, skips %v", h.plugin.callCount(), s.Skips)
	}
	if s.Ranks[0].Unactionable[SkipSourceDown] != 1 {
		t.Fatalf("unactionable %v, want the stuck request shown as blocked by its source", s.Ranks[0].Unactionable)
	}
}

// --- Rank collisions ---------------------------------------------------------

func TestRankCollisionKeepsBothRanks(t *testing.T) {
	a, b := newFakePlugin("http://127.0.0.1:28100", 0), newFakePlugin("http://127.0.0.1:28101", 0)
	b.server.PID = 2
	h := newMulti(t, []*fakePlugin{a, b}, func(c *Config) { c.Mode = ModeOff })
	b.set(room("r", 1, 0))
	h.tick(60)
	s := h.wd.Snapshot()
	if len(s.Ranks) != 2 || s.Ranks[0].Target == s.Ranks[1].Target {
		t.Fatalf("ranks %+v, want both targets", s.Ranks)
	}
	stuck := 0
	for _, r := range s.Ranks {
		stuck += r.Stuck
	}
	if stuck != 1 {
		t.Fatalf("stuck = %d, want the second target's stuck request kept", stuck)
	}
	if evs := h.eventsOf(EventRankCollision); len(evs) != 1 || evs[0].DPRank != 0 {
		t.Fatalf("collision events %+v, want one", evs)
	}
}

// --- Transfer wedges ---------------------------------------------------------

func wedgeState(h *multi, i int) (bool, uint64) {
	s := h.wd.Snapshot()
	for _, r := range s.Ranks {
		if r.Target == h.plugins[i].target {
			return r.TransferWedged, r.TransferWedges
		}
	}
	return false, 0
}

func TestWedgeInFlightRoom(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.Mode = ModeOff })
	p.set(r2room("w", 1, 0, 2, true), r2room("idle", 2, 0, 2, false))
	h.tick(59)
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("wedged before the deadline")
	}
	h.tick(1)
	w, n := wedgeState(h, 0)
	if !w || n != 1 {
		t.Fatalf("wedged %v, count %d; want a diagnosed wedge", w, n)
	}
	evs := h.eventsOf(EventTransferWedged)
	if len(evs) != 1 || evs[0].Queue != 2 || evs[0].Reason != wedgeInFlight {
		t.Fatalf("events %+v", evs)
	}
	// Released, the room becomes an orphan: the same wedge, not a new one.
	p.set(r2room("idle", 2, 0, 2, false))
	p.orphans = []pluginapi.OrphanedTransfer{{BootstrapRoom: 1, TransferQueue: intp(2), OutstandingChunks: 1}}
	h.tick(10)
	if w, n := wedgeState(h, 0); !w || n != 1 {
		t.Fatalf("wedged %v, count %d after the room left; want the same wedge", w, n)
	}
	// A restart clears it.
	p.orphans = nil
	p.set()
	p.server.PID = 99
	h.tick(1)
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("still wedged after the evidence went away")
	}
}

func TestWedgeOrphanedTransfer(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.Mode = ModeOff })
	p.orphans = []pluginapi.OrphanedTransfer{{BootstrapRoom: 1, TransferQueue: intp(1), OutstandingChunks: 1}}
	p.set(r2room("a", 2, 0, 1, false), r2room("other", 3, 0, 0, false))
	h.tick(30) // first seen on the first tick
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("wedged before the stall window")
	}
	h.tick(1)
	if w, n := wedgeState(h, 0); !w || n != 1 {
		t.Fatalf("wedged %v, count %d; want the orphan's queue wedged", w, n)
	}
}

func TestOrphanOnAMovingQueueIsNoWedge(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.Mode = ModeOff })
	p.orphans = []pluginapi.OrphanedTransfer{{BootstrapRoom: 1, TransferQueue: intp(1), OutstandingChunks: 1}}
	p.set(r2room("a", 2, 0, 1, false), r2room("b", 3, 0, 1, false))
	for i := 0; i < 90; i++ {
		if i%20 == 0 {
			p.progress("b") // the queue's worker moves
		}
		h.tick(1)
	}
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("a queue whose rooms progress was diagnosed wedged")
	}
}

func TestWedgeSuspectedWithAnOlderPlugin(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	p.server.PID = 7
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Mode = ModeOff
		c.RestartMode, c.RestartMinInterval = ModeAuto, 30*time.Minute
	})
	p.set(room("a", 1, 0))
	h.tick(60)
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("one stuck room made the rank suspected")
	}
	p.set(room("a", 1, 60), room("b", 2, 0))
	h.tick(60)
	w, n := wedgeState(h, 0)
	if !w || n != 1 {
		t.Fatalf("wedged %v, count %d; want suspected", w, n)
	}
	if evs := h.eventsOf(EventTransferWedged); len(evs) != 1 || evs[0].Reason != wedgeSuspected {
		t.Fatalf("events %+v, want one suspected", evs)
	}
	if p.restartCount() != 0 {
		t.Fatal("a suspicion was escalated to a restart")
	}
}

func TestNoWedgeWhileTheLoopStallsOrTheSourceIsDown(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.Mode = ModeOff })
	p.orphans = []pluginapi.OrphanedTransfer{{BootstrapRoom: 1, TransferQueue: intp(1), OutstandingChunks: 1}}
	p.set(r2room("a", 2, 0, 1, false), r2room("w", 3, 0, 2, true))
	h.tick(1)
	p.mu.Lock()
	p.freezeLoop = true
	p.mu.Unlock()
	h.tick(120)
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("diagnosed a wedge while the scheduler loop was stalled")
	}
	p.mu.Lock()
	p.freezeLoop = false
	p.listErr = errors.New("connection refused")
	p.mu.Unlock()
	h.tick(120)
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("diagnosed a wedge while the source was down")
	}
}

// --- Fail-fast -------------------------------------------------------------------

// Fail-fast is a wedge order, on ranks with transfer_progress only
// (round4_test.go); without it nothing but the deadline path acts
// (TestNoFailFastNorRestartWithoutTransferProgress).

func calledRIDs(p *fakePlugin) map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for _, c := range p.calls {
		out[c.RID]++
	}
	return out
}

// --- Restart escalation ------------------------------------------------------

// wedgedRank is a rank with transfer_progress whose queue 2 worker has
// held chunk 1 of room 1, gone from the queue, for the deadline: a wedge
// diagnosed at the first fresh listing (the second), escalated once it held
// for the stall window.
func wedgedRank(target string, dp, pid int) *fakePlugin {
	p := progressRank(target, 3)
	p.server.DPRank, p.server.PID = dp, pid
	p.measured(2, 8)
	p.hold(2, 1, 1, 1, 60)
	p.set(r4room("behind", 10, 0, 2, 1))
	return p
}

func TestRestartOffByDefault(t *testing.T) {
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.Mode = ModeOff })
	h.tick(120)
	if w, _ := wedgeState(h, 0); !w || p.restartCount() != 0 {
		t.Fatalf("wedged %v, restarts %d; want a wedge and no restart", w, p.restartCount())
	}
}

func TestRestartDryRunOncePerProcess(t *testing.T) {
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.Mode = ModeOff; c.RestartMode, c.RestartMinInterval = ModeDryRun, time.Minute })
	h.tick(300)
	if p.restartCount() != 1 || !p.restarts[0].DryRun || p.restarts[0].PID != 7 || h.wd.Snapshot().Restarts[RestartWouldRestart] != 1 {
		t.Fatalf("restarts %+v", p.restarts)
	}
}

func TestRestartOncePerPIDAndPerInterval(t *testing.T) {
	a := wedgedRank("http://127.0.0.1:28100", 0, 7)
	b := progressRank("http://127.0.0.1:28101", 1)
	b.server.DPRank, b.server.PID = 1, 8
	h := newMulti(t, []*fakePlugin{a, b}, func(c *Config) {
		c.Mode = ModeOff
		c.RestartMode, c.RestartMinInterval = ModeAuto, 30*time.Minute
	})
	// The plugin refuses (restarts not allowed): still never asked again.
	a.restartAnswer = func(req pluginapi.RestartRequest) (int, *pluginapi.RestartResponse, error) {
		return http.StatusForbidden, &pluginapi.RestartResponse{Result: pluginapi.ResultRestartDisabled, PID: req.PID, Error: "not allowed"}, nil
	}
	h.tick(62)
	if a.restartCount() != 1 || a.restarts[0].PID != 7 || a.restarts[0].DryRun {
		t.Fatalf("restarts %+v, want one real call for pid 7", a.restarts)
	}
	// Another rank of the pod wedges within the interval: no restart.
	b.hold(0, 1, 5, 64, 60)
	b.set(r4room("x", 6, 0, 0, 1))
	h.tick(29 * 60)
	if a.restartCount() != 1 || b.restartCount() != 0 {
		t.Fatalf("restarts %d, %d within the interval", a.restartCount(), b.restartCount())
	}
	h.tick(60)
	if b.restartCount() != 1 || a.restartCount() != 1 {
		t.Fatalf("restarts %d, %d after the interval; want b once, a never again", a.restartCount(), b.restartCount())
	}
	s := h.wd.Snapshot()
	if s.Restarts[RestartDisabled] != 1 || s.Restarts[RestartRestarted] != 1 {
		t.Fatalf("restart results %v", s.Restarts)
	}
}

// A 429 too_soon is the plugin's own restart floor at work (a watchdog
// that lost its memory of the last restart asks again): its own result,
// logged as a warning with the plugin's retry_after_s, not an error.
func TestRestartTooSoonIsItsOwnResult(t *testing.T) {
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	var logs syncBuffer
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Mode = ModeOff
		c.RestartMode, c.RestartMinInterval = ModeAuto, 30*time.Minute
		c.Logger = log.NewLogfmtLogger(&logs)
	})
	p.restartAnswer = func(req pluginapi.RestartRequest) (int, *pluginapi.RestartResponse, error) {
		return http.StatusTooManyRequests, &pluginapi.RestartResponse{Result: pluginapi.ResultTooSoon, RetryAfterS: 1200,
			Error: "the last restart of this server was 600 s ago; the plugin allows one per 1800 s"}, nil
	}
	h.tick(120)
	if p.restartCount() != 1 {
		t.Fatalf("restart calls %d, want 1", p.restartCount())
	}
	if s := h.wd.Snapshot().Restarts; s[RestartTooSoon] != 1 || s[RestartError] != 0 {
		t.Errorf("restart results %v, want one too_soon and no error", s)
	}
	if ev := h.eventsOf(EventRestart); len(ev) != 1 || ev[0].Result != RestartTooSoon {
		t.Errorf("restart events %+v", ev)
	}
	var line string
	for _, l := range strings.Split(logs.b.String(), "\n") {
		if strings.Contains(l, `msg="restart escalation"`) {
			line = l
		}
	}
	if !strings.HasPrefix(line, "level=warn ") || !strings.Contains(line, "result=too_soon") || !strings.Contains(line, "retry_after_s=1200") {
		t.Errorf("want the escalation logged as a warning with result=too_soon and retry_after_s=1200, got %q", line)
	}

	// A 429 without the contract's body (a proxy's rate limit) is no
	// answer of the plugin's: an error.
	if got := classifyRestart(true, http.StatusTooManyRequests, &pluginapi.RestartResponse{Result: "slow_down"}, nil); got != RestartError {
		t.Errorf("429 slow_down classified %q, want %q", got, RestartError)
	}
}

// A plugin that finds no way to end SGLang's whole server (its launcher
// handles no SIGQUIT) answers 501 restart_unsupported: unsupported, not an
// error; another 501 is no answer of the plugin's.
func TestRestartUnsupportedByThePlugin(t *testing.T) {
	if got := classifyRestart(true, http.StatusNotImplemented, &pluginapi.RestartResponse{Result: pluginapi.ResultRestartUnsupported}, nil); got != RestartUnsupported {
		t.Errorf("501 restart_unsupported classified %q, want %q", got, RestartUnsupported)
	}
	if got := classifyRestart(true, http.StatusNotImplemented, &pluginapi.RestartResponse{Result: "nope"}, nil); got != RestartError {
		t.Errorf("501 nope classified %q, want %q", got, RestartError)
	}
}

func TestRestartSourceDownThenNewProcess(t *testing.T) {
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Mode = ModeAuto
		c.RestartMode, c.RestartMinInterval = ModeAuto, time.Minute
	})
	h.tick(62)
	if p.restartCount() != 1 {
		t.Fatalf("restarts %d", p.restartCount())
	}
	// The server reboots: listings fail. That is a source down, not an
	// empty rank, and nothing is acted on.
	p.mu.Lock()
	p.listErr = errors.New("connection refused")
	p.mu.Unlock()
	h.tick(90)
	s := h.wd.Snapshot()
	if s.Sources[0].Up || s.Ranks[0].Queues.Inflight != 1 || p.restartCount() != 1 {
		t.Fatalf("while down: sources %+v, queues %+v, restarts %d", s.Sources, s.Ranks[0].Queues, p.restartCount())
	}
	// The same pid comes back in a new process (counter reset) and wedges
	// again: it is a new process, and the interval has passed.
	p.mu.Lock()
	p.listErr = nil
	p.iterations = 0
	p.mu.Unlock()
	p.set(r4room("behind2", 20, 0, 2, 1))
	p.hold(2, 1, 1, 1, 60)
	h.tick(62)
	if p.restartCount() != 2 {
		t.Fatalf("restarts %d, want the new process restarted too", p.restartCount())
	}
}

func TestRestartNeedsTheEvidenceOnReRead(t *testing.T) {
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Mode = ModeOff
		c.RestartMode, c.RestartMinInterval = ModeAuto, time.Minute
	})
	h.tick(60)
	// The chunk settles between the cycle's read and the re-read.
	p.beforeRead = func(read int) {
		if read == 62 {
			p.finish(2)
		}
	}
	h.tick(1)
	if p.restartCount() != 0 {
		t.Fatal("restarted although the re-read showed the wedge gone")
	}
}

// syncBuffer is a log sink for tests.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) count(sub string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Count(s.b.String(), sub)
}

func TestLoudOnceNoLeverAndMissingStages(t *testing.T) {
	var logs syncBuffer
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	p.server.Levers, p.server.LeverNote, p.server.PPSize = []string{}, "mid-2025 NIXL", 2
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.Logger = log.NewLogfmtLogger(&logs) })
	h.tick(30)
	if n := logs.count("no force-fail lever works"); n != 1 {
		t.Fatalf("%d 'no lever' lines in 30 cycles, want 1", n)
	}
	if n := logs.count("PP stages of a DP rank are not watched"); n != 1 {
		t.Fatalf("%d missing-stage lines in 30 cycles, want 1", n)
	}
	// A new process says it again.
	p.server.PID = 43
	h.tick(1)
	if n := logs.count("no force-fail lever works"); n != 2 || !strings.Contains(logs.b.String(), `lever_note="mid-2025 NIXL"`) {
		t.Fatalf("%d 'no lever' lines after a restart, want 2", n)
	}
}
