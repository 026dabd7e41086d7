package sglangsim

import (
	"context"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func mustRoom(t *testing.T, l pluginapi.Listing, rid string) pluginapi.Room {
	t.Helper()
	rq, ok := room(l, rid)
	if !ok {
		t.Fatalf("%s is not inflight", rid)
	}
	return rq
}

func flip(t *testing.T, s *Sim, rank int, rid string) pluginapi.ForceFailResponse {
	t.Helper()
	st, resp := s.ForceFail(context.Background(), rank, pluginapi.ForceFailRequest{RID: rid, Reason: "test"}, "Bearer "+s.opts.Token)
	if st != 200 || resp.Result != pluginapi.ResultFlipped {
		t.Fatalf("force-fail %s on rank %d: %d %+v", rid, rank, st, resp)
	}
	return resp
}

// TestWedgeOutlivesEveryLever: a handle that never completes keeps its
// worker wedged after its room was force-failed and released; the rooms
// queued behind it (same queue, whichever decode endpoint) stay stuck, and
// later traffic to that queue too; rooms on other queues are healthy.
func TestWedgeOutlivesEveryLever(t *testing.T) {
	for _, backend := range []string{BackendNIXL, BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			s, c := newSim(t, Options{Backend: backend})
			// Decode ports 17001 and 17005 share queue 1; 17002 is queue 2.
			// The worker serves queue 1 serially: early first, then the pin.
			// The listing's progress is the scheduler's hand-overs and never
			// moves in the inflight queue.
			early, _ := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 4096, Transfer: 20 * time.Second})
			run(s, c, 6*time.Second, 100*time.Millisecond)
			// A room being sent reads Transferring on NIXL, WaitingForInput
			// on Mooncake, whose manager never writes Transferring.
			sending := map[string]string{BackendNIXL: pluginapi.PollTransferring, BackendMooncake: pluginapi.PollWaitingForInput}[backend]
			if rq := mustRoom(t, s.Listing(0), early); rq.Progress != listedProgress(backend, 4096) || rq.Poll != sending {
				t.Fatalf("early room before the wedge: %+v", rq)
			}
			pin, pinRoom := s.Submit(RequestSpec{DecodePort: 17001, Behavior: BehaviorPinStuckHandle, Transfer: time.Second})
			run(s, c, time.Second, 100*time.Millisecond)
			behind, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: 500 * time.Millisecond})
			sameQueue, _ := s.Submit(RequestSpec{DecodePort: 17005, Transfer: 500 * time.Millisecond})
			other, _ := s.Submit(RequestSpec{DecodePort: 17002, Transfer: 500 * time.Millisecond})
			run(s, c, time.Minute, time.Second)

			l := s.Listing(0)
			if _, ok := room(l, other); ok {
				t.Fatal("the room for another queue did not complete")
			}
			if r := recordOf(t, s, early); r.Kind != KindHealthy || r.Outcome != OutcomeSuccess {
				t.Fatalf("the room picked up before the stuck handle: %+v", r)
			}
			pinQ := mustRoom(t, l, pin)
			if pinQ.Progress != listedProgress(backend, pinQ.PromptTokens) || pinQ.Poll != sending || !*pinQ.TransferInFlight {
				t.Fatalf("stuck handle: %+v", pinQ)
			}
			if *pinQ.TransferQueue != 1 {
				t.Fatalf("stuck handle on queue %v", *pinQ.TransferQueue)
			}

			// Every lever on the stuck room releases the request...
			flip(t, s, 0, pin)
			run(s, c, 100*time.Millisecond, 100*time.Millisecond)
			l = s.Listing(0)
			if _, ok := room(l, pin); ok {
				t.Fatal("the stuck room was not released")
			}
			// ...but not the worker: its chunk is still outstanding, for ever.
			late, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: 500 * time.Millisecond})
			run(s, c, 10*time.Minute, time.Second)
			l = s.Listing(0)
			for _, rid := range []string{behind, sameQueue, late} {
				rq := mustRoom(t, l, rid)
				if rq.Progress != listedProgress(backend, rq.PromptTokens) || rq.Poll != pluginapi.PollWaitingForInput || *rq.TransferInFlight {
					t.Fatalf("room behind the wedge: %+v", rq)
				}
				if r := recordOf(t, s, rid); r.Kind != KindBlockedByWedge || r.Outcome != OutcomeInflight {
					t.Fatalf("record %+v", r)
				}
			}
			if len(l.OrphanedTransfers) != 1 {
				t.Fatalf("orphaned transfers %+v", l.OrphanedTransfers)
			}
			if o := l.OrphanedTransfers[0]; o.BootstrapRoom != pinRoom || *o.TransferQueue != 1 || o.OutstandingChunks != 1 {
				t.Fatalf("orphan %+v", o)
			}
			// A room behind the wedge is released by its own lever (its queued
			// chunks are skipped: no orphan), and the wedge stays.
			flip(t, s, 0, behind)
			run(s, c, time.Minute, time.Second)
			l = s.Listing(0)
			if _, ok := room(l, behind); ok {
				t.Fatal("room behind the wedge not released by its lever")
			}
			if len(l.OrphanedTransfers) != 1 {
				t.Fatalf("orphaned transfers %+v", l.OrphanedTransfers)
			}
			mustRoom(t, l, sameQueue)
			if r := recordOf(t, s, behind); r.Outcome != OutcomeFailedForced || r.ProgressingWhenForced {
				t.Fatalf("record %+v", r)
			}
			fresh, _ := s.Submit(RequestSpec{DecodePort: 17002, Transfer: 500 * time.Millisecond})
			run(s, c, 2*time.Second, 100*time.Millisecond)
			if r := recordOf(t, s, fresh); r.Outcome != OutcomeSuccess {
				t.Fatalf("room for another queue after the wedge: %+v", r)
			}
		})
	}
}

// TestQueueKeys: newest NIXL keys the queue by destination decode ports,
// older NIXL by room % 4.
func TestQueueKeys(t *testing.T) {
	cases := []struct {
		key           string
		stuckBehind   bool // room 12, port 17002, behind the stuck room 8, port 17001
		stuckSamePort bool // room 13, port 17001
	}{
		{QueueKeyDecodePorts, false, true},
		{QueueKeyRoom, true, false},
	}
	for _, tc := range cases {
		t.Run(tc.key, func(t *testing.T) {
			s, c := newSim(t, Options{QueueKey: tc.key})
			pin, _ := s.Submit(RequestSpec{Room: 8, DecodePort: 17001, Behavior: BehaviorPinStuckHandle, Transfer: time.Second})
			run(s, c, time.Second, 100*time.Millisecond)
			sameRoomQueue, _ := s.Submit(RequestSpec{Room: 12, DecodePort: 17002, Transfer: 500 * time.Millisecond})
			samePort, _ := s.Submit(RequestSpec{Room: 13, DecodePort: 17001, Transfer: 500 * time.Millisecond})
			run(s, c, time.Minute, time.Second)
			l := s.Listing(0)
			want := map[string]int{pin: 1, sameRoomQueue: 2, samePort: 1}
			if tc.key == QueueKeyRoom {
				want = map[string]int{pin: 0, sameRoomQueue: 0, samePort: 1}
			}
			for rid, q := range want {
				if rq, ok := room(l, rid); ok && *rq.TransferQueue != q {
					t.Errorf("%s on queue %d, want %d", rid, *rq.TransferQueue, q)
				}
			}
			if _, ok := room(l, sameRoomQueue); ok != tc.stuckBehind {
				t.Errorf("room 12 stuck = %v, want %v", ok, tc.stuckBehind)
			}
			if _, ok := room(l, samePort); ok != tc.stuckSamePort {
				t.Errorf("room 13 stuck = %v, want %v", ok, tc.stuckSamePort)
			}
		})
	}
}

// TestOrphanedTransferSettles: a healthy room force-failed with a chunk in
// flight leaves an orphaned transfer until that chunk settles.
func TestOrphanedTransferSettles(t *testing.T) {
	s, c := newSim(t, Options{})
	rid, rm := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: time.Hour, ChunkEvery: 10 * time.Second})
	run(s, c, 3*time.Second, 100*time.Millisecond)
	if rq := mustRoom(t, s.Listing(0), rid); !*rq.TransferInFlight {
		t.Fatalf("transferring room without a chunk in flight: %+v", rq)
	}
	flip(t, s, 0, rid)
	s.Step()
	l := s.Listing(0)
	if _, ok := room(l, rid); ok || len(l.OrphanedTransfers) != 1 || l.OrphanedTransfers[0].BootstrapRoom != rm {
		t.Fatalf("after the release: inflight %v, orphaned %+v", l.Inflight, l.OrphanedTransfers)
	}
	if r := recordOf(t, s, rid); !r.ProgressingWhenForced {
		t.Fatalf("record %+v", r)
	}
	run(s, c, 6*time.Second, 100*time.Millisecond)
	if l := s.Listing(0); len(l.OrphanedTransfers) != 1 {
		t.Fatalf("the chunk settled early: %+v", l.OrphanedTransfers)
	}
	run(s, c, 2*time.Second, 100*time.Millisecond)
	if l := s.Listing(0); len(l.OrphanedTransfers) != 0 {
		t.Fatalf("the chunk never settled: %+v", l.OrphanedTransfers)
	}
}

// TestUntrackedTransfers: a manager without a count of each room's
// outstanding chunks (Mooncake up to v0.5.11) still serves its queues one
// chunk at a time, and the plugin lists the workers, but no room's chunk
// as in flight, no orphan, and no rank watched.
func TestUntrackedTransfers(t *testing.T) {
	s, c := newSim(t, Options{Backend: BackendMooncake, UntrackedTransfers: true})
	pin, pinRoom := s.Submit(RequestSpec{DecodePort: 17001, Behavior: BehaviorPinStuckHandle, FreezeAt: -1})
	behind, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: 100 * time.Millisecond})
	run(s, c, 2*time.Second, 100*time.Millisecond)
	l := s.Listing(0)
	if *l.Server.TransferTracking || *l.Server.TransferRanksWatched != 0 || !*l.Server.TransferProgress {
		t.Fatalf("server: %+v", l.Server)
	}
	if w := workerOf(t, l, 1); w.InFlight == nil || w.InFlight.BootstrapRoom != pinRoom || w.Depth != 2 { // the held chunk and the one behind
		t.Fatalf("worker 1: %+v", w)
	}
	for _, rid := range []string{pin, behind} {
		if rq := mustRoom(t, l, rid); *rq.TransferInFlight || rq.Poll != pluginapi.PollWaitingForInput {
			t.Fatalf("%s: %+v", rid, rq)
		}
	}
	if st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: pin, BootstrapRoom: &pinRoom}, ""); st != 200 {
		t.Fatalf("force-fail: %d %+v", st, resp)
	}
	run(s, c, time.Second, 100*time.Millisecond)
	if l := s.Listing(0); len(l.OrphanedTransfers) != 0 || len(l.Inflight) != 1 {
		t.Fatalf("after the force-fail: orphans %+v, rooms %+v", l.OrphanedTransfers, l.Inflight)
	}
}

// TestMid2025NIXLHasNoWorkerQueue: mid-2025 NIXL's scheduler thread posts
// each room's chunks itself, so a stuck handle holds its own room only;
// the room sent after it on the same destination completes.
func TestMid2025NIXLHasNoWorkerQueue(t *testing.T) {
	s, c := newSim(t, Options{LeverEra: LeversNIXLMid2025})
	pin, _ := s.Submit(RequestSpec{DecodePort: 17001, Behavior: BehaviorPinStuckHandle, FreezeAt: -1})
	after, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: 100 * time.Millisecond})
	run(s, c, 2*time.Second, 100*time.Millisecond)
	if r := recordOf(t, s, after); r.Kind != KindHealthy || r.Outcome != OutcomeSuccess {
		t.Fatalf("the room after the stuck handle: %+v", r)
	}
	if rq := mustRoom(t, s.Listing(0), pin); rq.Poll != pluginapi.PollWaitingForInput {
		t.Fatalf("the stuck handle: %+v", rq)
	}
}
