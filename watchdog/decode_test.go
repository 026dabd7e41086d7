package watchdog

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// fakeDecode is an in-memory decode plugin rank that answers force-fails
// as docs/plugin-api.md ("Round 3 additions") says: health_check,
// transfer_succeeded, and transfer_live for a started, unfinished
// transfer without the prefill_stopped assertion.
type fakeDecode struct {
	mu         sync.Mutex
	target     string
	server     pluginapi.Server
	iterations uint64
	reqs       []pluginapi.DecodeRequest
	// legacy lists no decode_requests at all (a plugin older than decode
	// support).
	legacy bool
	calls  []pluginapi.ForceFailRequest
	// startedNow marks transfers that began after the last listing: the
	// plugin checks its live state, the listing lags.
	startedNow map[string]bool
	readHook
}

func newFakeDecode(target string, dp int) *fakeDecode {
	return &fakeDecode{target: target, server: pluginapi.Server{DPRank: dp, DisaggregationMode: pluginapi.ModeDecode, TransferBackend: "nixl",
		Levers: []string{pluginapi.LeverAbort}}}
}

func (f *fakeDecode) Target() string { return f.target }

func (f *fakeDecode) Inflight(context.Context) (*pluginapi.Listing, error) {
	f.begin(&f.mu)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.iterations += 100
	l := &pluginapi.Listing{APIVersion: 1, Server: f.server, Loop: pluginapi.Loop{Iterations: f.iterations}, Inflight: []pluginapi.Room{}}
	if !f.legacy {
		l.DecodeRequests = append([]pluginapi.DecodeRequest{}, f.reqs...)
	}
	for _, r := range f.reqs {
		if r.Queue == pluginapi.DecodeQueuePrealloc {
			l.Queues.Prealloc++
		} else {
			l.Queues.Transfer++
		}
	}
	return l, nil
}

func (f *fakeDecode) ForceFail(_ context.Context, req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, req)
	for i, r := range f.reqs {
		if r.RID != req.RID {
			continue
		}
		room := r.BootstrapRoom
		refuse := func(result string) (int, *pluginapi.ForceFailResponse, error) {
			return http.StatusConflict, &pluginapi.ForceFailResponse{Result: result, RID: r.RID, BootstrapRoom: &room, Error: result}, nil
		}
		switch {
		case r.HealthCheck:
			return refuse(pluginapi.ResultHealthCheck)
		case r.Poll == pluginapi.PollSuccess:
			return refuse(pluginapi.ResultTransferSucceeded)
		case (r.TransferStarted == nil || *r.TransferStarted || f.startedNow[r.RID]) && r.Poll != pluginapi.PollFailed && !req.PrefillStopped:
			return refuse(pluginapi.ResultTransferLive)
		}
		if req.DryRun {
			return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultWouldFlip, RID: r.RID, BootstrapRoom: &room, Levers: []string{pluginapi.LeverAbort}}, nil
		}
		f.reqs = append(f.reqs[:i:i], f.reqs[i+1:]...)
		return http.StatusOK, &pluginapi.ForceFailResponse{Result: pluginapi.ResultFlipped, RID: r.RID, BootstrapRoom: &room, Levers: []string{pluginapi.LeverAbort}}, nil
	}
	return http.StatusNotFound, &pluginapi.ForceFailResponse{Result: pluginapi.ResultNotFound, RID: req.RID}, nil
}

func (f *fakeDecode) set(reqs ...pluginapi.DecodeRequest) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reqs = reqs
}

func (f *fakeDecode) update(rid string, fn func(*pluginapi.DecodeRequest)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.reqs {
		if f.reqs[i].RID == rid {
			fn(&f.reqs[i])
		}
	}
}

func (f *fakeDecode) age(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.reqs {
		f.reqs[i].AgeSeconds += d.Seconds()
	}
}

func (f *fakeDecode) orders() []pluginapi.ForceFailRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]pluginapi.ForceFailRequest(nil), f.calls...)
}

// fakeVerdicts is a prefill verdict source that records its lookups.
type fakeVerdicts struct {
	mu      sync.Mutex
	answer  func(addr string, room uint64) (pluginapi.RoomVerdict, error)
	lookups []string
}

func (v *fakeVerdicts) Verdict(_ context.Context, q pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.lookups = append(v.lookups, q.BootstrapAddr)
	return v.answer(q.BootstrapAddr, q.Room)
}

func (v *fakeVerdicts) count() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.lookups)
}

func verdictOf(verdict string) func(string, uint64) (pluginapi.RoomVerdict, error) {
	return func(_ string, room uint64) (pluginapi.RoomVerdict, error) {
		return pluginapi.RoomVerdict{Room: "x", Verdict: verdict}, nil
	}
}

type decodeHarness struct {
	t       *testing.T
	clk     *clock.Fake
	wd      *Watchdog
	prefill []*fakePlugin
	decode  []*fakeDecode
	metrics *fakeMetrics
}

func newDecodeHarness(t *testing.T, prefill []*fakePlugin, decode []*fakeDecode, mutate func(*Config)) *decodeHarness {
	t.Helper()
	h := &decodeHarness{t: t, clk: clock.NewFake(time.Now()), prefill: prefill, decode: decode, metrics: &fakeMetrics{}}
	h.metrics.addProgress(TransferFailedFamily, 0)
	h.metrics.addProgress(BootstrapFailedFamily, 0)
	cfg := testConfig()
	cfg.Clock = h.clk
	cfg.Metrics = h.metrics
	cfg.DecodeDeadline = 180 * time.Second
	for _, p := range prefill {
		cfg.Plugins = append(cfg.Plugins, p)
	}
	for _, d := range decode {
		cfg.Plugins = append(cfg.Plugins, d)
	}
	h.wd = newWatchdog(t, cfg, mutate)
	h.wd.ScrapeMetrics(context.Background())
	return h
}

func (h *decodeHarness) tick(n int) {
	for i := 0; i < n; i++ {
		h.clk.Advance(time.Second)
		for _, p := range h.prefill {
			p.age(time.Second)
		}
		for _, d := range h.decode {
			d.age(time.Second)
		}
		h.wd.RunCycle(context.Background())
	}
}

// rise raises a failure counter and reads /metrics.
func (h *decodeHarness) rise(family string, n float64) {
	h.metrics.addProgress(family, n)
	h.wd.ScrapeMetrics(context.Background())
}

func (h *decodeHarness) rank(role string) RankSnapshot {
	for _, r := range h.wd.Snapshot().Ranks {
		if r.Role == role {
			return r
		}
	}
	h.t.Fatalf("no %s rank in the snapshot", role)
	return RankSnapshot{}
}

func (h *decodeHarness) forceFails(result string) uint64 {
	return h.wd.Snapshot().RoleForceFails[[3]string{result, TriggerAuto, RoleDecode}]
}

func (h *decodeHarness) skips(reason string) uint64 {
	return h.wd.Snapshot().RoleSkips[[2]string{reason, RoleDecode}]
}

// dreq is a decode request; started nil means "unknown".
func dreq(rid string, room uint64, queue, poll string, age float64, started *bool) pluginapi.DecodeRequest {
	return pluginapi.DecodeRequest{RID: rid, BootstrapRoom: room, BootstrapAddr: "127.0.0.1:8998", Queue: queue, Poll: poll,
		AgeSeconds: age, Progress: 0, TransferStarted: started}
}

func TestDecodeRoleFromListing(t *testing.T) {
	p, d := newFakePlugin("http://127.0.0.1:28100", 0), newFakeDecode("http://127.0.0.1:30200", 0)
	h := newDecodeHarness(t, []*fakePlugin{p}, []*fakeDecode{d}, nil)
	h.tick(1)
	s := h.wd.Snapshot()
	if len(s.Ranks) != 2 || s.Ranks[0].Role != RolePrefill || s.Ranks[1].Role != RoleDecode {
		t.Fatalf("ranks %+v, want one prefill and one decode rank with the same dp/pp", s.Ranks)
	}
}

func TestDecodeNotStartedReleasedAtDecodeDeadlineWithoutAsking(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.set(dreq("a", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 100, boolp(false)))
	v := &fakeVerdicts{answer: verdictOf(pluginapi.VerdictLive)}
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = v })
	// Past the prefill deadline and stall window, short of the decode deadline.
	h.tick(79)
	if n := len(d.orders()); n != 0 || h.rank(RoleDecode).Stuck != 0 {
		t.Fatalf("age 179 s: %d calls, stuck %d; the decode deadline is 180 s", n, h.rank(RoleDecode).Stuck)
	}
	h.tick(1)
	orders := d.orders()
	if len(orders) != 1 || orders[0].PrefillStopped || orders[0].RID != "a" || *orders[0].BootstrapRoom != 11 {
		t.Fatalf("orders %+v, want one for a without prefill_stopped", orders)
	}
	if v.count() != 0 {
		t.Fatalf("%d verdict lookups for a transfer that never started", v.count())
	}
	// Prealloc releases count as bootstrap failures: a transfer-failure
	// rise must not confirm it.
	h.rise(TransferFailedFamily, 1)
	h.tick(1)
	if h.forceFails(ResultReleased) != 0 {
		t.Fatal("confirmed by the transfer-failed counter; a prealloc release raises the bootstrap-failed counter")
	}
	h.rise(BootstrapFailedFamily, 1)
	if h.forceFails(ResultReleased) != 1 {
		t.Fatalf("force-fails %v, want one decode release confirmed", h.wd.Snapshot().RoleForceFails)
	}
	if h.wd.Snapshot().RoleForceFails[[3]string{ResultReleased, TriggerAuto, RolePrefill}] != 0 {
		t.Fatal("a decode release counted under role prefill")
	}
}

func TestDecodeStartedTransferHeld(t *testing.T) {
	for _, tc := range []struct {
		name     string
		started  *bool
		verdicts VerdictSource
		answer   string // the lookup counted
	}{
		{"unknown verdict", boolp(true), &fakeVerdicts{answer: verdictOf(pluginapi.VerdictUnknown)}, pluginapi.VerdictUnknown},
		{"live", boolp(true), &fakeVerdicts{answer: verdictOf(pluginapi.VerdictLive)}, pluginapi.VerdictLive},
		{"in_queue", boolp(true), &fakeVerdicts{answer: verdictOf(pluginapi.VerdictInQueue)}, pluginapi.VerdictInQueue},
		{"peer unreachable", boolp(true), &fakeVerdicts{answer: func(string, uint64) (pluginapi.RoomVerdict, error) {
			return pluginapi.RoomVerdict{}, errors.New("connection refused")
		}}, "error"},
		{"transfer_started unknown counts as started", nil, &fakeVerdicts{answer: verdictOf(pluginapi.VerdictLive)}, pluginapi.VerdictLive},
		{"no verdict source", boolp(true), nil, "error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newFakeDecode("http://127.0.0.1:30200", 0)
			d.set(dreq("a", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, tc.started))
			h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = tc.verdicts })
			h.tick(120)
			if n := len(d.orders()); n != 0 {
				t.Fatalf("%d force-fail calls for a transfer that may be live", n)
			}
			if d.reads != 120 {
				t.Fatalf("%d listing reads in 120 cycles: a held request must cost no re-read", d.reads)
			}
			r := h.rank(RoleDecode)
			if r.Stuck != 1 || r.Unactionable[SkipTransferLive] != 1 || h.skips(SkipTransferLive) != 1 {
				t.Fatalf("stuck %d, unactionable %v, skips %d; want one request held as transfer_live, counted once", r.Stuck, r.Unactionable, h.skips(SkipTransferLive))
			}
			if got := h.wd.Snapshot().VerdictLookups[tc.answer]; got == 0 {
				t.Fatalf("lookups %v, want %s counted", h.wd.Snapshot().VerdictLookups, tc.answer)
			}
		})
	}
}

func TestDecodeStartedTransferReleasedWhenPrefillStopped(t *testing.T) {
	for _, tc := range []struct {
		name    string
		poll    string
		verdict string
		lookups int
	}{
		{"stopped verdict", pluginapi.PollWaitingForInput, pluginapi.VerdictStopped, 1},
		{"decode poll Failed", pluginapi.PollFailed, pluginapi.VerdictLive, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newFakeDecode("http://127.0.0.1:30200", 0)
			// Stuck as it turns early (the stall window from first sight):
			// at the decode deadline a fresh "stopped" is enough.
			d.set(dreq("a", 11, pluginapi.DecodeQueueTransfer, tc.poll, 150, boolp(true)))
			v := &fakeVerdicts{answer: verdictOf(tc.verdict)}
			h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = v })
			h.tick(80)
			orders := d.orders()
			if len(orders) != 1 || !orders[0].PrefillStopped {
				t.Fatalf("orders %+v, want one carrying prefill_stopped", orders)
			}
			if v.count() != tc.lookups {
				t.Fatalf("%d lookups, want %d", v.count(), tc.lookups)
			}
			h.tick(1)
			h.rise(TransferFailedFamily, 1)
			if h.forceFails(ResultReleased) != 1 {
				t.Fatalf("force-fails %v, want one decode release confirmed", h.wd.Snapshot().RoleForceFails)
			}
		})
	}
}

// A plugin that refuses with transfer_live (the transfer started since the
// re-read, say) is a rejection, never retried.
func TestDecodeTransferLiveAnswerIsRejected(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.set(dreq("a", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(false)))
	// The transfer starts between the re-read and the call: the listing
	// does not show it yet, the plugin does.
	d.startedNow = map[string]bool{"a": true}
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, nil)
	h.tick(100)
	if n := len(d.orders()); n != 1 || d.orders()[0].PrefillStopped {
		t.Fatalf("orders %+v, want one call without prefill_stopped", d.orders())
	}
	if h.forceFails(ResultRejected) != 1 {
		t.Fatalf("force-fails %v, want transfer_live counted as rejected", h.wd.Snapshot().RoleForceFails)
	}
}

func TestDecodeHealthChecksNever(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	hc := dreq("HEALTH_CHECK_1", 0, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(false))
	hc.HealthCheck = true
	d.set(hc)
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, nil)
	h.tick(400)
	if n := len(d.orders()); n != 0 || h.rank(RoleDecode).Stuck != 0 {
		t.Fatalf("%d calls, stuck %d for a health check", n, h.rank(RoleDecode).Stuck)
	}
}

func TestDecodeRails(t *testing.T) {
	t.Run("rate limit and once per request", func(t *testing.T) {
		d := newFakeDecode("http://127.0.0.1:30200", 0)
		d.set(dreq("a", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 100, boolp(false)),
			dreq("b", 12, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 100, boolp(false)))
		// The requests stay listed: the plugin flips but the scheduler
		// has not released them yet.
		h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.DecodePerMinute = 1 })
		keep := d.reqs
		d.beforeRead = func(int) {
			d.mu.Lock()
			if len(d.reqs) < 2 {
				d.reqs = append(d.reqs[:0:0], keep...)
			}
			d.mu.Unlock()
		}
		h.tick(85)
		if n := len(d.orders()); n != 1 || h.skips(SkipRateLimited) != 1 {
			t.Fatalf("%d calls, %d rate-limited; want 1 and 1 within the minute", n, h.skips(SkipRateLimited))
		}
		h.tick(60)
		if n := len(d.orders()); n != 2 {
			t.Fatalf("%d calls after the minute, want 2 (one per request, never twice)", n)
		}
	})
	t.Run("re-read cancels on progress", func(t *testing.T) {
		d := newFakeDecode("http://127.0.0.1:30200", 0)
		d.set(dreq("a", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 100, boolp(false)))
		d.beforeRead = func(read int) {
			if read == 81 { // the actuator's re-read in cycle 80
				d.update("a", func(r *pluginapi.DecodeRequest) { r.Queue = pluginapi.DecodeQueueTransfer })
			}
		}
		h := newDecodeHarness(t, nil, []*fakeDecode{d}, nil)
		h.tick(80)
		if n := len(d.orders()); n != 0 || h.skips(SkipProgressed) != 1 {
			t.Fatalf("%d calls, %d progressed; a move to the transfer queue is progress", n, h.skips(SkipProgressed))
		}
	})
	t.Run("k releases need a rise of k", func(t *testing.T) {
		d := newFakeDecode("http://127.0.0.1:30200", 0)
		d.set(dreq("a", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollFailed, 100, boolp(true)),
			dreq("b", 12, pluginapi.DecodeQueueTransfer, pluginapi.PollFailed, 100, boolp(true)))
		h := newDecodeHarness(t, nil, []*fakeDecode{d}, nil)
		h.tick(82)
		if n := len(d.orders()); n != 2 {
			t.Fatalf("%d calls, want 2", n)
		}
		h.tick(1)
		h.rise(TransferFailedFamily, 1)
		if got := h.forceFails(ResultReleased); got != 1 {
			t.Fatalf("%d confirmed after a rise of 1, want 1", got)
		}
		h.rise(TransferFailedFamily, 1)
		if got := h.forceFails(ResultReleased); got != 2 {
			t.Fatalf("%d confirmed after a rise of 2, want 2", got)
		}
	})
	t.Run("mode off", func(t *testing.T) {
		d := newFakeDecode("http://127.0.0.1:30200", 0)
		d.set(dreq("a", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 100, boolp(false)))
		h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Mode = ModeOff })
		h.tick(100)
		if n := len(d.orders()); n != 0 || h.skips(SkipModeOff) != 1 {
			t.Fatalf("%d calls, %d mode_off skips", n, h.skips(SkipModeOff))
		}
	})
}

func TestDecodePluginWithoutDecodeSupportActsOnNothing(t *testing.T) {
	var logs syncBuffer
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.legacy = true
	d.set(dreq("a", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 500, boolp(false)))
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Logger = log.NewLogfmtLogger(&logs) })
	h.tick(100)
	if n := len(d.orders()); n != 0 || h.rank(RoleDecode).Stuck != 0 {
		t.Fatalf("%d calls, stuck %d on a decode plugin without decode support", n, h.rank(RoleDecode).Stuck)
	}
	if n := logs.count("decode plugin without decode support"); n != 1 {
		t.Fatalf("said %d times in 100 cycles, want once", n)
	}
}
