package sglangsim

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// TestPPConsensus: the PP stages of a DP rank hold the same request; it
// leaves only when every stage reports it terminal.
func TestPPConsensus(t *testing.T) {
	t.Run("pin on every stage", func(t *testing.T) {
		s, c := newSim(t, Options{PPSize: 2, DPSize: 2})
		rid, rm := s.Inject(2, PinResurrection) // dp 1
		run(s, c, 10*time.Second, 100*time.Millisecond)
		for _, rank := range []int{2, 3} {
			rq := mustRoom(t, s.Listing(rank), rid)
			if rq.BootstrapRoom != rm || rq.Poll != pluginapi.PollTransferring {
				t.Fatalf("rank %d: %+v", rank, rq)
			}
			if l := s.Listing(rank); l.Server.PPSize != 2 {
				t.Fatalf("pp_size %d", l.Server.PPSize)
			}
		}
		if len(s.Listing(0).Inflight) != 0 {
			t.Fatal("the request of dp 1 is on dp 0")
		}
		flip(t, s, 2, rid)
		run(s, c, 5*time.Second, 100*time.Millisecond)
		if rq := mustRoom(t, s.Listing(2), rid); rq.Poll != pluginapi.PollFailed || !rq.SendFailed {
			t.Fatalf("stage 0 after its flip: %+v", rq)
		}
		mustRoom(t, s.Listing(3), rid)
		if st, resp := s.ForceFail(context.Background(), 2, pluginapi.ForceFailRequest{RID: rid}, ""); st != 200 ||
			resp.Result != pluginapi.ResultAlreadyFailed || !slices.Equal(resp.Levers, []string{pluginapi.LeverAbort, pluginapi.LeverSendFailed}) {
			t.Fatalf("second order on stage 0: %d %+v", st, resp)
		}
		if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", nil); v != 0 {
			t.Fatalf("failed counter %v before every stage failed", v)
		}
		if r := recordOf(t, s, rid); r.Outcome != OutcomeInflight || r.Rank != 2 {
			t.Fatalf("record %+v", r)
		}
		flip(t, s, 3, rid)
		// Stage 1 releases on its next pass; stage 0 learns the consensus one
		// pass later (the released set circulates through the stages).
		run(s, c, 200*time.Millisecond, 100*time.Millisecond)
		for _, rank := range []int{2, 3} {
			if _, ok := room(s.Listing(rank), rid); ok {
				t.Fatalf("still on rank %d after both stages failed", rank)
			}
			if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", map[string]string{"dp_rank": "1", "pp_rank": strconv.Itoa(rank - 2)}); v != 1 {
				t.Fatalf("rank %d failed counter %v", rank, v)
			}
		}
		if r := recordOf(t, s, rid); r.Outcome != OutcomeFailedForced || r.ProgressingWhenForced {
			t.Fatalf("record %+v", r)
		}
	})
	t.Run("pin on one stage", func(t *testing.T) {
		s, c := newSim(t, Options{PPSize: 2})
		rid, _ := s.Submit(RequestSpec{Behavior: BehaviorPinResurrection, PinStages: []int{1}, Transfer: time.Second})
		run(s, c, time.Minute, 100*time.Millisecond)
		// Stage 0's transfer succeeded; the request waits for stage 1.
		if rq := mustRoom(t, s.Listing(0), rid); rq.Poll != pluginapi.PollSuccess || rq.Progress == 0 {
			t.Fatalf("stage 0: %+v", rq)
		}
		if rq := mustRoom(t, s.Listing(1), rid); rq.Poll != pluginapi.PollTransferring || rq.Progress != listedProgress(s.opts.Backend, rq.PromptTokens) {
			t.Fatalf("stage 1: %+v", rq)
		}
		// Failing stage 0 would overwrite its Success: refused.
		for _, dry := range []bool{true, false} {
			st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid, DryRun: dry}, "")
			if st != 409 || resp.Result != pluginapi.ResultTransferSucceeded {
				t.Fatalf("stage 0 (dry run %v): %d %+v", dry, st, resp)
			}
		}
		flip(t, s, 1, rid)
		run(s, c, 200*time.Millisecond, 100*time.Millisecond)
		for _, rank := range []int{0, 1} {
			if _, ok := room(s.Listing(rank), rid); ok {
				t.Fatalf("still on rank %d", rank)
			}
		}
		if r := recordOf(t, s, rid); r.Outcome != OutcomeFailedForced {
			t.Fatalf("record %+v", r)
		}
		if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", map[string]string{"pp_rank": "0"}); v != 0 {
			t.Fatalf("stage 0 counted a failure: %v", v)
		}
	})
}

// TestTransferSucceededRefused: a room whose status became Success since
// the last pass is not touched.
func TestTransferSucceededRefused(t *testing.T) {
	s, c := newSim(t, Options{Backend: BackendMooncake})
	rid, _ := s.Submit(RequestSpec{Transfer: time.Second})
	run(s, c, 500*time.Millisecond, 100*time.Millisecond)
	c.Advance(2 * time.Second) // the transfer ends before the next pass
	st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid}, "")
	if st != 409 || resp.Result != pluginapi.ResultTransferSucceeded || resp.BootstrapRoom == nil {
		t.Fatalf("%d %+v", st, resp)
	}
	s.Step()
	if r := recordOf(t, s, rid); r.Outcome != OutcomeSuccess || !r.ForcedAt.IsZero() {
		t.Fatalf("record %+v", r)
	}
}

// TestHealthChecksAndWarmupsRefused: SGLang's own requests are never
// force-failed, dry runs included, whether the rid says so or not.
func TestHealthChecksAndWarmupsRefused(t *testing.T) {
	s, c := newSim(t, Options{})
	hc, _ := s.Submit(RequestSpec{Behavior: BehaviorStuckHealthCheck})
	warm, warmRoom := s.Submit(RequestSpec{Behavior: BehaviorStuckHealthCheck, Warmup: true})
	run(s, c, 5*time.Minute, time.Second)
	l := s.Listing(0)
	w := mustRoom(t, l, warm)
	if strings.HasPrefix(warm, HealthCheckPrefix) || warmRoom != 0 || w.BootstrapAddr != FakeBootstrapHost || !w.HealthCheck ||
		*w.TransferInFlight || w.TransferQueue != nil {
		t.Fatalf("warm-up %s: %+v", warm, w)
	}
	for _, rid := range []string{hc, warm} {
		for _, dry := range []bool{true, false} {
			st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid, DryRun: dry}, "")
			if st != 409 || resp.Result != pluginapi.ResultHealthCheck || *resp.BootstrapRoom != 0 {
				t.Fatalf("%s (dry run %v): %d %+v", rid, dry, st, resp)
			}
		}
		// And again on the scheduler thread.
		r := s.ranks[0]
		r.mu.Lock()
		st, resp := r.applyOrder(s, pluginapi.ForceFailRequest{RID: rid}, c.Now())
		r.mu.Unlock()
		if st != 409 || resp.Result != pluginapi.ResultHealthCheck {
			t.Fatalf("%s on the scheduler thread: %d %+v", rid, st, resp)
		}
	}
	s.Step()
	if len(s.Listing(0).Inflight) != 2 {
		t.Fatal("a refused request was released")
	}
	for _, rid := range []string{hc, warm} {
		if r := recordOf(t, s, rid); r.Kind != KindHealthCheck || !r.ForcedAt.IsZero() {
			t.Fatalf("record %+v", r)
		}
	}
	// A warm-up that completes normally.
	ok, _ := s.Submit(RequestSpec{Behavior: BehaviorHealthCheck, Warmup: true})
	run(s, c, time.Second, 100*time.Millisecond)
	if r := recordOf(t, s, ok); r.Outcome != OutcomeSuccess || r.Room != 0 {
		t.Fatalf("warm-up record %+v", r)
	}
}

// TestLeverEraMid2025: no lever releases anything; the plugin says so.
func TestLeverEraMid2025(t *testing.T) {
	s, c := newSim(t, Options{LeverEra: LeversNIXLMid2025})
	// Ahead of the pins: a room queued behind the stuck handle on its queue
	// would wait for ever (serial workers).
	healthy, _ := s.Submit(RequestSpec{Transfer: time.Second})
	var rids []string
	for _, pin := range []PinKind{PinResurrection, PinAbortBeforeRegister, PinStuckHandle} {
		rid, _ := s.Inject(0, pin)
		rids = append(rids, rid)
	}
	run(s, c, 10*time.Second, 100*time.Millisecond)
	l := s.Listing(0)
	// No outstanding-chunk count: transfer_in_flight false proves nothing.
	if l.Server.Levers == nil || len(l.Server.Levers) != 0 || !strings.Contains(l.Server.LeverNote, "mid-2025") ||
		l.Server.TransferTracking == nil || *l.Server.TransferTracking {
		t.Fatalf("server %+v", l.Server)
	}
	if r := recordOf(t, s, healthy); r.Outcome != OutcomeSuccess {
		t.Fatalf("healthy record %+v", r)
	}
	for _, rid := range rids {
		for _, dry := range []bool{true, false} {
			st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid, DryRun: dry}, "")
			if st != 501 || resp.Result != pluginapi.ResultUnsupported || resp.RID != rid || resp.Error == "" {
				t.Fatalf("%s (dry run %v): %d %+v", rid, dry, st, resp)
			}
		}
	}
	// The rid is looked up first, as the plugin does (a health check answers
	// 409 health_check even here).
	if st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: "unknown"}, ""); st != 404 {
		t.Fatalf("unknown rid: %d %+v", st, resp)
	}
	// Pulled by hand, the levers do nothing on this NIXL.
	for _, rid := range rids {
		if !s.PullLever(0, rid) {
			t.Fatal(rid)
		}
	}
	run(s, c, 10*time.Minute, time.Second)
	for _, rid := range rids {
		if rq := mustRoom(t, s.Listing(0), rid); rq.Poll == pluginapi.PollFailed {
			t.Fatalf("released by a lever on mid-2025 NIXL: %+v", rq)
		}
	}
	if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", nil); v != 0 {
		t.Fatalf("failed counter %v", v)
	}
}

// TestLeverEraEarly: the plugin pulls nothing; a Failed poll (a lever
// pulled by hand, or SGLang's own transfer failure) crashes the server.
func TestLeverEraEarly(t *testing.T) {
	for _, how := range []string{"lever", "transfer failure"} {
		t.Run(how, func(t *testing.T) {
			s, c := newSim(t, Options{LeverEra: LeversEarly, Backend: BackendMooncake, DPSize: 2})
			pin, _ := s.Inject(0, PinResurrection)
			other, _ := s.Inject(1, PinAbortBeforeRegister)
			run(s, c, 10*time.Second, 100*time.Millisecond)
			if st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: pin, DryRun: true}, ""); st != 501 ||
				resp.Result != pluginapi.ResultUnsupported {
				t.Fatalf("%d %+v", st, resp)
			}
			if l := s.Listing(0); len(l.Server.Levers) != 0 || l.Server.LeverNote == "" {
				t.Fatalf("server %+v", l.Server)
			}
			pid := s.Listing(1).Server.PID
			if how == "lever" {
				s.PullLever(0, pin)
			} else {
				s.Submit(RequestSpec{Behavior: BehaviorTransferFail, Transfer: time.Second})
			}
			run(s, c, 2*time.Second, 100*time.Millisecond)
			if !s.Booting() {
				t.Fatal("the server did not go down")
			}
			run(s, c, DefaultBootTime, time.Second)
			if s.Booting() {
				t.Fatal("still booting")
			}
			// Decode's heartbeat failed the rooms of the crashed prefill.
			for _, rid := range []string{pin, other} {
				if r := recordOf(t, s, rid); r.Outcome != OutcomeRestarted || r.DecodeEnd != DecodeHeartbeat {
					t.Fatalf("record %+v", r)
				}
			}
			if l := s.Listing(1); l.Server.PID == pid || len(l.Inflight) != 0 {
				t.Fatalf("after the crash: %+v", l)
			}
		})
	}
}

func restartCall(t *testing.T, url, auth, body string) (int, pluginapi.RestartResponse) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+pluginapi.PathRestart, strings.NewReader(body))
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rr pluginapi.RestartResponse
	raw, _ := io.ReadAll(resp.Body)
	if err := jsonUnmarshal(raw, &rr); err != nil {
		t.Fatalf("restart body %q: %v", raw, err)
	}
	return resp.StatusCode, rr
}

func TestRestart(t *testing.T) {
	// 20 ms transfers: the serial transfer workers keep up with the traffic.
	s, c := newSim(t, Options{Era: EraNewest, ArrivalRate: 20, TransferMedian: 20 * time.Millisecond, Seed: 11, Token: "tok", AllowRestart: true, DPSize: 2})
	pinRID, pinRoom := s.Inject(0, PinResurrection)
	wedge, wedgeRoom := s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, DecodePort: 17001})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	flip(t, s, 0, pinRID)
	flip(t, s, 0, wedge)
	behind, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: 200 * time.Millisecond})
	s.Submit(RequestSpec{Behavior: BehaviorPinAbortBeforeRegister})
	run(s, c, time.Second, 100*time.Millisecond)
	if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", map[string]string{"dp_rank": "0"}); v != 2 {
		t.Fatalf("failed counter %v", v)
	}
	before := s.Listing(0)
	if before.Loop.Iterations == 0 || mustMetric(t, s, "sglang:num_requests_total", nil) == 0 ||
		len(before.OrphanedTransfers) != 1 || before.OrphanedTransfers[0].BootstrapRoom != wedgeRoom {
		t.Fatalf("before the restart: %+v", before)
	}
	mustRoom(t, before, behind)

	srv := httptest.NewServer(s.PluginHandler(0))
	defer srv.Close()
	msrv := httptest.NewServer(s.MetricsHandler())
	defer msrv.Close()
	pid := before.Server.PID
	body := func(p int, dry bool) string {
		return `{"pid":` + strconv.Itoa(p) + `,"reason":"queue 1 wedged","dry_run":` + strconv.FormatBool(dry) + `}`
	}
	if st, rr := restartCall(t, srv.URL, "", body(pid, false)); st != 401 || rr.Result != pluginapi.ResultUnauthorized {
		t.Fatalf("no token: %d %+v", st, rr)
	}
	for _, b := range []string{`{}`, `{"pid":0}`, `{"pid":-3}`, `{"pid":"4242"}`, `{"pid":4242,"dry_run":1}`, `nope`} {
		if st, rr := restartCall(t, srv.URL, "Bearer tok", b); st != 400 || rr.Result != pluginapi.ResultBadRequest {
			t.Fatalf("body %s: %d %+v", b, st, rr)
		}
	}
	if st, rr := restartCall(t, srv.URL, "Bearer tok", body(pid+1, false)); st != 409 || rr.Result != pluginapi.ResultPIDMismatch || rr.PID != pid {
		t.Fatalf("wrong pid: %d %+v", st, rr)
	}
	if st, rr := restartCall(t, srv.URL, "Bearer tok", body(pid, true)); st != 200 || rr.Result != pluginapi.ResultWouldRestart || s.Booting() {
		t.Fatalf("dry run: %d %+v", st, rr)
	}
	restartAt := c.Now()
	if st, rr := restartCall(t, srv.URL, "Bearer tok", body(pid, false)); st != 202 || rr.Result != pluginapi.ResultRestarting || rr.PID != pid {
		t.Fatalf("restart: %d %+v", st, rr)
	}

	// Booting: nothing answers, nothing runs.
	for _, u := range []string{srv.URL + pluginapi.PathInflight, msrv.URL} {
		if resp, err := http.Get(u); err == nil {
			resp.Body.Close()
			t.Fatalf("%s answered %d while booting", u, resp.StatusCode)
		}
	}
	if st, _ := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: behind}, "Bearer tok"); st != 503 {
		t.Fatalf("force-fail while booting: %d", st)
	}
	run(s, c, DefaultBootTime-time.Second, time.Second)
	if !s.Booting() || s.Listing(0).Loop.Iterations != 0 {
		t.Fatal("the server came back before its boot time")
	}
	lost := 0
	for _, r := range s.Records() {
		switch r.Outcome {
		case OutcomeRestarted:
			lost++
			if !r.Left.Equal(restartAt) || r.DecodeReleased.After(restartAt.Add(HeartbeatDetection)) || r.DecodeReleased.Before(restartAt) {
				t.Fatalf("lost record %+v", r)
			}
		case OutcomeInflight, OutcomeQueued:
			t.Fatalf("record still in the server: %+v", r)
		}
	}
	if r := recordOf(t, s, behind); r.Outcome != OutcomeRestarted || r.Kind != KindBlockedByWedge {
		t.Fatalf("room behind the wedge: %+v", r)
	}
	if lost < 2 {
		t.Fatalf("%d requests lost in the restart", lost)
	}

	run(s, c, 2*time.Second, 100*time.Millisecond)
	after := getListing(t, srv.URL)
	for _, rq := range after.Inflight {
		if r := recordOf(t, s, rq.RID); r.Outcome == OutcomeRestarted || r.EnteredInflight.Before(restartAt) {
			t.Fatalf("a request survived the restart: %+v", r)
		}
	}
	if after.Loop.Iterations == 0 || after.Loop.Iterations > 20 || after.Server.PID == pid ||
		len(after.OrphanedTransfers) != 0 {
		t.Fatalf("after the restart: %+v", after)
	}
	for _, name := range []string{"sglang:num_transfer_failed_reqs_total", "sglang:scheduler_loop_iterations_total"} {
		if v := mustMetric(t, s, name, map[string]string{"dp_rank": "0"}); v > 20 || (name != "sglang:scheduler_loop_iterations_total" && v != 0) {
			t.Errorf("%s = %v after restart", name, v)
		}
	}
	// The wedge is gone: queue 1 serves again.
	next, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: 200 * time.Millisecond})
	run(s, c, time.Second, 100*time.Millisecond)
	if r := recordOf(t, s, next); r.Outcome != OutcomeSuccess {
		t.Fatalf("queue 1 after the restart: %+v", r)
	}
	// A later request reuses the pinned room with a new rid.
	newRID, _ := s.Submit(RequestSpec{Room: pinRoom, Behavior: BehaviorPinResurrection})
	s.Step()
	if st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: pinRID, BootstrapRoom: &pinRoom}, "Bearer tok"); st != 404 {
		t.Fatalf("old rid after restart: %d %+v", st, resp)
	}
	if resp := flip(t, s, 0, newRID); *resp.BootstrapRoom != pinRoom {
		t.Fatalf("new rid: %+v", resp)
	}
	// The old pid no longer restarts anything.
	if st, rr := restartCall(t, srv.URL, "Bearer tok", body(pid, false)); st != 409 || rr.PID != after.Server.PID {
		t.Fatalf("old pid: %d %+v", st, rr)
	}
}

func TestRestartRefused(t *testing.T) {
	s, _ := newSim(t, Options{Token: "tok"})
	srv := httptest.NewServer(s.PluginHandler(0))
	defer srv.Close()
	pid := s.Listing(0).Server.PID
	b := `{"pid":` + strconv.Itoa(pid) + `}`
	if st, rr := restartCall(t, srv.URL, "Bearer tok", b); st != 403 || rr.Result != pluginapi.ResultRestartDisabled || rr.PID != pid {
		t.Fatalf("disabled: %d %+v", st, rr)
	}
	if st, rr := restartCall(t, srv.URL, "Bearer nope", b); st != 401 || rr.Result != pluginapi.ResultUnauthorized {
		t.Fatalf("wrong token: %d %+v", st, rr)
	}
	open, _ := newSim(t, Options{AllowRestart: true})
	if st, _ := open.AdminRestart(0, pluginapi.RestartRequest{PID: open.Listing(0).Server.PID}, ""); st != 401 || open.Booting() {
		t.Fatalf("no configured token: %d", st)
	}
	if s.Booting() {
		t.Fatal("a refused restart restarted")
	}
}

// TestDecodeHold: decode frees a slot shortly after Success, but holds a
// request that prefill failed until its own waiting timeout.
func TestDecodeHold(t *testing.T) {
	s, c := newSim(t, Options{})
	ok, _ := s.Submit(RequestSpec{Transfer: time.Second})
	pin, _ := s.Inject(0, PinResurrection)
	fails, _ := s.Submit(RequestSpec{Behavior: BehaviorTransferFail, Transfer: 2 * time.Second})
	start := c.Now()
	run(s, c, 40*time.Second, 100*time.Millisecond)
	flip(t, s, 0, pin)
	run(s, c, DefaultDecodeWaitingTimeout-40*time.Second+time.Second, 100*time.Millisecond)
	r := recordOf(t, s, ok)
	if d := r.DecodeReleased.Sub(r.Left); r.Outcome != OutcomeSuccess || d <= 0 || d > time.Second {
		t.Fatalf("healthy: %+v", r)
	}
	for _, rid := range []string{pin, fails} {
		r := recordOf(t, s, rid)
		if r.Left.IsZero() || !r.DecodeReleased.Equal(start.Add(DefaultDecodeWaitingTimeout)) || r.DecodeEnd != DecodeTimeout {
			t.Fatalf("%s: decode released %v after arrival (%+v)", rid, r.DecodeReleased.Sub(start), r)
		}
	}
	s2, c2 := newSim(t, Options{DecodeWaitingTimeout: time.Minute})
	pin2, _ := s2.Inject(0, PinAbortBeforeRegister)
	start2 := c2.Now()
	run(s2, c2, time.Second, 100*time.Millisecond)
	flip(t, s2, 0, pin2)
	run(s2, c2, time.Minute, 100*time.Millisecond)
	if r := recordOf(t, s2, pin2); !r.DecodeReleased.Equal(start2.Add(time.Minute)) {
		t.Fatalf("with a 1 min timeout: %+v", r)
	}
}

// TestLeverEraNIXLMid2025TransferFailureCrashes: there a failed transfer
// makes NixlKVSender.poll() raise into the scheduler's pass (SGLang v0.4.6
// to v0.5.11, disaggregation/nixl/conn.py, as the conformance suite's
// test_inferred plays it), so the server goes down; it is not a clean
// release.
func TestLeverEraNIXLMid2025TransferFailureCrashes(t *testing.T) {
	s, c := newSim(t, Options{LeverEra: LeversNIXLMid2025, Backend: BackendNIXL})
	run(s, c, time.Second, 100*time.Millisecond)
	rid, _ := s.Submit(RequestSpec{Behavior: BehaviorTransferFail, Transfer: time.Second})
	run(s, c, 2*time.Second, 100*time.Millisecond)
	if !s.Booting() {
		t.Fatal("a failed transfer was released cleanly: mid-2025 NIXL's poll() raises")
	}
	run(s, c, DefaultBootTime, time.Second)
	if r := recordOf(t, s, rid); r.Outcome != OutcomeRestarted {
		t.Fatalf("record %+v", r)
	}
}
