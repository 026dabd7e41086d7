package sglangsim

import (
	"bytes"
	"context"
	"encoding/json"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func prefillFF(s *Sim, rid string) (int, pluginapi.ForceFailResponse) {
	return s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid}, "Bearer "+s.opts.Token)
}

func orphanOf(l pluginapi.Listing, room uint64) (pluginapi.OrphanedTransfer, bool) {
	for _, o := range l.OrphanedTransfers {
		if o.BootstrapRoom == room {
			return o, true
		}
	}
	return pluginapi.OrphanedTransfer{}, false
}

// TestTPListingRanks: transfer_ranks and transfer_ranks_watched per view,
// and what they make of Server.SeesEveryWriter.
func TestTPListingRanks(t *testing.T) {
	for _, tc := range []struct {
		name           string
		o              Options
		ranks, watched int
		every          bool
	}{
		{"one rank", Options{}, 1, 1, true},
		{"TP2", Options{AttnTP: 2}, 2, 2, true},
		{"TP4 one stale peer", Options{AttnTP: 4, TPUnwatched: 1}, 4, 3, false},
		{"TP2 leader-only view", Options{AttnTP: 2, LeaderOnlyView: true}, 1, 1, true},
		{"TP2 mid-2025 NIXL", Options{AttnTP: 2, LeverEra: LeversNIXLMid2025}, 2, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSim(t, tc.o)
			srv := s.Listing(0).Server
			if *srv.TransferRanks != tc.ranks || *srv.TransferRanksWatched != tc.watched || srv.SeesEveryWriter() != tc.every {
				t.Fatalf("ranks %d watched %d sees every writer %v", *srv.TransferRanks, *srv.TransferRanksWatched, srv.SeesEveryWriter())
			}
		})
	}
	if _, err := New(Options{Clock: clock.NewFake(t0), AttnTP: 2, TPUnwatched: 2}); err == nil {
		t.Fatal("TPUnwatched beyond the non-leader ranks was accepted")
	}
}

// TestTPNonLeaderWedge: a handle hung on the non-leader rank only. The
// leader's own share lands (its poll reads Success), but the group's MIN
// poll keeps the room in the inflight queue, the merged listing shows its
// chunk in flight, and decode, whose receivers miss that rank's share,
// never sees it done. A force-fail through the leader pulls the levers
// where the plugin sees the other rank still sending (round 5, as the
// plugin does: the Success branch would wait for ever). Where it cannot
// see that rank it changes nothing: a round 4 plugin (the leader-only
// view) answers transfer_succeeded, a false promise; round 5 answers
// group_unwatched and names the stale rank.
func TestTPNonLeaderWedge(t *testing.T) {
	for _, tc := range []struct {
		name     string
		o        Options
		inFlight bool
		refusal  string
	}{
		{"round 5", Options{AttnTP: 2}, true, ""},
		{"leader-only view", Options{AttnTP: 2, LeaderOnlyView: true}, false, pluginapi.ResultTransferSucceeded},
		{"stale peer", Options{AttnTP: 2, TPUnwatched: 1}, false, pluginapi.ResultGroupUnwatched},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, c := newSim(t, tc.o)
			rid, _, rm := hungOnRanks(t, s, c, []int{1}, 30*time.Second)
			if rm.Poll != pluginapi.PollSuccess || *rm.TransferInFlight != tc.inFlight {
				t.Fatalf("listed %+v, want the leader's Success and transfer_in_flight %v", rm, tc.inFlight)
			}
			d := mustDecodeReq(t, s.DecodeListing(0), rid)
			if d.Queue != pluginapi.DecodeQueueTransfer || d.Poll == pluginapi.PollSuccess {
				t.Fatalf("decode saw the transfer done: %+v", d)
			}
			st, resp := prefillFF(s, rid)
			if !tc.inFlight {
				if st != 409 || resp.Result != tc.refusal {
					t.Fatalf("force-fail through the leader, the other rank unseen: %d %+v, want 409 %s", st, resp, tc.refusal)
				}
				if tc.refusal == pluginapi.ResultGroupUnwatched && !reflect.DeepEqual(resp.Ranks, []string{"tp1-cp0"}) {
					t.Fatalf("group_unwatched names ranks %v, want [tp1-cp0]", resp.Ranks)
				}
				if rec := recordOf(t, s, rid); rec.Outcome != OutcomeInflight {
					t.Fatalf("record %+v", rec)
				}
				return
			}
			if st != 200 || resp.Result != pluginapi.ResultFlipped {
				t.Fatalf("force-fail through the leader, the other rank still sending: %d %+v", st, resp)
			}
			run(s, c, time.Second, 100*time.Millisecond)
			if rec := recordOf(t, s, rid); rec.Outcome != OutcomeFailedForced {
				t.Fatalf("record %+v, want released by the force-fail", rec)
			}
		})
	}
}

// TestTPForceFailLeavesPeerWrite: room B waits on the leader behind a
// handle hung there (nothing of B in flight on the leader) while the
// other rank, whose worker got past that room, hangs on B's chunk. A
// force-fail through the leader fails B on every rank (the MIN reads
// Failed) and releases it, but the other rank's chunk is not recalled:
// round 5 lists it as an orphan (no queue), the leader-only view shows
// nothing. Decode told "stopped" frees pages that chunk still writes, and
// the next request that gets them is corrupted.
func TestTPForceFailLeavesPeerWrite(t *testing.T) {
	for _, leaderOnly := range []bool{false, true} {
		name := map[bool]string{false: "round 5", true: "leader-only view"}[leaderOnly]
		t.Run(name, func(t *testing.T) {
			s, c := newSim(t, Options{AttnTP: 2, LeaderOnlyView: leaderOnly})
			s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, PinTPRanks: []int{0}, DecodePort: 17001,
				Transfer: 2 * time.Second, Bootstrap: time.Millisecond})
			run(s, c, time.Second, 100*time.Millisecond)
			rid, rm := s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, PinTPRanks: []int{1}, DecodePort: 17001,
				Transfer: 2 * time.Second, PromptTokens: 4096})
			run(s, c, 10*time.Second, 100*time.Millisecond)
			b, ok := room(s.Listing(0), rid)
			if !ok || b.Poll != pluginapi.PollWaitingForInput || *b.TransferInFlight == leaderOnly {
				t.Fatalf("before the force-fail: %+v %v", b, ok)
			}
			if st, resp := prefillFF(s, rid); st != 200 || resp.Result != pluginapi.ResultFlipped {
				t.Fatalf("force-fail through the leader: %d %+v", st, resp)
			}
			run(s, c, time.Second, 100*time.Millisecond)
			l := s.Listing(0)
			if _, ok := room(l, rid); ok {
				t.Fatal("the room is still in the inflight queue after its force-fail")
			}
			if rec := recordOf(t, s, rid); rec.Outcome != OutcomeFailedForced {
				t.Fatalf("record %+v", rec)
			}
			o, orphaned := orphanOf(l, rm)
			if orphaned == leaderOnly || (orphaned && (o.TransferQueue != nil || o.OutstandingChunks != 1)) {
				t.Fatalf("orphaned_transfers %+v", l.OrphanedTransfers)
			}
			// What a decode side told "stopped" does.
			mustDecodeFlip(t, s, rid, true, pluginapi.LeverAbort)
			run(s, c, time.Second, 100*time.Millisecond)
			next, _ := s.Submit(RequestSpec{DecodePort: 17003, Transfer: 10 * time.Second})
			run(s, c, 3*time.Second, 100*time.Millisecond)
			if r := recordOf(t, s, rid); r.UnsafeFree != DecodeForceFail {
				t.Fatalf("the free under the other rank's live write went unrecorded: %+v", r)
			}
			if v := recordOf(t, s, next); v.CorruptedBy != rid {
				t.Fatalf("the late write did not land: %+v %+v", v, s.Corruptions())
			}
		})
	}
}

// TestTPOtherRankChunkSettles: a force-fail while the other rank is still
// sending a healthy chunk: that chunk keeps writing until it settles,
// listed as an orphan meanwhile; its queued chunks are dropped.
func TestTPOtherRankChunkSettles(t *testing.T) {
	s, c := newSim(t, Options{AttnTP: 2})
	rid, rm := s.Submit(RequestSpec{Behavior: BehaviorPinResurrection, PinTPRanks: []int{0}, FreezeAt: 1, DecodePort: 17002,
		Transfer: 100 * time.Second, Chunks: 10, PromptTokens: 10240})
	run(s, c, 25*time.Second, 100*time.Millisecond)
	if st, resp := prefillFF(s, rid); st != 200 || resp.Result != pluginapi.ResultFlipped {
		t.Fatalf("force-fail: %d %+v", st, resp)
	}
	run(s, c, 200*time.Millisecond, 100*time.Millisecond)
	if _, ok := orphanOf(s.Listing(0), rm); !ok {
		t.Fatalf("the other rank's chunk in flight is not listed: %+v", s.Listing(0).OrphanedTransfers)
	}
	run(s, c, 10*time.Second, 100*time.Millisecond)
	if o, ok := orphanOf(s.Listing(0), rm); ok {
		t.Fatalf("the chunk never settled: %+v", o)
	}
}

// TestTPPeerTransferWorkers: a handle hung on the non-leader rank only.
// The leader lists that rank's workers apart from its own, so the chunk in
// flight shows on the peer's worker for the room's queue, held longer with
// every listing, and not on the leader's.
func TestTPPeerTransferWorkers(t *testing.T) {
	s, c := newSim(t, Options{AttnTP: 2})
	_, rm, r := hungOnRanks(t, s, c, []int{1}, 30*time.Second)
	l := s.Listing(0)
	if r.TransferQueue == nil || r.PeerChunksQueued == nil {
		t.Fatalf("listed %+v, want the room with its queue and peer_chunks_queued", r)
	}
	qi := *r.TransferQueue
	if len(l.PeerTransferWorkers) != 1 || l.PeerTransferWorkers[0].Rank != "tp1-cp0" {
		t.Fatalf("peer_transfer_workers %+v, want tp1-cp0 alone", l.PeerTransferWorkers)
	}
	held := l.PeerTransferWorkers[0].TransferWorkers[qi].InFlight
	if held == nil || held.BootstrapRoom != rm {
		t.Fatalf("tp1-cp0's worker %d holds %+v, want a chunk of room %d", qi, held, rm)
	}
	if own := l.TransferWorkers[qi].InFlight; own != nil && own.BootstrapRoom == rm {
		t.Fatalf("the leader's worker %d holds %+v, whose handle is not hung", qi, own)
	}
	run(s, c, 5*time.Second, 100*time.Millisecond)
	later := s.Listing(0).PeerTransferWorkers[0].TransferWorkers[qi].InFlight
	if later == nil || later.BootstrapRoom != rm || later.Chunk != held.Chunk || later.Seconds < held.Seconds+4.9 {
		t.Fatalf("5 s later tp1-cp0's worker %d holds %+v, was %+v", qi, later, held)
	}
}

// TestTPPeerChunksQueued: room B waits on the non-leader rank behind a
// handle hung there, while the leader's worker sent all of it. Its chunks
// are queued on the peer, not on the leader.
func TestTPPeerChunksQueued(t *testing.T) {
	s, c := newSim(t, Options{AttnTP: 2})
	s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, PinTPRanks: []int{1}, DecodePort: 17001,
		Transfer: 2 * time.Second, Bootstrap: time.Millisecond})
	run(s, c, time.Second, 100*time.Millisecond)
	rid, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: 2 * time.Second, PromptTokens: 4096})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	b, ok := room(s.Listing(0), rid)
	if !ok {
		t.Fatalf("the room behind the peer's hung handle left the inflight queue: %+v", recordOf(t, s, rid))
	}
	if b.ChunksQueued == nil || *b.ChunksQueued != 0 || b.PeerChunksQueued == nil || *b.PeerChunksQueued < 1 {
		t.Fatalf("listed %+v, want no chunk queued on the leader and some on the peer", b)
	}
	// The peer's worker that holds the hung chunk lists the room as
	// waiting behind it, so the watchdog can tell whom it waits for.
	var behind []uint64
	for _, tw := range s.Listing(0).PeerTransferWorkers[0].TransferWorkers {
		if tw.InFlight != nil {
			behind = append(behind, tw.QueuedRooms...)
		}
	}
	if !slices.Contains(behind, b.BootstrapRoom) {
		t.Fatalf("the peer's busy workers list %v queued, want room %d among them", behind, b.BootstrapRoom)
	}
}

// TestTPPeerWorkersUnlisted: no peer's workers and no peer_chunks_queued
// where the leader watches no peer (one rank, a stale peer, the
// leader-only view) or no manager keeps the count (mid-2025 NIXL); with
// one rank the listing is as before round 5.
func TestTPPeerWorkersUnlisted(t *testing.T) {
	for _, tc := range []struct {
		name    string
		o       Options
		pins    []int
		workers bool // the leader's own transfer_workers are listed
	}{
		{"one rank", Options{}, nil, true},
		{"stale peer", Options{AttnTP: 2, TPUnwatched: 1}, []int{1}, true},
		{"leader-only view", Options{AttnTP: 2, LeaderOnlyView: true}, []int{1}, true},
		{"mid-2025 NIXL", Options{AttnTP: 2, LeverEra: LeversNIXLMid2025}, []int{1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, c := newSim(t, tc.o)
			_, _, r := hungOnRanks(t, s, c, tc.pins, 10*time.Second)
			l := s.Listing(0)
			if (l.TransferWorkers != nil) != tc.workers {
				t.Fatalf("transfer_workers %+v, want listed: %v", l.TransferWorkers, tc.workers)
			}
			if l.PeerTransferWorkers != nil || r.PeerChunksQueued != nil {
				t.Fatalf("peer_transfer_workers %+v, peer_chunks_queued %v, want neither", l.PeerTransferWorkers, r.PeerChunksQueued)
			}
			b, err := json.Marshal(l)
			if err != nil {
				t.Fatal(err)
			}
			if bytes.Contains(b, []byte(`"peer_`)) {
				t.Fatalf("the listing names a peer field: %s", b)
			}
		})
	}
}

// TestTPLinkSpeedOfOneRank: each rank of the group writes over its own
// link. With the non-leader's at 1%, a 2 s transfer lands on the leader
// (its poll reads Success) while the other rank's chunk still takes about
// 200 s; the group's MIN keeps the room until then, and SGLang then
// releases it as sent.
func TestTPLinkSpeedOfOneRank(t *testing.T) {
	s, c := newSim(t, Options{AttnTP: 2})
	if err := s.SetTPLinkSpeed(-1, 2, -1, 0.5); err == nil {
		t.Fatal("a link speed for attention-TP rank 2 of a group of 2 was accepted")
	}
	if err := s.SetTPLinkSpeed(-1, 1, -1, 0.01); err != nil {
		t.Fatal(err)
	}
	rid, rm := s.Submit(RequestSpec{DecodePort: 17002, Transfer: 2 * time.Second, PromptTokens: 4096})
	run(s, c, 30*time.Second, 100*time.Millisecond)
	l := s.Listing(0)
	r, ok := room(l, rid)
	if !ok || r.Poll != pluginapi.PollSuccess || r.TransferInFlight == nil || !*r.TransferInFlight {
		t.Fatalf("listed %+v (%v), want the leader's Success with the other rank's chunk in flight", r, ok)
	}
	held := l.PeerTransferWorkers[0].TransferWorkers[*r.TransferQueue].InFlight
	if held == nil || held.BootstrapRoom != rm {
		t.Fatalf("tp1-cp0's worker holds %+v, want a chunk of room %d", held, rm)
	}
	run(s, c, 200*time.Second, time.Second)
	if rec := recordOf(t, s, rid); rec.Outcome == OutcomeInflight || rec.Outcome == OutcomeFailedForced {
		t.Fatalf("record %+v, want the request served once the slow rank's share landed", rec)
	}
}

// hungOnRanks submits a 4,096-token request to decode port 17002 whose
// handle hangs on the attention-TP ranks pins, runs the simulator for d,
// and returns its rid, its room and the leader's row of it (failing the
// test if it left the inflight queue).
func hungOnRanks(t *testing.T, s *Sim, c *clock.Fake, pins []int, d time.Duration) (string, uint64, pluginapi.Room) {
	t.Helper()
	rid, rm := s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, PinTPRanks: pins, DecodePort: 17002,
		Transfer: 2 * time.Second, PromptTokens: 4096})
	run(s, c, d, 100*time.Millisecond)
	r, ok := room(s.Listing(0), rid)
	if !ok {
		t.Fatalf("the room left the inflight queue while a rank still sends: %+v", recordOf(t, s, rid))
	}
	return rid, rm, r
}
