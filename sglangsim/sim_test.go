package sglangsim

import (
	"context"
	"encoding/json"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func TestNewValidates(t *testing.T) {
	if _, err := New(Options{}); err == nil {
		t.Error("New without a clock succeeded")
	}
	for _, o := range []Options{{Era: "v9"}, {Backend: "tcp"}, {SlowFraction: 2}, {DPSize: -1}, {Scenario: "nope"}} {
		o.Clock = clock.NewFake(t0)
		if _, err := New(o); err == nil {
			t.Errorf("New(%+v) succeeded", o)
		}
	}
	s, _ := newSim(t, Options{DPSize: 2, PPSize: 2})
	if s.Ranks() != 4 || s.RankIndex(1, 0) != 2 || s.RankIndex(1, 1) != 3 {
		t.Fatalf("ranks %d, index(1,0)=%d", s.Ranks(), s.RankIndex(1, 0))
	}
	l := s.Listing(3)
	if l.Server.DPRank != 1 || l.Server.PPRank != 1 || l.Server.TPRank != 0 || l.Server.DisaggregationMode != "prefill" ||
		l.Server.TransferBackend != "nixl" || l.APIVersion != 1 || l.Inflight == nil {
		t.Fatalf("listing of rank 3: %+v", l)
	}
}

func TestLifecycleAndRelease(t *testing.T) {
	s, c := newSim(t, Options{Era: EraV05})
	rid, rm := s.Submit(RequestSpec{Transfer: 2 * time.Second, PromptTokens: 4096, Bootstrap: 50 * time.Millisecond})
	if rm == 0 {
		t.Fatal("room 0 for a normal request")
	}
	s.Step()
	l := s.Listing(0)
	if l.Queues.Bootstrap != 1 || len(l.Inflight) != 0 {
		t.Fatalf("after the first pass: %+v", l.Queues)
	}
	if r := recordOf(t, s, rid); r.Outcome != OutcomeQueued || !r.EnteredInflight.IsZero() {
		t.Fatalf("record before inflight: %+v", r)
	}
	c.Advance(50 * time.Millisecond)
	s.Step()
	l = s.Listing(0)
	rq, ok := room(l, rid)
	if !ok || l.Queues.Inflight != 1 || l.Queues.Bootstrap != 0 {
		t.Fatalf("not inflight after bootstrap: %+v", l)
	}
	// The listing's progress is the scheduler's hand-overs (NIXL chunk_id:
	// one per 8,192-token prefill chunk), all done on entry.
	handed := listedProgress(s.opts.Backend, 4096)
	if rq.Poll != pluginapi.PollWaitingForInput || rq.Progress != handed || rq.AgeSeconds != 0 || rq.PromptTokens != 4096 ||
		rq.BootstrapAddr != DefaultBootstrapAddr || rq.HealthCheck || rq.SendFailed || rq.BootstrapRoom != rm {
		t.Fatalf("fresh inflight room: %+v", rq)
	}
	entered := c.Now()
	sawTransferring := false
	for i := 0; i < 40; i++ {
		c.Advance(100 * time.Millisecond)
		s.Step()
		rq, ok := room(s.Listing(0), rid)
		if !ok {
			break
		}
		if rq.Progress != handed {
			t.Fatalf("progress moved from %d to %d during the inflight stay", handed, rq.Progress)
		}
		if rq.Poll == pluginapi.PollTransferring {
			sawTransferring = true
		}
		if math.Abs(rq.AgeSeconds-c.Now().Sub(entered).Seconds()) > 1e-9 {
			t.Fatalf("age %v, want %v", rq.AgeSeconds, c.Now().Sub(entered).Seconds())
		}
	}
	if _, ok := room(s.Listing(0), rid); ok {
		t.Fatal("not released after its transfer time")
	}
	if !sawTransferring {
		t.Fatal("never saw Transferring")
	}
	r := recordOf(t, s, rid)
	if r.Outcome != OutcomeSuccess || r.Kind != KindHealthy || !r.EnteredInflight.Equal(entered) ||
		r.Left.Sub(entered) < 2*time.Second || r.Left.Sub(entered) > 2100*time.Millisecond {
		t.Fatalf("record: %+v", r)
	}
	for name, want := range map[string]float64{
		"sglang:num_requests_total":                  1,
		"sglang:prompt_tokens_total":                 4096,
		"sglang:generation_tokens_total":             1,
		"sglang:num_transfer_failed_reqs_total":      0,
		"sglang:kv_transfer_total_mb":                4096 * kvMBPerToken,
		"sglang:per_stage_req_latency_seconds_count": 1,
	} {
		labels := map[string]string{}
		if name == "sglang:per_stage_req_latency_seconds_count" {
			labels["stage"] = "prefill_transfer_kv_cache"
		}
		if got := mustMetric(t, s, name, labels); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
}

func TestHeavyTail(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const n = 200000
	d := make([]float64, n)
	for i := range d {
		d[i] = float64(drawTransfer(rng, 200*time.Millisecond))
	}
	slices.Sort(d)
	median, p999 := d[n/2], d[n*999/1000]
	if p999 < 10*median {
		t.Fatalf("p99.9 %v < 10 x median %v", time.Duration(p999), time.Duration(median))
	}
	if m := time.Duration(median); m < 190*time.Millisecond || m > 210*time.Millisecond {
		t.Fatalf("median %v, want about 200ms", m)
	}

	// The same tail seen through the simulator: time spent in the inflight queue.
	// Each transfer worker serves its queue serially, so the traffic must
	// leave the busiest queue (a third of a rank's) below saturation.
	s, c := newSim(t, Options{DPSize: 8, ArrivalRate: 300, TransferMedian: 20 * time.Millisecond, Seed: 7})
	run(s, c, 60*time.Second, 10*time.Millisecond)
	run(s, c, 40*time.Second, 100*time.Millisecond) // drain (no new arrivals would be nicer, but the tail is long)
	var inflight []float64
	for _, r := range s.Records() {
		if r.Outcome == OutcomeSuccess {
			inflight = append(inflight, float64(r.Left.Sub(r.EnteredInflight)))
		}
	}
	if len(inflight) < 15000 {
		t.Fatalf("only %d completions", len(inflight))
	}
	slices.Sort(inflight)
	median, p999 = inflight[len(inflight)/2], inflight[len(inflight)*999/1000]
	if p999 < 10*median {
		t.Fatalf("inflight p99.9 %v < 10 x median %v", time.Duration(p999), time.Duration(median))
	}
}

func TestGaugeFrozenByStuckRequestNewest(t *testing.T) {
	s, c := newSim(t, Options{Era: EraNewest})
	inflight := map[string]string{"dp_rank": "0"}
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", inflight); v != 0 {
		t.Fatalf("gauge after warm-up = %v", v)
	}
	s.Inject(0, PinResurrection)
	s.Step()
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", inflight); v != 1 {
		t.Fatalf("gauge after the batch = %v, want 1", v)
	}
	run(s, c, 10*time.Minute, time.Second)
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", inflight); v != 1 {
		t.Fatalf("gauge after 10 idle minutes = %v, want 1 (frozen)", v)
	}
	if l := s.Listing(0); l.Queues.Inflight != 1 {
		t.Fatalf("listing queues %+v", l.Queues)
	}
}

func TestGaugeFrozenV05NeedsALaterBatch(t *testing.T) {
	s, c := newSim(t, Options{Era: EraV05})
	s.Inject(0, PinAbortBeforeRegister)
	s.Step()
	// v0.5 logs at batch formation, before the batch enters the inflight queue.
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != 0 {
		t.Fatalf("gauge = %v, want 0", v)
	}
	run(s, c, 5*time.Minute, time.Second)
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != 0 {
		t.Fatalf("idle refresh ran with a non-empty inflight queue: %v", v)
	}
	// A health check forms a batch, which logs the stuck request.
	s.Submit(RequestSpec{Behavior: BehaviorHealthCheck})
	s.Step()
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != 1 {
		t.Fatalf("gauge after a later batch = %v, want 1", v)
	}
	if l := s.Listing(0); l.Queues.Inflight != 1 {
		t.Fatalf("health check not released: %+v", l.Queues)
	}
	run(s, c, 10*time.Minute, time.Second)
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != 1 {
		t.Fatalf("gauge after 10 idle minutes = %v, want 1", v)
	}
}

func TestIdleRefreshAfterHealthyCompletion(t *testing.T) {
	for _, era := range []string{EraV05, EraNewest} {
		t.Run(era, func(t *testing.T) {
			s, c := newSim(t, Options{Era: era})
			s.Submit(RequestSpec{Transfer: time.Second})
			s.Step()
			c.Advance(100 * time.Millisecond)
			s.Submit(RequestSpec{Transfer: time.Second})
			s.Step()
			logged := c.Now()
			want := 1.0 // v0.5: the first request; newest: ... after the second batch both
			if era == EraNewest {
				want = 2
			}
			if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != want {
				t.Fatalf("gauge = %v, want %v", v, want)
			}
			run(s, c, 2*time.Second, 100*time.Millisecond)
			if l := s.Listing(0); l.Queues.Inflight != 0 {
				t.Fatalf("not completed: %+v", l.Queues)
			}
			if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != want {
				t.Fatalf("gauge changed without a log: %v", v)
			}
			for c.Now().Sub(logged) < 29*time.Second {
				c.Advance(time.Second)
				s.Step()
			}
			if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != want {
				t.Fatalf("gauge refreshed before IdleRefresh: %v", v)
			}
			run(s, c, 2*time.Second, time.Second)
			if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != 0 {
				t.Fatalf("gauge after the idle refresh = %v, want 0", v)
			}
		})
	}
}

func TestHookRunsWhenEmpty(t *testing.T) {
	for _, always := range []bool{false, true} {
		s, c := newSim(t, Options{HookRunsWhenEmpty: always})
		run(s, c, time.Second, 100*time.Millisecond)
		it := s.Listing(0).Loop.Iterations
		if always && it != 10 || !always && it != 0 {
			t.Fatalf("HookRunsWhenEmpty=%v: %d iterations on an empty queue", always, it)
		}
		s.Inject(0, PinStuckHandle)
		run(s, c, time.Second, 100*time.Millisecond)
		l := s.Listing(0)
		if l.Loop.Iterations != it+10 || l.Loop.LastIterationUnix != unixSeconds(c.Now()) {
			t.Fatalf("HookRunsWhenEmpty=%v: iterations %d -> %d, last %v", always, it, l.Loop.Iterations, l.Loop.LastIterationUnix)
		}
		s.PauseLoop(0, true)
		run(s, c, time.Second, 100*time.Millisecond)
		if got := s.Listing(0).Loop.Iterations; got != l.Loop.Iterations {
			t.Fatalf("iterations advanced while paused: %d -> %d", l.Loop.Iterations, got)
		}
	}
}

// TestSlowTransfersListNoProgress: a slow healthy transfer sends a chunk
// at least every SlowChunkEvery while its worker serves it (decode sees
// them), but the listing's progress is the scheduler's hand-overs, done on
// entry: it stands still for the whole inflight stay, as in SGLang. This
// test was "slow transfers keep progressing" on the listing until the
// simulator followed SGLang there.
func TestSlowTransfersListNoProgress(t *testing.T) {
	s, c := newSim(t, Options{ArrivalRate: 0.05, SlowFraction: 1, Seed: 3})
	type seen struct {
		progress int64
		at       time.Time
	}
	listed := map[string]int64{}
	sent := map[string]seen{}
	var maxGap time.Duration
	for i := 0; i < 3000; i++ { // 5 minutes
		c.Advance(100 * time.Millisecond)
		s.Step()
		for _, rq := range s.Listing(0).Inflight {
			if p, ok := listed[rq.RID]; ok && p != rq.Progress {
				t.Fatalf("%s: listed progress moved from %d to %d", rq.RID, p, rq.Progress)
			}
			listed[rq.RID] = rq.Progress
			if rq.Poll != pluginapi.PollTransferring {
				continue // waiting for its worker
			}
			sd := s.groups[0].stages[0].byRID[rq.RID].senders[0]
			p, ok := sent[rq.RID]
			if !ok || sd.progress > p.progress {
				sent[rq.RID] = seen{sd.progress, c.Now()}
				continue
			}
			if gap := c.Now().Sub(p.at); gap > maxGap {
				maxGap = gap
			}
		}
	}
	if maxGap > 5*time.Second+200*time.Millisecond {
		t.Fatalf("a slow transfer went %v without sending a chunk", maxGap)
	}
	long := 0
	for _, r := range s.Records() {
		if r.Kind != KindSlow {
			t.Fatalf("kind %s with SlowFraction 1", r.Kind)
		}
		if r.Outcome == OutcomeSuccess && r.Left.Sub(r.EnteredInflight) > time.Minute {
			long++
		}
	}
	if long == 0 {
		t.Fatal("no slow transfer took more than a minute")
	}
}

func TestHealthChecks(t *testing.T) {
	s, c := newSim(t, Options{DPSize: 2, HealthCheckEvery: 10 * time.Second})
	run(s, c, 61*time.Second, 100*time.Millisecond)
	n := 0
	for _, r := range s.Records() {
		if r.Kind != KindHealthCheck || r.Room != 0 || r.Outcome != OutcomeSuccess || len(r.RID) < len("HEALTH_CHECK_1") ||
			r.RID[:13] != "HEALTH_CHECK_" {
			t.Fatalf("health check record %+v", r)
		}
		n++
	}
	if n != 6 {
		t.Fatalf("%d health checks in 61s, want 6", n)
	}
	// A stuck one (PR #28652) stays in WaitingForInput with progress -1.
	rid, rm := s.Submit(RequestSpec{Behavior: BehaviorStuckHealthCheck})
	run(s, c, time.Minute, time.Second)
	rq, ok := room(s.Listing(0), rid)
	if !ok || rm != 0 || rq.Poll != pluginapi.PollWaitingForInput || rq.Progress != -1 || !rq.HealthCheck ||
		rq.BootstrapAddr != FakeBootstrapHost || rq.PromptTokens != 1 {
		t.Fatalf("stuck health check: %+v", rq)
	}
}

func TestParityScenario(t *testing.T) {
	for _, backend := range []string{BackendNIXL, BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			s, c := newSim(t, Options{Backend: backend, ArrivalRate: 100, HealthCheckEvery: time.Second, Scenario: ScenarioParity})
			l := s.Listing(0)
			if len(l.Inflight) != 4 || l.Queues != (pluginapi.Queues{Inflight: 4}) || l.Server.TransferBackend != backend {
				t.Fatalf("parity listing: %+v", l)
			}
			nixl := backend == BackendNIXL
			queue := func(q int) *int { return &q }
			want := []pluginapi.Room{
				{RID: "pinned-0001", BootstrapRoom: 9223372036854775001, BootstrapAddr: "10.0.0.7:8998", Poll: "Transferring",
					AgeSeconds: 120, PromptTokens: 4096, Progress: 3, TransferInFlight: ptr(false), TransferQueue: queue(2)},
				{RID: "healthy-0002", BootstrapRoom: 18446744073709551557, BootstrapAddr: "10.0.0.8:8998", Poll: "Transferring",
					AgeSeconds: 5, PromptTokens: 1024, Progress: 50, TransferInFlight: ptr(true), TransferQueue: queue(1)},
				{RID: "HEALTH_CHECK_1764403200.0", BootstrapRoom: 0, BootstrapAddr: "2.2.2.2", Poll: "WaitingForInput",
					AgeSeconds: 200, PromptTokens: 1, Progress: -1, HealthCheck: true, TransferInFlight: ptr(false)},
				{RID: ParityWarmupRID, BootstrapRoom: 0, BootstrapAddr: "2.2.2.2", Poll: "WaitingForInput",
					AgeSeconds: 150, PromptTokens: 1, Progress: -1, HealthCheck: true, TransferInFlight: ptr(false)},
			}
			for i, w := range want {
				if !reflect.DeepEqual(l.Inflight[i], w) {
					t.Errorf("room %d = %s, want %s", i, must(json.Marshal(l.Inflight[i])), must(json.Marshal(w)))
				}
			}
			wantLevers := []string{pluginapi.LeverAbort, pluginapi.LeverSendFailed}
			if !nixl {
				wantLevers = []string{pluginapi.LeverAbort}
			}
			if srv := l.Server; !slices.Equal(srv.Levers, wantLevers) || srv.LeverNote != "" || srv.PPSize != 1 ||
				!reflect.DeepEqual(srv.TransferQueues, queue(TransferQueues)) || !reflect.DeepEqual(srv.TransferTracking, ptr(true)) ||
				l.OrphanedTransfers == nil || len(l.OrphanedTransfers) != 0 {
				t.Errorf("parity server %+v, orphaned %v", srv, l.OrphanedTransfers)
			}
			// The stand-in has no worker queues the plugin can watch.
			if !reflect.DeepEqual(l.Server.TransferProgress, ptr(false)) || l.TransferWorkers != nil ||
				l.WedgeOrders == nil || len(l.WedgeOrders) != 0 {
				t.Errorf("parity round 4: progress %v, workers %v, orders %v", l.Server.TransferProgress, l.TransferWorkers, l.WedgeOrders)
			}
			if st, resp := s.WedgeOrder(0, pluginapi.WedgeOrderRequest{TransferQueue: 1, Chunk: 1, TTLSeconds: 5}, ""); st != 501 ||
				resp.Result != pluginapi.ResultUnsupported {
				t.Errorf("parity wedge order: %d %+v", st, resp)
			}
			run(s, c, time.Second, 100*time.Millisecond)
			l = s.Listing(0)
			if len(l.Inflight) != 4 || l.Inflight[0].Progress != 3 || l.Inflight[1].Progress != 60 || l.Queues.Bootstrap != 0 {
				t.Fatalf("after 1s: %+v", l)
			}
			if v := mustMetric(t, s, "sglang:num_running_reqs", map[string]string{"model_name": "standin"}); v != 0 {
				t.Fatal(v)
			}
			wantLever := pluginapi.LeverSendFailed
			if backend == BackendMooncake {
				wantLever = pluginapi.LeverConcludeState
			}
			st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: "healthy-0002", DryRun: true}, "")
			if st != 200 || resp.Result != pluginapi.ResultWouldFlip || resp.Lever != wantLever {
				t.Fatalf("dry run: %d %+v", st, resp)
			}
			st, resp = s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: "HEALTH_CHECK_1764403200.0", DryRun: true}, "")
			if st != 409 || resp.Result != pluginapi.ResultHealthCheck || resp.BootstrapRoom == nil || *resp.BootstrapRoom != 0 {
				t.Fatalf("health check dry run: %d %+v", st, resp)
			}
			st, resp = s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: ParityWarmupRID}, "")
			if st != 409 || resp.Result != pluginapi.ResultHealthCheck {
				t.Fatalf("warm-up: %d %+v", st, resp)
			}
			st, resp = s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: "pinned-0001"}, "")
			if st != 200 || resp.Result != pluginapi.ResultFlipped || resp.Lever != wantLever || !slices.Equal(resp.Levers, wantLevers) ||
				*resp.BootstrapRoom != 9223372036854775001 || resp.AppliedUnix != unixSeconds(c.Now()) {
				t.Fatalf("flip: %d %+v", st, resp)
			}
			c.Advance(100 * time.Millisecond)
			s.Step()
			l = s.Listing(0)
			if len(l.Inflight) != 3 || mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", nil) != 1 {
				t.Fatalf("pinned-0001 not released: %+v", l.Inflight)
			}
			if r := recordOf(t, s, "pinned-0001"); r.Outcome != OutcomeFailedForced || r.ProgressingWhenForced {
				t.Fatalf("record %+v", r)
			}
			s.Restart()
			run(s, c, 40*time.Second, 100*time.Millisecond)
			if l := s.Listing(0); l.Queues != (pluginapi.Queues{}) || len(s.Records()) != 4 {
				t.Fatalf("parity scene got traffic after a restart: %+v, %d records", l.Queues, len(s.Records()))
			}
		})
	}
}

// TestReplay100k replays 100k requests over DP8 on the fake clock.
func TestReplay100k(t *testing.T) {
	if testing.Short() {
		t.Skip("replay in -short mode")
	}
	start := time.Now()
	s, c := newSim(t, Options{DPSize: 8, Era: EraNewest, ArrivalRate: 2000, SlowFraction: 0.001,
		HealthCheckEvery: 10 * time.Second, Seed: 5})
	for i := 0; i < 8; i++ {
		s.Inject(i, PinKind(i%3))
	}
	run(s, c, 50*time.Second, 100*time.Millisecond)
	recs := s.Records()
	elapsed := time.Since(start)
	t.Logf("replayed %d requests in %v", len(recs), elapsed)
	if len(recs) < 95000 {
		t.Fatalf("only %d requests", len(recs))
	}
	if elapsed > 30*time.Second {
		t.Fatalf("replay took %v", elapsed)
	}
	if n := len(s.MetricsText()); n == 0 {
		t.Fatal("empty metrics")
	}
}
