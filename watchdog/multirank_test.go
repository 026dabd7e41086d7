package watchdog

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

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

// r2room is a room with transfer_in_flight and transfer_queue.
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

// --- Plugin answers: levers, health checks, transfer_succeeded -------------

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
