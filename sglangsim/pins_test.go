package sglangsim

import (
	"context"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func TestPinsStayUntilLever(t *testing.T) {
	cases := []struct {
		pin  PinKind
		kind Kind
		poll string
	}{
		{PinResurrection, KindPinResurrection, pluginapi.PollTransferring},
		{PinAbortBeforeRegister, KindPinAbortBeforeRegister, pluginapi.PollWaitingForInput},
		{PinStuckHandle, KindPinStuckHandle, pluginapi.PollTransferring},
	}
	for _, backend := range []string{BackendNIXL, BackendMooncake} {
		for _, tc := range cases {
			t.Run(backend+"/"+string(tc.kind), func(t *testing.T) {
				s, c := newSim(t, Options{Backend: backend, DPSize: 2, Era: EraNewest})
				rid, rm := s.Inject(1, tc.pin)
				run(s, c, 10*time.Minute, time.Second)
				l := s.Listing(1)
				rq, ok := room(l, rid)
				// The listing's progress is the scheduler's hand-overs, done before
				// the room entered the inflight queue: it never moved.
				poll := tc.poll
				if backend == BackendMooncake && tc.pin == PinStuckHandle {
					// Mooncake's manager never writes Transferring: the
					// held chunk's room reads WaitingForInput (mooncake/conn.py).
					poll = pluginapi.PollWaitingForInput
				}
				if !ok || rq.Poll != poll || rq.Progress != listedProgress(backend, rq.PromptTokens) || rq.SendFailed || rq.BootstrapRoom != rm {
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
				if rq.SendFailed != (backend == BackendNIXL) || rq.Poll != poll {
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
				// Only a stuck handle holds a chunk when its pages are freed,
				// and it never reads again.
				wantFree := PrefillFree("")
				if tc.pin == PinStuckHandle {
					wantFree = PrefillFreeHungHandle
				}
				if r.PrefillFreedUnder != wantFree {
					t.Fatalf("prefill pages freed under %q, want %q", r.PrefillFreedUnder, wantFree)
				}
				if st, _ := s.ForceFail(context.Background(), 1, pluginapi.ForceFailRequest{RID: rid}, ""); st != 404 {
					t.Fatalf("force-fail after release: %d", st)
				}
			})
		}
	}
}

func TestForceFailProgressingRequestsIsRecorded(t *testing.T) {
	s, c := newSim(t, Options{})
	healthy, _ := s.Submit(RequestSpec{Transfer: time.Minute})
	slow, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow})
	hc, _ := s.Submit(RequestSpec{Behavior: BehaviorStuckHealthCheck})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	// A lever on a transfer its worker is moving frees pages the worker
	// still reads; one still queued behind it, or a health check's fake
	// sender, frees none under a read.
	wantFree := map[string]PrefillFree{hc: ""}
	l := s.Listing(0)
	for _, rid := range []string{healthy, slow} {
		rq, _ := room(l, rid)
		if rq.TransferInFlight != nil && *rq.TransferInFlight {
			wantFree[rid] = PrefillFreeLiveRead
		} else {
			wantFree[rid] = ""
		}
	}
	if wantFree[healthy] == wantFree[slow] {
		t.Fatalf("want one transfer moving and one queued behind it: %v", wantFree)
	}
	for _, rid := range []string{healthy, slow} {
		if st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid}, ""); st != 200 ||
			resp.Result != pluginapi.ResultFlipped {
			t.Fatalf("%s: %d %+v", rid, st, resp)
		}
	}
	// The plugin refuses a health check; pulling its lever by hand is recorded.
	if st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: hc}, ""); st != 409 ||
		resp.Result != pluginapi.ResultHealthCheck {
		t.Fatalf("health check: %d %+v", st, resp)
	}
	if !s.PullLever(0, hc) {
		t.Fatal("health check not inflight")
	}
	s.Step()
	for _, rid := range []string{healthy, slow, hc} {
		if r := recordOf(t, s, rid); r.Outcome != OutcomeFailedForced || !r.ProgressingWhenForced {
			t.Fatalf("record %+v", r)
		}
	}
	for rid, want := range wantFree {
		if r := recordOf(t, s, rid); r.PrefillFreedUnder != want {
			t.Fatalf("%s: prefill pages freed under %q, want %q", rid, r.PrefillFreedUnder, want)
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
