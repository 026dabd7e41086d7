package watchdog

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// fakePlugin is an in-memory plugin rank: the test sets the rooms and the
// loop counter, and decides how admin calls are answered.
type fakePlugin struct {
	mu         sync.Mutex
	target     string
	server     pluginapi.Server
	iterations uint64
	rooms      []pluginapi.Room
	listErr    error
	answer     func(pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error)
	calls      []pluginapi.ForceFailRequest
	// freezeLoop stops the loop counter.
	freezeLoop bool
	// orphans is the listing's orphaned_transfers.
	orphans []pluginapi.OrphanedTransfer
	// restartAnswer answers POST /admin/restart; nil answers 202.
	restartAnswer func(pluginapi.RestartRequest) (int, *pluginapi.RestartResponse, error)
	restarts      []pluginapi.RestartRequest
	// workers is the listing's transfer_workers (server.TransferProgress
	// says whether it reports them), and POST /admin/wedge_order; nil
	// orderAnswer plays the plugin (fakePlugin.wedgeOrder).
	workers []pluginapi.TransferWorker
	// peers is peer_transfer_workers, the other ranks' workers.
	peers       []pluginapi.PeerWorkers
	orderAnswer func(pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error)
	orders      []pluginapi.WedgeOrderRequest
	// threads is the listing's kv_threads; nil: not reported.
	threads []pluginapi.KVThread
	readHook
}

// readHook counts a fake plugin's listing reads; beforeRead, if set, runs
// at the start of each read, under no lock.
type readHook struct {
	reads      int
	beforeRead func(read int)
}

// begin counts a read under mu, then runs beforeRead outside it.
func (h *readHook) begin(mu *sync.Mutex) {
	mu.Lock()
	h.reads++
	read, hook := h.reads, h.beforeRead
	mu.Unlock()
	if hook != nil {
		hook(read)
	}
}

func newFakePlugin(target string, dp int) *fakePlugin {
	return &fakePlugin{target: target, server: pluginapi.Server{DPRank: dp, DisaggregationMode: "prefill", TransferBackend: "nixl"}}
}

// seesEveryWriter makes the listing read each room's outstanding chunks on
// every rank of a group of n (transfer_tracking, transfer_ranks), watched
// of them fresh.
func (f *fakePlugin) seesEveryWriter(n, watched int) {
	f.server.TransferTracking = boolp(true)
	f.server.TransferRanks, f.server.TransferRanksWatched = intp(n), intp(watched)
}

func (f *fakePlugin) Target() string { return f.target }

func (f *fakePlugin) Inflight(context.Context) (*pluginapi.Listing, error) {
	f.begin(&f.mu)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.listErr != nil {
		return nil, f.listErr
	}
	if !f.freezeLoop {
		f.iterations += 100
	}
	var peers []pluginapi.PeerWorkers
	for _, p := range f.peers {
		peers = append(peers, pluginapi.PeerWorkers{Rank: p.Rank, TransferWorkers: copyWorkers(p.TransferWorkers)})
	}
	return &pluginapi.Listing{APIVersion: 1, Server: f.server, Loop: pluginapi.Loop{Iterations: f.iterations},
		Queues: pluginapi.Queues{Inflight: len(f.rooms)}, Inflight: append([]pluginapi.Room(nil), f.rooms...),
		OrphanedTransfers: append([]pluginapi.OrphanedTransfer(nil), f.orphans...), TransferWorkers: copyWorkers(f.workers),
		PeerTransferWorkers: peers, KVThreads: slices.Clone(f.threads)}, nil
}

// copyWorkers copies workers and the chunks they hold, as a listing is a
// moment of the plugin's state.
func copyWorkers(workers []pluginapi.TransferWorker) []pluginapi.TransferWorker {
	var out []pluginapi.TransferWorker
	for _, tw := range workers {
		if tw.InFlight != nil {
			c := *tw.InFlight
			tw.InFlight = &c
		}
		out = append(out, tw)
	}
	return out
}

func (f *fakePlugin) ForceFail(_ context.Context, req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
	f.mu.Lock()
	f.calls = append(f.calls, req)
	answer := f.answer
	f.mu.Unlock()
	if answer != nil {
		return answer(req)
	}
	res := pluginapi.ResultFlipped
	if req.DryRun {
		res = pluginapi.ResultWouldFlip
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !req.DryRun {
		// The scheduler's Failed branch releases the request.
		kept := f.rooms[:0]
		for _, r := range f.rooms {
			if r.RID != req.RID {
				kept = append(kept, r)
			}
		}
		f.rooms = kept
	}
	return http.StatusOK, &pluginapi.ForceFailResponse{Result: res, RID: req.RID, BootstrapRoom: req.BootstrapRoom, Lever: pluginapi.LeverSendFailed, AppliedUnix: 1}, nil
}

func (f *fakePlugin) set(rooms ...pluginapi.Room) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rooms = rooms
}

// age adds d to every room's age, as the scheduler's clock would.
func (f *fakePlugin) age(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.rooms {
		f.rooms[i].AgeSeconds += d.Seconds()
	}
	for i := range f.workers {
		if c := f.workers[i].InFlight; c != nil {
			c.Seconds += d.Seconds()
		}
	}
	for _, p := range f.peers {
		for i := range p.TransferWorkers {
			if c := p.TransferWorkers[i].InFlight; c != nil {
				c.Seconds += d.Seconds()
			}
		}
	}
}

func (f *fakePlugin) progress(rid string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.rooms {
		if f.rooms[i].RID == rid {
			f.rooms[i].Progress++
		}
	}
}

func (f *fakePlugin) callCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

// fakeMetrics is an in-memory SGLang /metrics.
type fakeMetrics struct {
	mu     sync.Mutex
	sample MetricsSample
	err    error
}

func (m *fakeMetrics) Target() string { return "http://127.0.0.1:30000/metrics" }

func (m *fakeMetrics) Scrape(context.Context) (*MetricsSample, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return nil, m.err
	}
	s := MetricsSample{Gauges: map[GaugeKey]float64{}, Progress: map[string]float64{}}
	for k, v := range m.sample.Gauges {
		s.Gauges[k] = v
	}
	for k, v := range m.sample.Progress {
		s.Progress[k] = v
	}
	return &s, nil
}

func (m *fakeMetrics) setGauge(v float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sample.Gauges = map[GaugeKey]float64{{Queue: QueuePrefillInflight, DP: "0", PP: "0", TP: "0"}: v}
}

func (m *fakeMetrics) addProgress(family string, d float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sample.Progress == nil {
		m.sample.Progress = map[string]float64{}
	}
	m.sample.Progress[family] += d
}

type harness struct {
	t      *testing.T
	clk    *clock.Fake
	wd     *Watchdog
	plugin *fakePlugin
	events []Event
	mu     sync.Mutex
}

func testConfig() Config {
	return Config{
		Interval: time.Second, MetricsInterval: 15 * time.Second,
		Deadline: 60 * time.Second, StallWindow: 30 * time.Second, PinWindow: 2 * time.Minute,
		MaxRooms: 1000, Mode: ModeAuto, MaxPerMinute: 6, ConfirmTimeout: 60 * time.Second,
	}
}

func newHarness(t *testing.T, mutate func(*Config)) *harness {
	t.Helper()
	h := &harness{t: t, clk: clock.NewFake(time.Now()), plugin: newFakePlugin("http://127.0.0.1:28100", 0)}
	cfg := testConfig()
	cfg.Clock = h.clk
	cfg.Plugins = []PluginSource{h.plugin}
	cfg.OnEvent = func(e Event) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.events = append(h.events, e)
	}
	h.wd = newWatchdog(t, cfg, mutate)
	return h
}

// newWatchdog builds a watchdog from cfg changed by mutate (if not nil),
// failing the test on a configuration error.
func newWatchdog(t *testing.T, cfg Config, mutate func(*Config)) *Watchdog {
	t.Helper()
	if mutate != nil {
		mutate(&cfg)
	}
	wd, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return wd
}

// tick advances every clock by one second and runs one cycle.
func (h *harness) tick(n int) {
	for i := 0; i < n; i++ {
		h.clk.Advance(time.Second)
		h.plugin.age(time.Second)
		h.wd.RunCycle(context.Background())
	}
}

func (h *harness) stuck() int {
	s := h.wd.Snapshot()
	if len(s.Ranks) == 0 {
		return 0
	}
	return s.Ranks[0].Stuck
}

func (h *harness) count(result, trigger string) uint64 {
	return h.wd.Snapshot().ForceFails[[2]string{result, trigger}]
}

func room(rid string, roomID uint64, age float64) pluginapi.Room {
	return pluginapi.Room{RID: rid, BootstrapRoom: roomID, Poll: pluginapi.PollTransferring, AgeSeconds: age, Progress: 3}
}

func TestStuckNeedsDeadlineAndFullStallWindow(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	h.plugin.set(room("r1", 1, 0))
	h.tick(59)
	if h.stuck() != 0 {
		t.Fatal("a 59 s old room is stuck before the 60 s deadline")
	}
	h.tick(1)
	if h.stuck() != 1 {
		t.Fatalf("a 60 s old room with no change for 60 s is not stuck")
	}
}

func TestProgressResetsTheStallWindow(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	h.plugin.set(room("slow", 1, 0))
	for i := 0; i < 300; i++ {
		if i%29 == 0 {
			h.plugin.progress("slow")
		}
		h.tick(1)
		if h.stuck() != 0 {
			t.Fatalf("at %ds a room progressing every 29 s is stuck", i+1)
		}
	}
}

func TestPollChangeCountsAsProgress(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	r := room("r", 1, 100)
	r.Poll = pluginapi.PollWaitingForInput
	h.plugin.set(r)
	h.tick(29)
	r.Poll = pluginapi.PollTransferring
	r.AgeSeconds = 129
	h.plugin.set(r)
	h.tick(30) // the change is seen on the first of these cycles
	if h.stuck() != 0 {
		t.Fatal("stuck 29 s after a poll change")
	}
	h.tick(1)
	if h.stuck() != 1 {
		t.Fatal("not stuck 30 s after the last poll change")
	}
}

func TestStuckAfterRestartNeedsAFullWindow(t *testing.T) {
	// A watchdog that starts next to an old room has seen no stall yet.
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	h.plugin.set(room("old", 1, 900))
	h.tick(30) // first sight on the first of these cycles
	if h.stuck() != 0 {
		t.Fatal("stuck before a full stall window was observed")
	}
	h.tick(1)
	if h.stuck() != 1 {
		t.Fatal("not stuck after a full stall window")
	}
}

func TestHealthCheckIsNeverStuck(t *testing.T) {
	h := newHarness(t, nil)
	hc := pluginapi.Room{RID: "HEALTH_CHECK_1764403200.0", BootstrapRoom: 0, Poll: pluginapi.PollWaitingForInput, AgeSeconds: 500, HealthCheck: true}
	h.plugin.set(hc)
	h.tick(120)
	if h.stuck() != 0 || h.plugin.callCount() != 0 {
		t.Fatalf("health check: stuck=%d calls=%d, want 0 and 0", h.stuck(), h.plugin.callCount())
	}
}

func TestWedgedLoopBlocksVerdictsAndActions(t *testing.T) {
	h := newHarness(t, nil)
	h.plugin.set(room("r", 1, 100))
	h.tick(1)
	h.plugin.freezeLoop = true
	h.tick(40)
	s := h.wd.Snapshot()
	if !s.Ranks[0].Wedged {
		t.Fatal("loop frozen 40 s with a room present is not reported wedged")
	}
	if s.Ranks[0].Stuck != 0 || h.plugin.callCount() != 0 {
		t.Fatalf("wedged rank: stuck=%d calls=%d; stale observations must not count", s.Ranks[0].Stuck, h.plugin.callCount())
	}
	h.plugin.freezeLoop = false
	h.tick(1)
	if h.wd.Snapshot().Ranks[0].Wedged {
		t.Fatal("still wedged after the loop moved")
	}
}

func TestIdleLoopIsNotWedged(t *testing.T) {
	h := newHarness(t, nil)
	h.plugin.freezeLoop = true
	h.tick(120)
	if h.wd.Snapshot().Ranks[0].Wedged {
		t.Fatal("a still loop counter with an empty queue is reported wedged")
	}
}

func TestForgetsRoomsThatLeftAndObservesTheirAge(t *testing.T) {
	h := newHarness(t, nil)
	h.plugin.set(room("a", 1, 0), room("b", 2, 0))
	h.tick(3)
	h.plugin.set(room("b", 2, 3))
	h.tick(1)
	s := h.wd.Snapshot()
	if s.TrackedRooms != 1 {
		t.Fatalf("tracked %d rooms, want 1", s.TrackedRooms)
	}
	if s.Ranks[0].AgeCount != 1 || s.Ranks[0].AgeSum != 3 {
		t.Fatalf("age histogram count=%d sum=%v, want 1 and 3", s.Ranks[0].AgeCount, s.Ranks[0].AgeSum)
	}
}

func TestRoomReusedWithNewRIDIsANewRequest(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	h.plugin.set(room("old-rid", 7, 0))
	h.tick(100)
	if h.stuck() != 1 {
		t.Fatal("setup: room not stuck")
	}
	h.plugin.set(room("new-rid", 7, 0))
	h.tick(1)
	if h.stuck() != 0 {
		t.Fatal("a new request in a reused room inherited the old one's stall")
	}
}

func TestModeOffDetectsButNeverCalls(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	h.plugin.set(room("r", 1, 0))
	h.tick(120)
	if h.plugin.callCount() != 0 {
		t.Fatalf("mode off made %d calls", h.plugin.callCount())
	}
	if got := h.wd.Snapshot().Skips[SkipModeOff]; got != 1 {
		t.Fatalf("mode_off skips = %d, want 1 (once per room)", got)
	}
}

func TestDryRunSendsDryRunOncePerRoom(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeDryRun })
	h.plugin.set(room("r", 1, 0))
	h.tick(200)
	if h.plugin.callCount() != 1 {
		t.Fatalf("dry-run made %d calls for one room, want 1", h.plugin.callCount())
	}
	if !h.plugin.calls[0].DryRun {
		t.Fatal("dry-run mode sent dry_run=false")
	}
	if h.count(ResultWouldFlip, TriggerAuto) != 1 {
		t.Fatal("would_flip not counted")
	}
}

func TestSwitchFromDryRunToAutoActs(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeDryRun })
	h.plugin.set(room("r", 1, 0))
	h.tick(70)
	h.wd.SetMode(ModeAuto)
	h.tick(1)
	if h.plugin.callCount() != 2 || h.plugin.calls[1].DryRun {
		t.Fatalf("calls %+v, want a dry run then one real call", h.plugin.calls)
	}
	h.tick(10)
	if h.plugin.callCount() != 2 {
		t.Fatalf("%d calls, want 2", h.plugin.callCount())
	}
}

func TestAutoReleasesAndConfirms(t *testing.T) {
	m := &fakeMetrics{}
	m.addProgress(TransferFailedFamily, 5)
	h := newHarness(t, func(c *Config) { c.Metrics = m })
	h.wd.ScrapeMetrics(context.Background())
	h.plugin.set(room("r", 9223372036854775001, 0))
	h.tick(60)
	if h.plugin.callCount() != 1 {
		t.Fatalf("auto made %d calls, want 1", h.plugin.callCount())
	}
	call := h.plugin.calls[0]
	if call.DryRun || call.RID != "r" || call.BootstrapRoom == nil || *call.BootstrapRoom != 9223372036854775001 {
		t.Fatalf("bad order %+v", call)
	}
	h.tick(1) // the room has left the listing
	if h.count(ResultReleased, TriggerAuto) != 0 {
		t.Fatal("released counted before the transfer-failed counter rose")
	}
	m.addProgress(TransferFailedFamily, 1)
	h.wd.ScrapeMetrics(context.Background())
	if h.count(ResultReleased, TriggerAuto) != 1 {
		t.Fatal("release not confirmed after the room left and the counter rose")
	}
}

// TestConfirmsAReleaseCountedBeforeTheAnswer covers a /metrics read that
// lands after the scheduler released the request but before the admin call
// answered: the counter already includes the release.
func TestConfirmsAReleaseCountedBeforeTheAnswer(t *testing.T) {
	m := &fakeMetrics{}
	m.addProgress(TransferFailedFamily, 5)
	h := newHarness(t, func(c *Config) { c.Metrics = m })
	h.wd.ScrapeMetrics(context.Background())
	h.plugin.answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
		h.plugin.mu.Lock()
		h.plugin.rooms = nil
		h.plugin.mu.Unlock()
		m.addProgress(TransferFailedFamily, 1)
		h.wd.ScrapeMetrics(context.Background())
		return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultFlipped, RID: req.RID, Lever: pluginapi.LeverSendFailed}, nil
	}
	h.plugin.set(room("r", 1, 0))
	h.tick(61)
	if got := h.count(ResultReleased, TriggerAuto); got != 1 {
		t.Fatalf("released = %d, unconfirmed = %d; want the release confirmed", got, h.count(ResultUnconfirmed, TriggerAuto))
	}
}

func TestUnconfirmedWhenTheRoomStays(t *testing.T) {
	h := newHarness(t, nil)
	h.plugin.answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
		return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultFlipped, RID: req.RID, Lever: pluginapi.LeverSendFailed}, nil
	}
	h.plugin.set(room("r", 1, 0))
	h.tick(60 + 59)
	if h.count(ResultUnconfirmed, TriggerAuto) != 0 {
		t.Fatal("unconfirmed before the confirm timeout")
	}
	h.tick(1)
	if h.count(ResultUnconfirmed, TriggerAuto) != 1 {
		t.Fatal("not unconfirmed after the confirm timeout")
	}
	if h.plugin.callCount() != 1 {
		t.Fatalf("%d calls for one room, want 1", h.plugin.callCount())
	}
}

func TestRateLimit(t *testing.T) {
	var plugins []*fakePlugin
	h := newHarness(t, func(c *Config) {
		c.Plugins = nil
		for i := 0; i < 8; i++ {
			p := newFakePlugin(fmt.Sprintf("http://127.0.0.1:%d", 28100+i), i)
			p.set(room(fmt.Sprintf("r%d", i), uint64(i+1), 0))
			plugins = append(plugins, p)
			c.Plugins = append(c.Plugins, p)
		}
	})
	calls := func() int {
		n := 0
		for _, p := range plugins {
			n += p.callCount()
		}
		return n
	}
	tick := func(n int) {
		for i := 0; i < n; i++ {
			h.clk.Advance(time.Second)
			for _, p := range plugins {
				p.age(time.Second)
			}
			h.wd.RunCycle(context.Background())
		}
	}
	tick(60)
	if got := calls(); got != 6 {
		t.Fatalf("%d calls in the first minute, want 6", got)
	}
	if got := h.wd.Snapshot().Skips[SkipRateLimited]; got != 2 {
		t.Fatalf("rate_limited skips = %d, want 2", got)
	}
	tick(59)
	if got := calls(); got != 6 {
		t.Fatalf("%d calls within 60 s of the first six, want 6", got)
	}
	tick(1)
	if got := calls(); got != 8 {
		t.Fatalf("%d calls once the window moved, want 8", got)
	}
}

func TestProgressBetweenDecisionAndActionCancels(t *testing.T) {
	h := newHarness(t, nil)
	h.plugin.set(room("r", 1, 0))
	h.tick(59)
	// The next cycle decides; the actuator's re-read then sees progress.
	base := h.plugin.reads
	h.plugin.beforeRead = func(read int) {
		if read == base+2 {
			h.plugin.progress("r")
		}
	}
	h.tick(1)
	if h.plugin.callCount() != 0 {
		t.Fatal("force-failed a request that progressed after the decision")
	}
	if got := h.wd.Snapshot().Skips[SkipProgressed]; got != 1 {
		t.Fatalf("progressed skips = %d, want 1", got)
	}
	h.plugin.beforeRead = nil
	h.tick(29)
	if h.plugin.callCount() != 0 {
		t.Fatal("called before a new full stall window after the progress")
	}
}

func TestErrorsRetryWithBackoffThenGiveUp(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxAttempts = 3; c.RetryBackoff = 10 * time.Second })
	h.plugin.answer = func(pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
		return 0, nil, errors.New("connection refused")
	}
	h.plugin.set(room("r", 1, 0))
	h.tick(60)
	if h.plugin.callCount() != 1 {
		t.Fatalf("calls = %d, want 1", h.plugin.callCount())
	}
	h.tick(9)
	if h.plugin.callCount() != 1 {
		t.Fatal("retried before the 10 s backoff")
	}
	h.tick(1)
	if h.plugin.callCount() != 2 {
		t.Fatalf("calls = %d after 10 s, want 2", h.plugin.callCount())
	}
	h.tick(20)
	if h.plugin.callCount() != 3 {
		t.Fatalf("calls = %d after a further 20 s, want 3", h.plugin.callCount())
	}
	h.tick(300)
	if h.plugin.callCount() != 3 || h.count(ResultError, TriggerAuto) != 3 {
		t.Fatalf("calls = %d, errors = %d; want 3 and 3 (bounded retries)", h.plugin.callCount(), h.count(ResultError, TriggerAuto))
	}
}

func TestAnswersMapToResults(t *testing.T) {
	for _, tc := range []struct {
		status int
		result string
		want   string
	}{
		{http.StatusNotFound, pluginapi.ResultNotFound, ResultNotFound},
		{http.StatusConflict, pluginapi.ResultRoomMismatch, ResultRejected},
		{http.StatusUnauthorized, pluginapi.ResultUnauthorized, ResultRejected},
		{http.StatusBadRequest, pluginapi.ResultBadRequest, ResultRejected},
	} {
		h := newHarness(t, nil)
		h.plugin.answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
			return tc.status, &pluginapi.ForceFailResponse{Result: tc.result, RID: req.RID}, nil
		}
		h.plugin.set(room("r", 1, 0))
		h.tick(200)
		if h.plugin.callCount() != 1 || h.count(tc.want, TriggerAuto) != 1 {
			t.Errorf("HTTP %d: calls=%d %s=%d, want 1 and 1", tc.status, h.plugin.callCount(), tc.want, h.count(tc.want, TriggerAuto))
		}
	}
}

func TestFailedListingNeverActsAndKeepsVerdicts(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	h.plugin.set(room("r", 1, 0))
	h.tick(60)
	if h.stuck() != 1 {
		t.Fatal("setup: not stuck")
	}
	h.wd.SetMode(ModeAuto)
	h.plugin.listErr = errors.New("HTTP 500")
	h.tick(10)
	s := h.wd.Snapshot()
	if s.Sources[0].Up || s.Sources[0].Failures != 10 {
		t.Fatalf("source up=%v failures=%d, want false and 10", s.Sources[0].Up, s.Sources[0].Failures)
	}
	if s.Ranks[0].Stuck != 1 {
		t.Fatal("a failing listing turned the stuck count into 0")
	}
	if h.plugin.callCount() != 0 {
		t.Fatal("acted on a rank whose listing failed")
	}
}

func TestPinnedGauge(t *testing.T) {
	cases := []struct {
		name       string
		step       func(m *fakeMetrics, i int)
		wantPinned bool
	}{
		{"idle server, gauge 0", func(m *fakeMetrics, i int) { m.setGauge(0) }, false},
		{"busy healthy, gauge moves", func(m *fakeMetrics, i int) {
			m.setGauge(float64(1 + i%3))
			m.addProgress("sglang:num_requests_total", 4)
		}, false},
		{"busy healthy, gauge constant, completions", func(m *fakeMetrics, i int) {
			m.setGauge(2)
			m.addProgress("sglang:prompt_tokens_total", 1000)
		}, false},
		{"frozen at 1, nothing moves", func(m *fakeMetrics, i int) { m.setGauge(1) }, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := &fakeMetrics{}
			h := newHarness(t, func(c *Config) { c.Metrics = m; c.Plugins = nil })
			for i := 0; i <= 10; i++ { // 150 s at 15 s
				tc.step(m, i)
				h.wd.ScrapeMetrics(context.Background())
				h.clk.Advance(15 * time.Second)
			}
			h.wd.ScrapeMetrics(context.Background())
			s := h.wd.Snapshot()
			if len(s.Gauges) != 1 || s.Gauges[0].Pinned != tc.wantPinned {
				t.Fatalf("gauges %+v, want pinned=%v", s.Gauges, tc.wantPinned)
			}
		})
	}
}

func TestPinnedGaugeWaitsForTheWindow(t *testing.T) {
	m := &fakeMetrics{}
	m.setGauge(1)
	h := newHarness(t, func(c *Config) { c.Metrics = m; c.Plugins = nil })
	h.wd.ScrapeMetrics(context.Background())
	h.clk.Advance(119 * time.Second)
	h.wd.ScrapeMetrics(context.Background())
	if h.wd.Snapshot().Gauges[0].Pinned {
		t.Fatal("pinned before the 2 m window")
	}
	h.clk.Advance(time.Second)
	h.wd.ScrapeMetrics(context.Background())
	if !h.wd.Snapshot().Gauges[0].Pinned {
		t.Fatal("not pinned after the 2 m window")
	}
	m.mu.Lock()
	m.err = errors.New("timeout")
	m.mu.Unlock()
	h.wd.ScrapeMetrics(context.Background())
	if h.wd.Snapshot().Gauges[0].Pinned {
		t.Fatal("still pinned while SGLang cannot be read")
	}
}

func TestRoomLimit(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxRooms = 2; c.Mode = ModeOff })
	h.plugin.set(room("a", 1, 0), room("b", 2, 0), room("c", 3, 0))
	h.tick(2)
	s := h.wd.Snapshot()
	if s.TrackedRooms != 2 || s.RoomLimitHits != 2 {
		t.Fatalf("tracked=%d hits=%d, want 2 and 2", s.TrackedRooms, s.RoomLimitHits)
	}
}

func TestTriggerRankActsEvenInDryRunButNotWhenOff(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Mode = ModeOff })
	h.plugin.set(room("r", 1, 0))
	h.tick(61)
	if _, err := h.wd.TriggerRank(context.Background(), 0, 0); err == nil {
		t.Fatal("alert trigger acted with mode off")
	}
	h.wd.SetMode(ModeDryRun)
	if _, err := h.wd.TriggerRank(context.Background(), 3, 0); err == nil {
		t.Fatal("alert trigger accepted an unknown rank")
	}
	n, err := h.wd.TriggerRank(context.Background(), 0, 0)
	if err != nil || n != 1 {
		t.Fatalf("TriggerRank = %d, %v; want 1, nil", n, err)
	}
	if h.plugin.callCount() != 1 || h.plugin.calls[0].DryRun {
		t.Fatalf("calls %+v, want one real call", h.plugin.calls)
	}
}
