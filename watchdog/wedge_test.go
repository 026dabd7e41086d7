package watchdog

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Restart plays the plugin's restart endpoint: restartAnswer, if set,
// answers; otherwise a dry run would restart and a real one restarts.
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

// Mooncake and NIXL up to v0.5.11 never write Transferring: their rooms
// read WaitingForInput for the whole transfer, and are suspected alike.
func TestWedgeSuspectedWithAnOlderPlugin(t *testing.T) {
	for _, poll := range []string{pluginapi.PollTransferring, pluginapi.PollWaitingForInput} {
		t.Run(poll, func(t *testing.T) {
			p := newFakePlugin("http://127.0.0.1:28100", 0)
			p.server.PID = 7
			h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
				c.Mode = ModeOff
				c.RestartMode, c.RestartMinInterval = ModeAuto, 30*time.Minute
			})
			at := func(r pluginapi.Room) pluginapi.Room { r.Poll = poll; return r }
			p.set(at(room("a", 1, 0)))
			h.tick(60)
			if w, _ := wedgeState(h, 0); w {
				t.Fatal("one stuck room made the rank suspected")
			}
			p.set(at(room("a", 1, 60)), at(room("b", 2, 0)))
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
		})
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
// (transfer_progress_test.go); without it nothing but the deadline path acts
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
