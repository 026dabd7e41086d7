package sglangsim

import (
	"context"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func TestPinsStayUntilLever(t *testing.T) {
	cases := []struct {
		pin      PinKind
		kind     Kind
		poll     string
		progress int64
	}{
		{PinResurrection, KindPinResurrection, pluginapi.PollTransferring, 3},
		{PinAbortBeforeRegister, KindPinAbortBeforeRegister, pluginapi.PollWaitingForInput, 0},
		{PinStuckHandle, KindPinStuckHandle, pluginapi.PollTransferring, 1},
	}
	for _, backend := range []string{BackendNIXL, BackendMooncake} {
		for _, tc := range cases {
			t.Run(backend+"/"+string(tc.kind), func(t *testing.T) {
				s, c := newSim(t, Options{Backend: backend, DPSize: 2, Era: EraNewest})
				rid, rm := s.Inject(1, tc.pin)
				run(s, c, 10*time.Minute, time.Second)
				l := s.Listing(1)
				rq, ok := room(l, rid)
				if !ok || rq.Poll != tc.poll || rq.Progress != tc.progress || rq.SendFailed || rq.BootstrapRoom != rm {
					t.Fatalf("after 10 minutes: %+v (found %v)", rq, ok)
				}
				if rq.AgeSeconds < 599 {
					t.Fatalf("age %v", rq.AgeSeconds)
				}
				failed := map[string]string{"dp_rank": "1"}
				if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", failed); v != 0 {
					t.Fatalf("failed counter %v before the lever", v)
				}
				st, resp := s.ForceFail(context.Background(), 1, pluginapi.ForceFailRequest{RID: rid, BootstrapRoom: &rm,
					Reason: "stuck"}, "")
				wantLever := pluginapi.LeverSendFailed
				if backend == BackendMooncake {
					wantLever = pluginapi.LeverConcludeState
				}
				if st != 200 || resp.Result != pluginapi.ResultFlipped || resp.Lever != wantLever || resp.RID != rid ||
					*resp.BootstrapRoom != rm {
					t.Fatalf("force-fail: %d %+v", st, resp)
				}
				rq, _ = room(s.Listing(1), rid)
				if rq.SendFailed != (backend == BackendNIXL) || rq.Poll != tc.poll {
					t.Fatalf("after the lever, before the pass: %+v", rq)
				}
				st, resp = s.ForceFail(context.Background(), 1, pluginapi.ForceFailRequest{RID: rid}, "")
				if st != 200 || resp.Result != pluginapi.ResultAlreadyFailed {
					t.Fatalf("second force-fail: %d %+v", st, resp)
				}
				c.Advance(100 * time.Millisecond)
				s.Step()
				if _, ok := room(s.Listing(1), rid); ok {
					t.Fatal("still inflight after the lever")
				}
				if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", failed); v != 1 {
					t.Fatalf("failed counter %v, want 1", v)
				}
				if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", map[string]string{"dp_rank": "0"}); v != 0 {
					t.Fatalf("rank 0 counter %v", v)
				}
				r := recordOf(t, s, rid)
				if r.Kind != tc.kind || r.Outcome != OutcomeFailedForced || r.ProgressingWhenForced || r.Rank != 1 ||
					r.ForcedAt.IsZero() || r.Left.Before(r.ForcedAt) {
					t.Fatalf("record %+v", r)
				}
				if st, _ := s.ForceFail(context.Background(), 1, pluginapi.ForceFailRequest{RID: rid}, ""); st != 404 {
					t.Fatalf("force-fail after release: %d", st)
				}
			})
		}
	}
}

func TestStuckHandleWedgesItsShard(t *testing.T) {
	s, c := newSim(t, Options{})
	// Shard 0 of rank 0: a healthy room already transferring (the serial
	// worker took it before the stuck handle, so it finishes), then the stuck
	// handle, then rooms that arrive behind the wedge. Shard 1 stays healthy.
	early, _ := s.Submit(RequestSpec{Room: 4, PromptTokens: 4096, Transfer: 20 * time.Second})
	run(s, c, 6*time.Second, 100*time.Millisecond)
	if rq, _ := room(s.Listing(0), early); rq.Progress != 1 || rq.Poll != pluginapi.PollTransferring {
		t.Fatalf("early room before the wedge: %+v", rq)
	}
	pin, _ := s.Submit(RequestSpec{Room: 8, Behavior: BehaviorPinStuckHandle, Transfer: time.Second})
	run(s, c, time.Second, 100*time.Millisecond)
	behind, _ := s.Submit(RequestSpec{Room: 12, Transfer: 500 * time.Millisecond})
	behind2, _ := s.Submit(RequestSpec{Room: 16, Transfer: 500 * time.Millisecond})
	other, _ := s.Submit(RequestSpec{Room: 13, Transfer: 500 * time.Millisecond})
	run(s, c, time.Minute, time.Second)

	l := s.Listing(0)
	if _, ok := room(l, other); ok {
		t.Fatal("the room on another shard did not complete")
	}
	if _, ok := room(l, early); ok {
		t.Fatal("the room picked up before the stuck handle did not complete")
	}
	if r := recordOf(t, s, early); r.Kind != KindHealthy || r.Outcome != OutcomeSuccess {
		t.Fatalf("record %+v", r)
	}
	for _, rid := range []string{behind, behind2} {
		if rq, ok := room(l, rid); !ok || rq.Progress != 0 || rq.Poll != pluginapi.PollWaitingForInput {
			t.Fatalf("room behind the wedge: %+v", rq)
		}
		if r := recordOf(t, s, rid); r.Kind != KindBlockedByWedge {
			t.Fatalf("record %+v", r)
		}
	}
	if rq, _ := room(l, pin); rq.Progress != 1 || rq.Poll != pluginapi.PollTransferring {
		t.Fatalf("stuck handle: %+v", rq)
	}
	// Force-failing a room while the wedge holds it is not a mistake...
	if st, _ := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: behind2}, ""); st != 200 {
		t.Fatal(st)
	}
	// ...the lever on the stuck handle clears the wedge.
	if st, _ := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: pin}, ""); st != 200 {
		t.Fatal(st)
	}
	c.Advance(100 * time.Millisecond)
	s.Step()
	l = s.Listing(0)
	if _, ok := room(l, pin); ok {
		t.Fatal("stuck handle not released")
	}
	if rq, _ := room(l, behind); rq.Poll != pluginapi.PollTransferring {
		t.Fatalf("room behind the wedge did not resume: %+v", rq)
	}
	run(s, c, time.Second, 100*time.Millisecond)
	if _, ok := room(s.Listing(0), behind); ok {
		t.Fatal("room behind the wedge did not complete after it cleared")
	}
	if r := recordOf(t, s, behind); r.Outcome != OutcomeSuccess || r.Kind != KindBlockedByWedge {
		t.Fatalf("record %+v", r)
	}
	if r := recordOf(t, s, behind2); r.Outcome != OutcomeFailedForced || r.ProgressingWhenForced {
		t.Fatalf("record %+v", r)
	}
	if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", nil); v != 2 {
		t.Fatalf("failed counter %v", v)
	}
}

func TestForceFailProgressingRequestsIsRecorded(t *testing.T) {
	s, c := newSim(t, Options{})
	healthy, _ := s.Submit(RequestSpec{Transfer: time.Minute})
	slow, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow})
	hc, _ := s.Submit(RequestSpec{Behavior: BehaviorStuckHealthCheck})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	for _, rid := range []string{healthy, slow, hc} {
		if st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid}, ""); st != 200 ||
			resp.Result != pluginapi.ResultFlipped {
			t.Fatalf("%s: %d %+v", rid, st, resp)
		}
	}
	s.Step()
	for _, rid := range []string{healthy, slow, hc} {
		if r := recordOf(t, s, rid); r.Outcome != OutcomeFailedForced || !r.ProgressingWhenForced {
			t.Fatalf("record %+v", r)
		}
	}
}

func TestTransferFailReleasesByItself(t *testing.T) {
	s, c := newSim(t, Options{Era: EraModelName})
	rid, _ := s.Submit(RequestSpec{Behavior: BehaviorTransferFail, Transfer: 2 * time.Second})
	run(s, c, 3*time.Second, 100*time.Millisecond)
	if r := recordOf(t, s, rid); r.Outcome != OutcomeFailed || r.Kind != KindFailing {
		t.Fatalf("record %+v", r)
	}
	if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", nil); v != 1 {
		t.Fatalf("failed counter %v", v)
	}
}
