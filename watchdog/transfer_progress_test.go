package watchdog

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// PostWedgeOrder plays the plugin's wedge order (docs/plugin-api.md,
// "Round 4 additions"): while worker transfer_queue holds chunk, it fails
// every room of the queue but health checks, Success rooms and rooms
// younger than min_age_seconds; a dry run lists them and fails nothing.
func (f *fakePlugin) PostWedgeOrder(_ context.Context, req pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error) {
	f.mu.Lock()
	f.orders = append(f.orders, req)
	answer := f.orderAnswer
	f.mu.Unlock()
	if answer != nil {
		return answer(req)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	held := false
	for _, tw := range f.workers {
		if tw.TransferQueue == req.TransferQueue && tw.InFlight != nil && tw.InFlight.Chunk == req.Chunk {
			held = true
		}
	}
	if !held {
		return http.StatusConflict, &pluginapi.WedgeOrderResponse{Result: pluginapi.ResultWedgeCleared, Failed: []pluginapi.FailedRoom{}}, nil
	}
	resp := &pluginapi.WedgeOrderResponse{Result: pluginapi.ResultOrdered, ExpiresInSeconds: req.TTLSeconds, Failed: []pluginapi.FailedRoom{}}
	if req.DryRun {
		resp.Result, resp.ExpiresInSeconds = pluginapi.ResultWouldOrder, 0
	}
	kept := f.rooms[:0]
	for _, r := range f.rooms {
		if r.TransferQueue == nil || *r.TransferQueue != req.TransferQueue || r.HealthCheck || r.Poll == pluginapi.PollSuccess || r.AgeSeconds < req.MinAgeSeconds {
			kept = append(kept, r)
			continue
		}
		resp.Failed = append(resp.Failed, pluginapi.FailedRoom{RID: r.RID, BootstrapRoom: r.BootstrapRoom, Levers: []string{pluginapi.LeverAbort}})
		if req.DryRun {
			kept = append(kept, r)
		}
	}
	f.rooms = kept
	return http.StatusOK, resp, nil
}

func (f *fakePlugin) orderCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.orders)
}

// progressRank is a prefill plugin that reports transfer_progress, with
// queues workers, each tracked and idle.
func progressRank(target string, queues int) *fakePlugin {
	p := newFakePlugin(target, 0)
	p.server.PID = 7
	p.server.TransferProgress = boolp(true)
	p.seesEveryWriter(1, 1)
	for q := 0; q < queues; q++ {
		p.workers = append(p.workers, pluginapi.TransferWorker{TransferQueue: q, Tracked: true, Recent: [][2]float64{}})
	}
	return p
}

// hold puts chunk of room in the hands of worker q, held for seconds.
func (f *fakePlugin) hold(q int, chunk int64, room uint64, pages int, seconds float64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.workers[q].InFlight = &pluginapi.ChunkInFlight{Chunk: chunk, BootstrapRoom: room, Pages: pages, Seconds: seconds}
	f.workers[q].ChunksTaken = chunk
}

// finish ends worker q's chunk, which took its seconds.
func (f *fakePlugin) finish(q int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	tw := &f.workers[q]
	if tw.InFlight != nil {
		tw.Recent = append(tw.Recent, [2]float64{float64(tw.InFlight.Pages), tw.InFlight.Seconds})
	}
	tw.InFlight = nil
}

// measured gives worker q n finished chunks of 64 pages at 64 pages/s.
func (f *fakePlugin) measured(q, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := 0; i < n; i++ {
		f.workers[q].Recent = append(f.workers[q].Recent, [2]float64{64, 1})
	}
}

// r4room is a room as a plugin with transfer_progress lists it
// (chunks_queued).
func r4room(rid string, roomID uint64, age float64, queue, queued int) pluginapi.Room {
	r := r2room(rid, roomID, age, queue, false)
	r.ChunksQueued = intp(queued)
	return r
}

// --- The rules, as pure functions -------------------------------------------

func samples(n int, pages, seconds float64) [][2]float64 {
	out := make([][2]float64, n)
	for i := range out {
		out[i] = [2]float64{pages, seconds}
	}
	return out
}

func TestChunkAllowance(t *testing.T) {
	cfg := testConfig()
	cfg.LinkMargin = DefaultLinkMargin
	for _, tc := range []struct {
		name  string
		pages int
		speed float64
		known bool
		want  time.Duration
	}{
		{"unknown speed: twice the deadline", 64, 0, false, 120 * time.Second},
		{"200x what its size needs", 64, 16, true, 800 * time.Second},
		{"a small chunk: the stall window", 1, 64, true, 30 * time.Second},
		{"aux-only: the stall window", 0, 64, true, 30 * time.Second},
		{"a huge chunk", 64000, 64, true, 200000 * time.Second},
	} {
		if got := chunkAllowance(tc.pages, tc.speed, tc.known, &cfg); got != tc.want {
			t.Errorf("%s: allowance %s, want %s", tc.name, got, tc.want)
		}
	}
}

// progressCase builds a rank with transfer_progress and a room on queue 0
// whose worker runs at 64 pages/s (when measured).
func progressCase(measured, tracked bool, c *pluginapi.ChunkInFlight) *rankState {
	ws := &workerState{tracked: tracked, inFlight: c, speedKnown: measured}
	if measured {
		ws.speed = 64
	}
	return &rankState{reportsTransferProgress: true, loopAdvancing: true, iterations: 200, workers: map[int]*workerState{0: ws}}
}

func TestProgressRoomStuck(t *testing.T) {
	cfg := testConfig()
	cfg.LinkMargin = DefaultLinkMargin
	now := time.Unix(10000, 0)
	own := func(pages int, seconds float64) *pluginapi.ChunkInFlight {
		return &pluginapi.ChunkInFlight{Chunk: 3, BootstrapRoom: 1, Pages: pages, Seconds: seconds}
	}
	other := &pluginapi.ChunkInFlight{Chunk: 2, BootstrapRoom: 9, Pages: 64, Seconds: 500}
	for _, tc := range []struct {
		name              string
		measured, tracked bool
		inFlight          *pluginapi.ChunkInFlight
		age               float64
		queued            int
		stillFor          time.Duration // since the room's last change
		health            bool
		want              bool
	}{
		// 64 pages at 64 pages/s take 1 s; at 1% of that, 100 s.
		{"at 10% of the measured speed", true, true, own(64, 10), 300, 0, time.Hour, false, false},
		{"at 1% of the measured speed", true, true, own(64, 100), 300, 0, time.Hour, false, false},
		{"at 0.5% of the measured speed, not quite done", true, true, own(64, 199), 300, 0, time.Hour, false, false},
		{"past 200x its time", true, true, own(64, 200), 300, 0, time.Hour, false, true},
		{"a huge chunk within its allowance", true, true, own(64000, 100000), 120000, 0, time.Hour, false, false},
		{"a huge chunk past its allowance", true, true, own(64000, 200000), 240000, 0, time.Hour, false, true},
		{"overdue, but the room is younger than the deadline", true, true, own(1, 40), 59, 0, time.Hour, false, false},
		{"unknown speed: past the deadline, within twice it", false, true, own(64, 119), 200, 0, time.Hour, false, false},
		{"unknown speed: past twice the deadline", false, true, own(64, 120), 200, 0, time.Hour, false, true},
		{"queued behind a slow chunk", true, true, other, 5000, 2, time.Hour, false, false},
		{"queued behind an overdue chunk (the wedge order's)", false, true, other, 5000, 1, time.Hour, false, false},
		{"silent pin: nothing in flight nor queued, past the stall window", true, true, nil, 61, 0, 31 * time.Second, false, true},
		{"silent pin: within the stall window", true, true, nil, 61, 0, 29 * time.Second, false, false},
		{"silent pin behind another room's chunk", true, true, other, 61, 0, 31 * time.Second, false, true},
		{"untracked worker: twice the deadline", true, false, nil, 119, 0, time.Hour, false, false},
		{"untracked worker past twice the deadline", true, false, nil, 120, 0, 31 * time.Second, false, true},
		{"a health check", false, true, own(64, 600), 600, 0, time.Hour, true, false},
	} {
		rk := progressCase(tc.measured, tc.tracked, tc.inFlight)
		r := &roomState{age: tc.age, queue: 0, chunksQueued: tc.queued, health: tc.health, lastChange: now.Add(-tc.stillFor), iterAtChange: 100}
		if got := roomStuck(1, r, rk, now, &cfg); got != tc.want {
			t.Errorf("%s: stuck %v, want %v", tc.name, got, tc.want)
		}
	}
	// A stalled scheduler loop makes every observation stale.
	rk := progressCase(true, true, own(64, 1000))
	rk.loopAdvancing = false
	if roomStuck(1, &roomState{age: 2000, lastChange: now.Add(-time.Hour)}, rk, now, &cfg) {
		t.Error("stuck while the loop does not advance")
	}
	// A room whose queue the listing does not report is judged as on an
	// untracked worker.
	rk = progressCase(true, true, nil)
	if roomStuck(1, &roomState{age: 100, queue: 5, lastChange: now.Add(-time.Hour), iterAtChange: 100}, rk, now, &cfg) {
		t.Error("a room on an unknown worker stuck before twice the deadline")
	}
}

func TestProgressWedges(t *testing.T) {
	cfg := testConfig()
	cfg.LinkMargin = DefaultLinkMargin
	chunk := func(room uint64, seconds float64) *pluginapi.ChunkInFlight {
		return &pluginapi.ChunkInFlight{Chunk: 7, BootstrapRoom: room, Pages: 1, Seconds: seconds}
	}
	for _, tc := range []struct {
		name              string
		measured, tracked bool
		inFlight          *pluginapi.ChunkInFlight
		roomAge           float64 // of room 1, listed when > 0
		prev              *transferWedge
		rule              string // "" for no wedge
	}{
		{"overdue, its room past the deadline", true, true, chunk(1, 31), 61, nil, wedgeOverdue},
		{"overdue, its room younger than the deadline", true, true, chunk(1, 31), 59, nil, ""},
		{"not overdue", false, true, chunk(1, 59), 500, nil, ""},
		{"untracked", false, false, chunk(1, 500), 500, nil, ""},
		{"an orphan held for the deadline", true, true, chunk(2, 60), 0, nil, wedgeOrphaned},
		{"an orphan overdue, held less than the deadline", true, true, chunk(2, 59), 0, nil, ""},
		{"nothing in flight", true, true, nil, 500, nil, ""},
		{"holds while the same chunk is in flight", true, true, chunk(2, 31), 0, &transferWedge{diagnosed: true, rule: wedgeOverdue, room: 2, chunk: 7}, wedgeOverdue},
		{"clears when the worker takes another chunk", true, true, &pluginapi.ChunkInFlight{Chunk: 8, BootstrapRoom: 1, Pages: 1, Seconds: 1}, 500,
			&transferWedge{diagnosed: true, rule: wedgeOverdue, room: 1, chunk: 7}, ""},
	} {
		rk := progressCase(tc.measured, tc.tracked, tc.inFlight)
		rk.rooms = map[roomKey]*roomState{}
		if tc.roomAge > 0 {
			rk.rooms[roomKey{"a", 1}] = &roomState{age: tc.roomAge}
		}
		rk.wedges = map[int]*transferWedge{}
		if tc.prev != nil {
			rk.wedges[0] = tc.prev
		}
		got := transferWedges(rk, time.Unix(10000, 0), &cfg)
		tw, ok := got[0]
		switch {
		case tc.rule == "" && ok:
			t.Errorf("%s: wedge %+v, want none", tc.name, tw)
		case tc.rule != "" && (!ok || tw.rule != tc.rule || !wedgeActionable(tw)):
			t.Errorf("%s: wedge %+v, want an actionable %s", tc.name, tw, tc.rule)
		}
	}
	// The stall rules act on nothing.
	if wedgeActionable(&transferWedge{diagnosed: true, rule: wedgeOrphaned, chunk: noChunk}) {
		t.Error("a wedge diagnosed without transfer_progress is actionable")
	}
}

// --- The watchdog with a plugin that reports transfer_progress -------------

func TestSlowTransfersNeverForceFailed(t *testing.T) {
	p := progressRank("http://127.0.0.1:28100", 2)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.FailFast, c.FailFastPerMinute = true, 100 })
	p.measured(0, 8)
	p.measured(1, 8)
	// "slow" has one chunk of 64 pages on queue 0 at 1% of the link's
	// measured speed (100 s); "behind" waits in the queue after it;
	// "big" holds queue 1 with a chunk of 6400 pages at 10% (1000 s).
	p.set(r4room("slow", 1, 0, 0, 0), r4room("behind", 2, 0, 0, 1), r4room("big", 3, 0, 1, 0))
	p.hold(0, 1, 1, 64, 0)
	p.hold(1, 1, 3, 6400, 0)
	h.tick(99)
	p.finish(0)
	p.drop("slow")
	p.set(r4room("behind", 2, 99, 0, 0), r4room("big", 3, 99, 1, 0))
	p.hold(0, 2, 2, 64, 0)
	h.tick(99)
	p.finish(0)
	p.drop("behind")
	h.tick(800)
	if n, m := p.callCount(), p.orderCount(); n != 0 || m != 0 {
		t.Fatalf("force-fails %d, wedge orders %d, want none: every transfer was live", n, m)
	}
	if w, _ := wedgeState(h, 0); w || len(h.eventsOf(EventStuck)) != 0 {
		t.Fatalf("wedged %v, stuck events %v", w, h.eventsOf(EventStuck))
	}
}

func TestSilentPinReleasedAtTheDeadline(t *testing.T) {
	p := progressRank("http://127.0.0.1:28100", 1)
	h := newMulti(t, []*fakePlugin{p}, nil)
	p.set(r4room("pin", 1, 0, 0, 0)) // nothing in flight nor queued
	h.tick(59)
	if p.callCount() != 0 {
		t.Fatal("force-failed before the deadline")
	}
	h.tick(1)
	if got := calledRIDs(p); got["pin"] != 1 {
		t.Fatalf("calls %v, want the pin force-failed at its deadline", got)
	}
}

// wedgedQueue is a rank with transfer_progress whose queue 0 worker holds
// chunk 5 of "head", with "b" and "c" queued behind it, and an idle queue 1.
func wedgedQueue(t *testing.T, mutate func(*Config)) (*multi, *fakePlugin, *fakeMetrics) {
	t.Helper()
	p := progressRank("http://127.0.0.1:28100", 2)
	m := metricsWith(0)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Metrics = m
		c.FailFast, c.FailFastPerMinute = true, 100
		if mutate != nil {
			mutate(c)
		}
	})
	p.set(r4room("head", 1, 0, 0, 0), r4room("b", 2, 0, 0, 1), r4room("c", 3, 0, 0, 2))
	// One page at a measured 64 pages/s: its allowance is the stall window.
	p.measured(0, 8)
	p.hold(0, 5, 1, 1, 0)
	return h, p, m
}

func TestWedgeOrderFailsTheQueueOnce(t *testing.T) {
	h, p, m := wedgedQueue(t, nil)
	h.tick(59)
	if p.orderCount() != 0 {
		t.Fatal("ordered before the deadline")
	}
	h.tick(1) // speed unknown: the chunk is overdue at the deadline
	if p.orderCount() != 1 {
		t.Fatalf("orders %d, want one", p.orderCount())
	}
	o := p.orders[0]
	if o.TransferQueue != 0 || o.Chunk != 5 || o.TTLSeconds != 10 || o.MinAgeSeconds != 2 || o.DryRun {
		t.Fatalf("order %+v", o)
	}
	if p.callCount() != 0 || holds(p, "head") || holds(p, "b") || holds(p, "c") {
		t.Fatalf("force-fails %d; rooms left %v; want the order alone to fail all three", p.callCount(), p.rooms)
	}
	m.addProgress(TransferFailedFamily, 3)
	h.wd.ScrapeMetrics(context.Background())
	h.tick(5)
	if n := h.count(ResultReleased, TriggerFailFast); n != 3 {
		t.Fatalf("released %d by fail-fast, want 3", n)
	}
	// Renewed while the wedge holds; a new room on the queue is failed
	// by a renewal.
	p.set(r4room("late", 6, 3, 0, 1))
	h.tick(1)
	if holds(p, "late") || p.orderCount() != 7 || p.callCount() != 0 {
		t.Fatalf("orders %d, calls %d, late held %v", p.orderCount(), p.callCount(), holds(p, "late"))
	}
	if s := h.wd.Snapshot().WedgeOrders; s[OrderPlaced] != 1 || s[OrderRenewed] != 6 {
		t.Fatalf("wedge orders %v", s)
	}
	// The chunk finishes: the wedge clears and nothing is renewed. One
	// closing call collects the rooms the order failed since its last
	// renewal ("last", failed by the plugin at a pass in between), which
	// the plugin reports with its 409.
	p.set(r4room("last", 7, 5, 0, 1))
	h.tick(1)
	p.drop("last")
	p.finish(0)
	p.orderAnswer = func(pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error) {
		return http.StatusConflict, &pluginapi.WedgeOrderResponse{Result: pluginapi.ResultWedgeCleared,
			Failed: []pluginapi.FailedRoom{{RID: "last", BootstrapRoom: 7, Levers: []string{pluginapi.LeverAbort}}}}, nil
	}
	h.tick(10)
	if p.orderCount() != 9 || p.orders[8].Chunk != 5 {
		t.Fatalf("orders %d after the wedge cleared, want one closing call and no renewal", p.orderCount())
	}
	if w, _ := wedgeState(h, 0); w {
		t.Fatal("still wedged")
	}
	m.addProgress(TransferFailedFamily, 2)
	h.wd.ScrapeMetrics(context.Background())
	h.tick(1)
	if n, s := h.count(ResultReleased, TriggerFailFast), h.wd.Snapshot().WedgeOrders; n != 5 || s[OrderCleared] != 1 || s[OrderRenewed] != 7 {
		t.Fatalf("released %d by fail-fast, want 5 (late and last too); wedge orders %v", n, s)
	}
}

func TestWedgeOrderClearedOnTheWay(t *testing.T) {
	h, p, _ := wedgedQueue(t, nil)
	h.tick(59)
	// The chunk moves on between the listing and the call: no order.
	p.beforeRead = func(read int) {
		if read == 61 {
			p.finish(0)
		}
	}
	h.tick(1)
	if p.orderCount() != 0 {
		t.Fatalf("orders %+v, want none: the re-read showed the chunk gone", p.orders)
	}
	// Or between the re-read and the call: 409, never renewed.
	h, p, _ = wedgedQueue(t, nil)
	p.orderAnswer = func(pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error) {
		return http.StatusConflict, &pluginapi.WedgeOrderResponse{Result: pluginapi.ResultWedgeCleared, Failed: []pluginapi.FailedRoom{}}, nil
	}
	h.tick(70)
	if p.orderCount() != 1 || h.wd.Snapshot().WedgeOrders[OrderCleared] != 1 {
		t.Fatalf("orders %d, results %v; want one, cleared", p.orderCount(), h.wd.Snapshot().WedgeOrders)
	}
}

func TestWedgeOrderBudgetCountsWedges(t *testing.T) {
	h, p, _ := wedgedQueue(t, func(c *Config) { c.FailFastPerMinute = 1 })
	p.set(append(p.rooms, r4room("other", 4, 0, 1, 0))...)
	// Queue 1's link is measured too: a link is paced by its own chunks.
	p.measured(1, 1)
	p.hold(1, 9, 4, 1, 0)
	h.tick(59)
	// Queue 1 wedges in the same cycle.
	h.tick(1)
	var placed []int
	for _, o := range p.orders {
		placed = append(placed, o.TransferQueue)
	}
	if len(placed) != 1 || placed[0] != 0 {
		t.Fatalf("orders for queues %v, want queue 0 only", placed)
	}
	s := h.wd.Snapshot().WedgeOrders
	if s[OrderPlaced] != 1 || s[OrderRateLimited] != 1 {
		t.Fatalf("wedge orders %v, want one placed, one rate limited", s)
	}
	// Renewals are free: queue 0's order is renewed each cycle, and
	// queue 1's goes out once a minute has passed.
	h.tick(60)
	q0, q1 := 0, 0
	for _, o := range p.orders {
		if o.TransferQueue == 0 {
			q0++
		} else {
			q1++
		}
	}
	if q0 != 61 || q1 == 0 {
		t.Fatalf("orders for queue 0: %d, queue 1: %d", q0, q1)
	}
}

func TestWedgeOrderModes(t *testing.T) {
	var logs syncBuffer
	h, p, _ := wedgedQueue(t, func(c *Config) { c.Mode, c.Logger = ModeDryRun, log.NewLogfmtLogger(&logs) })
	h.tick(70)
	if p.orderCount() != 1 || !p.orders[0].DryRun || !holds(p, "b") {
		t.Fatalf("dry-run orders %+v", p.orders)
	}
	if h.count(ResultWouldFlip, TriggerFailFast) != 3 || logs.count(`msg="wedge order would fail a room"`) != 3 || p.callCount() != 0 {
		t.Fatalf("would_flip %d, calls %d, logs:\n%s", h.count(ResultWouldFlip, TriggerFailFast), p.callCount(), logs.b.String())
	}
	h, p, _ = wedgedQueue(t, func(c *Config) { c.Mode = ModeOff })
	h.tick(70)
	if p.orderCount() != 0 || p.callCount() != 0 {
		t.Fatal("mode off sent something")
	}
	// Without fail-fast, the head room alone is force-failed at its
	// deadline; the rooms queued behind it wait for a restart.
	h, p, _ = wedgedQueue(t, func(c *Config) { c.FailFast = false })
	h.tick(70)
	if got := calledRIDs(p); p.orderCount() != 0 || len(got) != 1 || got["head"] != 1 {
		t.Fatalf("orders %d, calls %v", p.orderCount(), got)
	}
}

// An older plugin answers 404 (no such path): its rooms go the deadline
// path, and it is not asked again for the wedge.
func TestWedgeOrderUnsupportedFallsBack(t *testing.T) {
	h, p, _ := wedgedQueue(t, nil)
	p.orderAnswer = func(pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error) {
		return http.StatusNotFound, nil, errFake404
	}
	h.tick(62)
	if p.orderCount() != 1 || calledRIDs(p)["head"] != 1 || h.wd.Snapshot().WedgeOrders[OrderUnsupported] != 1 {
		t.Fatalf("orders %d, calls %v, results %v", p.orderCount(), calledRIDs(p), h.wd.Snapshot().WedgeOrders)
	}
}

var errFake404 = &fakeErr{"HTTP 404 with an unusable body"}

type fakeErr struct{ s string }

func (e *fakeErr) Error() string { return e.s }

// The ledger tells decode "stopped" only for rooms failed with no chunk
// in flight: never for the room whose chunk the worker holds.
func TestWedgeOrderLedger(t *testing.T) {
	var logs syncBuffer
	h, p, _ := wedgedQueue(t, func(c *Config) { c.Logger = log.NewLogfmtLogger(&logs) })
	// As the plugin does: the order fails the rooms at the scheduler's
	// next pass, and the next call reports them, after they left the
	// listing.
	p.orderAnswer = func(pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error) {
		return http.StatusOK, &pluginapi.WedgeOrderResponse{Result: pluginapi.ResultOrdered, Failed: []pluginapi.FailedRoom{}}, nil
	}
	h.tick(60)
	if p.orderCount() != 1 {
		t.Fatal("setup: no order")
	}
	p.drop("head")
	p.drop("b")
	p.orderAnswer = func(pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error) {
		return http.StatusOK, &pluginapi.WedgeOrderResponse{Result: pluginapi.ResultOrdered,
			Failed: []pluginapi.FailedRoom{{RID: "head", BootstrapRoom: 1}, {RID: "b", BootstrapRoom: 2}}}, nil
	}
	h.tick(1)
	if n := logs.count(`msg="wedge order failed a room"`); n != 2 || logs.count(`levers= age=60.0 poll=Transferring`) != 2 {
		t.Fatalf("%d audit lines, want 2 with the rooms' last known age:\n%s", n, logs.b.String())
	}
	if v := h.wd.PrefillVerdict(pluginapi.VerdictQuery{RID: "head", Room: 1, AgeSeconds: 1000}); v.Verdict != pluginapi.VerdictLive {
		t.Errorf("the wedged chunk's room: %+v, want live", v)
	}
	if v := h.wd.PrefillVerdict(pluginapi.VerdictQuery{RID: "b", Room: 2, AgeSeconds: 1000}); v.Verdict != pluginapi.VerdictStopped {
		t.Errorf("a room queued behind: %+v, want stopped", v)
	}
}

func TestNoFailFastNorRestartWithoutTransferProgress(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	p.server.PID = 7
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.FailFast, c.FailFastPerMinute = true, 100
		c.RestartMode, c.RestartMinInterval = ModeAuto, time.Minute
	})
	p.orphans = []pluginapi.OrphanedTransfer{{BootstrapRoom: 1, TransferQueue: intp(2), OutstandingChunks: 1}}
	p.set(r2room("old", 2, 0, 2, false))
	h.tick(31)
	if w, _ := wedgeState(h, 0); !w {
		t.Fatal("setup: no wedge diagnosed")
	}
	p.set(r2room("old", 2, 31, 2, false), r2room("behind", 10, 0, 2, false))
	h.tick(28)
	if n, m, r := p.callCount(), p.orderCount(), p.restartCount(); n != 0 || m != 0 || r != 0 {
		t.Fatalf("calls %d, orders %d, restarts %d before any deadline; want none", n, m, r)
	}
	// The deadline path still holds.
	h.tick(2)
	if got := calledRIDs(p); got["old"] != 1 || got["behind"] != 0 {
		t.Fatalf("calls %v", got)
	}
}

func TestRestartNeedsAnOverdueChunkForTheRestartWindow(t *testing.T) {
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Mode = ModeOff
		c.RestartMode, c.RestartMinInterval = ModeAuto, time.Minute
	})
	h.tick(60)
	if p.restartCount() != 0 {
		t.Fatal("restarted before the wedge held for the stall window")
	}
	h.tick(1)
	if p.restartCount() != 1 || !strings.Contains(p.restarts[0].Reason, "chunk 1 of room 1") {
		t.Fatalf("restarts %+v", p.restarts)
	}
}

// The floor of --watchdog.fail-fast-min-age goes with every order: the
// plugin fails no room younger than it.
func TestWedgeOrderNeverFailsAYoungRoom(t *testing.T) {
	h, p, _ := wedgedQueue(t, func(c *Config) { c.FailFastMinAge = 5 * time.Second })
	h.tick(60)
	if p.orderCount() != 1 || p.orders[0].MinAgeSeconds != 5 {
		t.Fatalf("orders %+v", p.orders)
	}
	p.set(r4room("young", 8, 0, 0, 1))
	h.tick(4)
	if !holds(p, "young") {
		t.Fatal("a room younger than the floor was failed")
	}
	h.tick(1)
	if holds(p, "young") {
		t.Fatal("the room was not failed once past the floor")
	}
}

// A watchdog that just (re)started judges a chunk only once it watched it
// for the stall window itself, however long the plugin says it was held.
func TestChunkJudgedOnlyOnceWatchedForTheStallWindow(t *testing.T) {
	cfg := testConfig()
	cfg.LinkMargin = DefaultLinkMargin
	now := time.Unix(10000, 0)
	for _, tc := range []struct {
		watched time.Duration
		want    bool
	}{{29 * time.Second, false}, {30 * time.Second, true}} {
		rk := progressCase(true, true, &pluginapi.ChunkInFlight{Chunk: 3, BootstrapRoom: 1, Pages: 64, Seconds: 5000})
		rk.workers[0].chunkSeen = now.Add(-tc.watched)
		r := &roomState{age: 6000, queue: 0, lastChange: now.Add(-time.Hour), iterAtChange: 100}
		if got := roomStuck(1, r, rk, now, &cfg); got != tc.want {
			t.Errorf("watched for %s: stuck %v, want %v", tc.watched, got, tc.want)
		}
		if got := len(progressWedges(rk, now, &cfg)) == 1; got != tc.want {
			t.Errorf("watched for %s: wedged %v, want %v", tc.watched, got, tc.want)
		}
	}
}
