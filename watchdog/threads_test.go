package watchdog

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// threadsOf lists a prefill KV manager's threads: the bootstrap thread
// and one transfer worker per queue, those of dead queues dead.
func threadsOf(queues int, dead ...int) []pluginapi.KVThread {
	out := []pluginapi.KVThread{{Role: pluginapi.ThreadBootstrap, Function: "bootstrap_thread", Alive: true}}
	for q := 0; q < queues; q++ {
		alive := true
		for _, d := range dead {
			alive = alive && d != q
		}
		out = append(out, pluginapi.KVThread{Role: pluginapi.ThreadTransferWorker, Function: "transfer_worker", TransferQueue: intp(q), Alive: alive})
	}
	return append(out, pluginapi.KVThread{Role: pluginapi.ThreadOther, Function: "_failed_session_probe_loop", Alive: true})
}

func (f *fakePlugin) setThreads(th []pluginapi.KVThread) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.threads = th
}

// forced lists the rids the plugin was asked to force-fail for real.
func (f *fakePlugin) forced() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, c := range f.calls {
		if !c.DryRun {
			out = append(out, c.RID)
		}
	}
	return out
}

// The rooms queued on a dead transfer worker's queue are never posted:
// they are failed once past the deadline, with no chunk in flight to
// wait for. Beside it, on another queue of the same rank, a slow chunk
// that keeps moving holds its room and the room behind it: neither is
// ever failed. Nor is a room of the dead queue with a chunk outstanding,
// a health check, or a Success room.
func TestDeadWorkerStrandsItsQueuedRoomsOnly(t *testing.T) {
	p := progressRank("http://127.0.0.1:28100", 2)
	p.server.TransferQueues = intp(2)
	p.measured(0, 4)
	p.measured(1, 4)
	p.setThreads(threadsOf(2, 0))
	health := r4room("HEALTH_CHECK_1.0", 0, 0, 0, 1)
	health.HealthCheck = true
	sent := r4room("sent", 4, 0, 0, 1)
	sent.Poll = pluginapi.PollSuccess
	p.set(
		r4room("stranded", 1, 0, 0, 2),
		r2room("outstanding", 2, 0, 0, true), // a chunk of it was posted before the worker died
		health, sent,
		r4room("slow", 3, 0, 1, 1),
		r4room("behind-slow", 5, 0, 1, 1),
	)
	// The outstanding room's chunk: its handle may still be live.
	p.rooms[1].ChunksQueued = intp(1)
	p.rooms[4].TransferInFlight = boolp(true)
	// "slow" holds worker 1's chunk far longer than its peers took, but
	// it moves on to its next chunk every 20 s.
	chunk := int64(1)
	p.hold(1, chunk, 3, 64, 0)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.MaxPerMinute = 60 })
	for i := 0; i < 300; i++ {
		if i%20 == 19 {
			chunk++
			p.hold(1, chunk, 3, 64, 0)
		}
		h.tick(1)
		if i == 55 {
			if got := p.forced(); len(got) != 0 {
				t.Fatalf("force-failed %v before the 60 s deadline", got)
			}
		}
	}
	if got := p.forced(); len(got) != 1 || got[0] != "stranded" {
		t.Fatalf("force-failed %v, want the stranded room alone", got)
	}
	if s := h.wd.Snapshot().Ranks[0]; s.DeadThreads[pluginapi.ThreadTransferWorker] != 1 || s.DeadThreads[pluginapi.ThreadBootstrap] != 0 || len(s.DeadThreads) != len(pluginapi.ThreadRoles) {
		t.Fatalf("dead threads %v, want one transfer_worker", s.DeadThreads)
	}
	if ev := h.eventsOf(EventKVThreadDead); len(ev) != 1 || ev[0].Queue != 0 || ev[0].Reason != pluginapi.ThreadTransferWorker {
		t.Fatalf("kv_thread_dead events %+v, want one for queue 0", ev)
	}
}

// The same queued room behind a live worker waits its turn, however long.
func TestQueuedRoomBehindALiveWorkerWaits(t *testing.T) {
	p := progressRank("http://127.0.0.1:28100", 1)
	p.setThreads(threadsOf(1))
	p.set(r4room("queued", 1, 0, 0, 2))
	h := newMulti(t, []*fakePlugin{p}, nil)
	h.tick(300)
	if h.stuck() != 0 || p.callCount() != 0 {
		t.Fatalf("stuck %d, calls %d: a room queued behind a live idle worker is no dead worker's", h.stuck(), p.callCount())
	}
	// An older plugin that reports no threads: unknown, never dead.
	p.setThreads(nil)
	h.tick(10)
	if s := h.wd.Snapshot().Ranks[0]; s.DeadThreads != nil || h.stuck() != 0 {
		t.Fatalf("no kv_threads read as %v, stuck %d", s.DeadThreads, h.stuck())
	}
}

// A room whose progress moves is never failed, even on a dead worker's
// queue: the first rule of the house.
func TestDeadWorkerRoomThatMovesIsNotFailed(t *testing.T) {
	p := progressRank("http://127.0.0.1:28100", 1)
	p.setThreads(threadsOf(1, 0))
	p.set(r4room("moving", 1, 0, 0, 2))
	h := newMulti(t, []*fakePlugin{p}, nil)
	for i := 0; i < 200; i++ {
		if i%10 == 0 {
			p.progress("moving")
		}
		h.tick(1)
	}
	if h.stuck() != 0 || p.callCount() != 0 {
		t.Fatalf("stuck %d, calls %d on a room whose progress moves", h.stuck(), p.callCount())
	}
}

// A dead thread that serves requests escalates to a restart once it has
// stayed dead for the stall window, once per process; a dead heartbeat
// checker or "other" thread never does. The restart's reason names the thread.
func TestDeadThreadRestartEscalation(t *testing.T) {
	for _, tc := range []struct {
		name    string
		threads []pluginapi.KVThread
		mode    Mode
		want    int
		reason  string
	}{
		{"bootstrap, auto", []pluginapi.KVThread{{Role: pluginapi.ThreadBootstrap, Function: "bootstrap_thread"}}, ModeAuto, 1,
			"KV manager thread bootstrap bootstrap_thread dead for 30s"},
		{"transfer worker, dry run", threadsOf(2, 1), ModeDryRun, 1, "KV manager thread transfer_worker transfer_worker of transfer queue 1 dead for 30s"},
		{"other", []pluginapi.KVThread{{Role: pluginapi.ThreadOther, Function: "_failed_session_probe_loop"}}, ModeAuto, 0, ""},
		{"heartbeat", []pluginapi.KVThread{{Role: pluginapi.ThreadHeartbeat, Function: "heartbeat_checker"}}, ModeAuto, 0, ""},
		{"restart off", threadsOf(2, 1), ModeOff, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := progressRank("http://127.0.0.1:28100", 2)
			p.setThreads(threadsOf(2))
			// An idle rank: a dead thread needs no request nor a running loop.
			p.freezeLoop = true
			h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
				c.Mode = ModeOff
				c.RestartMode, c.RestartMinInterval = tc.mode, time.Minute
			})
			h.tick(5)
			p.setThreads(tc.threads)
			h.tick(29)
			if p.restartCount() != 0 {
				t.Fatalf("restart asked %+v before the thread was dead for the stall window", p.restarts)
			}
			h.tick(300)
			if p.restartCount() != tc.want {
				t.Fatalf("restarts %+v, want %d", p.restarts, tc.want)
			}
			if tc.want == 0 {
				return
			}
			req := p.restarts[0]
			if req.PID != 7 || req.DryRun != (tc.mode == ModeDryRun) || !strings.Contains(req.Reason, tc.reason) {
				t.Fatalf("restart %+v", req)
			}
			ev := h.eventsOf(EventRestart)
			wantResult := RestartRestarted
			if tc.mode == ModeDryRun {
				wantResult = RestartWouldRestart
			}
			if len(ev) != 1 || ev[0].Reason != ruleThreadDead || ev[0].Result != wantResult {
				t.Fatalf("restart events %+v", ev)
			}
		})
	}
}

// A thread alive again on re-read (a listing that raced a restart) is
// not escalated.
func TestDeadThreadEvidenceGoneOnReRead(t *testing.T) {
	p := progressRank("http://127.0.0.1:28100", 1)
	p.setThreads(threadsOf(1, 0))
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Mode = ModeOff
		c.RestartMode, c.RestartMinInterval = ModeAuto, time.Minute
	})
	h.tick(29)
	h.clk.Advance(5 * time.Second)
	h.wd.mu.Lock()
	e := h.wd.restartCandidate()
	h.wd.mu.Unlock()
	if e == nil || e.thread == nil || e.thread.queue != 0 {
		t.Fatalf("escalation %+v, want transfer worker 0's", e)
	}
	p.setThreads(threadsOf(1))
	h.wd.restart(context.Background(), e)
	if p.restartCount() != 0 {
		t.Fatalf("restart %+v asked although the re-read shows the thread alive", p.restarts)
	}
}

func TestDeadThreadEscalatesPicksTheServingRole(t *testing.T) {
	cfg := testConfig()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	rk := &rankState{deadSince: map[threadKey]time.Time{
		{role: pluginapi.ThreadOther, function: "x", queue: unknownQueue}:                     t0,
		{role: pluginapi.ThreadTransferWorker, function: "transfer_worker", queue: 3}:         t0,
		{role: pluginapi.ThreadTransferWorker, function: "transfer_worker", queue: 1}:         t0.Add(10 * time.Second),
		{role: pluginapi.ThreadHeartbeat, function: "heartbeat_checker", queue: unknownQueue}: t0.Add(time.Minute),
	}}
	k, since, ok := deadThreadEscalates(rk, t0.Add(40*time.Second), &cfg)
	if !ok || k.role != pluginapi.ThreadTransferWorker || k.queue != 1 || !since.Equal(t0.Add(10*time.Second)) {
		t.Fatalf("picked %v since %v (%v), want transfer worker 1", k, since, ok)
	}
	if _, _, ok := deadThreadEscalates(rk, t0.Add(20*time.Second), &cfg); ok {
		t.Fatal("a thread dead for less than the stall window escalates")
	}
	if !rk.deadWorker(3) || rk.deadWorker(2) || rk.deadWorker(unknownQueue) {
		t.Fatal("deadWorker does not match the dead transfer workers")
	}
}
