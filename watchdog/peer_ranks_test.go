package watchdog

import (
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Attention TP/CP > 1: the leader's share of a room is sent, and
// SGLang's MIN poll holds the room while another rank of the group sends
// its share. That rank's chunk is judged by its own worker and link, never
// by the stall rule (which would take a slow healthy chunk there for a
// stuck one) nor by the leader's link.

// peerCase is a TP2 leader whose worker is idle and measured at 64
// pages/s, and whose peer tp1-cp0 holds peerChunk on its queue 0,
// measured at peerSpeed pages/s (0: unmeasured); behind: room 1 has a
// chunk queued on that queue.
func peerCase(peerChunk *pluginapi.ChunkInFlight, peerSpeed float64, behind bool) *rankState {
	rk := progressCase(true, true, nil)
	peer := &workerState{tracked: true, inFlight: peerChunk, speed: peerSpeed, speedKnown: peerSpeed > 0}
	rk.peerWorkers = map[string]map[int]*workerState{"tp1-cp0": {0: peer}}
	rk.peerHeld, rk.peerBehind = map[uint64]string{}, map[uint64][]*workerState{}
	if peerChunk != nil {
		rk.peerHeld[peerChunk.BootstrapRoom] = "tp1-cp0/0/1;"
	}
	if behind {
		rk.peerBehind[1] = []*workerState{peer}
	}
	return rk
}

func TestPeerChunkJudgedByItsOwnRank(t *testing.T) {
	cfg := testConfig()
	cfg.LinkMargin = DefaultLinkMargin
	now := time.Unix(10000, 0)
	held := func(room uint64, seconds float64) *pluginapi.ChunkInFlight {
		return &pluginapi.ChunkInFlight{Chunk: 1, BootstrapRoom: room, Pages: 64, Seconds: seconds}
	}
	const slowLink = 64.0 / 50 // 64 pages in 50 s: 200 times that is 10000 s
	for _, tc := range []struct {
		name      string
		chunk     *pluginapi.ChunkInFlight
		peerSpeed float64
		inFlight  bool
		queued    int
		behind    bool
		age       float64
		want      bool
	}{
		// At the leader's speed (1 s) the same chunk would be overdue at 200 s.
		{"slow peer link, within its allowance", held(1, 5000), slowLink, true, 0, false, 6000, false},
		{"slow peer link, past its allowance", held(1, 10000), slowLink, true, 0, false, 11000, true},
		{"peer speed unknown, within twice the deadline", held(1, 119), 0, true, 0, false, 3000, false},
		{"peer speed unknown, past twice the deadline", held(1, 120), 0, true, 0, false, 3000, true},
		{"queued on the peer behind a live chunk", held(9, 5000), slowLink, false, 1, true, 6000, false},
		{"queued on the peer behind an overdue chunk", held(9, 10000), slowLink, false, 1, true, 11000, true},
		{"queued on the peer behind an overdue chunk, younger than the deadline", held(9, 10000), slowLink, false, 1, true, 59, false},
		{"queued on the peer, its queue not listed", held(9, 10000), slowLink, false, 1, false, 11000, false},
		{"held past its allowance on the peer, another chunk queued there behind a live one", held(1, 10000), slowLink, true, 1, false, 11000, true},
		{"in flight on a rank whose worker is not listed, within twice the deadline", nil, 0, true, 0, false, 119, false},
		{"in flight on a rank whose worker is not listed, past twice the deadline", nil, 0, true, 0, false, 120, true},
		{"nothing anywhere: the silent pin", nil, 0, false, 0, false, 61, true},
	} {
		rk := peerCase(tc.chunk, tc.peerSpeed, tc.behind)
		r := &roomState{age: tc.age, queue: 0, inFlightKnown: true, inFlight: tc.inFlight, peerChunksQueued: tc.queued,
			peerChunks: rk.peerHeld[1], lastChange: now.Add(-time.Hour), iterAtChange: 100}
		if got := roomStuck(1, r, rk, now, &cfg); got != tc.want {
			t.Errorf("%s: stuck %v, want %v", tc.name, got, tc.want)
		}
		// SGLang v0.5.18 NIXL drops the room's transfer info on the leader
		// once its share is sent: the leader lists no queue for it. The
		// verdict is the same wherever another rank has a share of it (a
		// room with nothing anywhere gets the untracked worker's twice the
		// deadline, TestProgressRoomStuck).
		if !tc.inFlight && tc.queued == 0 {
			continue
		}
		r.queue = unknownQueue
		if got := roomStuck(1, r, rk, now, &cfg); got != tc.want {
			t.Errorf("%s, the leader's queue unknown: stuck %v, want %v", tc.name, got, tc.want)
		}
	}
}

// tp2Rank is a TP2 leader plugin, every rank watched, each with one
// worker; the leader's is measured at 64 pages/s, the peer's at 64 pages
// in 50 s.
func tp2Rank() *fakePlugin {
	p := progressRank("http://127.0.0.1:28100", 1)
	p.seesEveryWriter(2, 2)
	p.measured(0, 8)
	p.peers = []pluginapi.PeerWorkers{{Rank: "tp1-cp0", TransferWorkers: []pluginapi.TransferWorker{
		{TransferQueue: 0, Tracked: true, Recent: samples(8, 64, 50)}}}}
	return p
}

// A healthy chunk on a slow non-leader link is never force-failed; the
// same chunk hung is, once past its allowance at that link's speed.
func TestSlowPeerChunkNeverForceFailed(t *testing.T) {
	p := tp2Rank()
	h := newMulti(t, []*fakePlugin{p}, nil)
	room := r4room("r", 1, 0, 0, 0)
	room.Poll, room.TransferInFlight, room.TransferQueue, room.PeerChunksQueued = pluginapi.PollSuccess, boolp(true), nil, intp(0)
	p.set(room)
	p.peers[0].TransferWorkers[0].InFlight = &pluginapi.ChunkInFlight{Chunk: 1, BootstrapRoom: 1, Pages: 64}
	h.tick(9000)
	if n := p.callCount(); n != 0 || len(h.eventsOf(EventStuck)) != 0 {
		t.Fatalf("force-fails %d, stuck events %v: the peer's chunk was within its allowance", n, h.eventsOf(EventStuck))
	}
	h.tick(1100)
	if got := calledRIDs(p); got["r"] != 1 {
		t.Fatalf("calls %v, want the room force-failed once the peer's chunk was past its allowance", got)
	}
}

// Rooms whose chunks wait on a non-leader rank behind its hung chunk are
// force-failed once that chunk is past its allowance at that rank's link
// speed, and not before: until then they wait their turn.
func TestRoomsBehindAPeerWedgeReleased(t *testing.T) {
	p := tp2Rank()
	h := newMulti(t, []*fakePlugin{p}, nil)
	hung := r4room("hung", 1, 0, 0, 0)
	hung.Poll, hung.TransferInFlight, hung.TransferQueue, hung.PeerChunksQueued = pluginapi.PollSuccess, boolp(true), nil, intp(0)
	behind := r4room("behind", 2, 0, 0, 0)
	behind.Poll, behind.TransferInFlight, behind.TransferQueue, behind.PeerChunksQueued = pluginapi.PollSuccess, boolp(false), nil, intp(1)
	p.set(hung, behind)
	// One page at 64 pages in 50 s: 200 times that is 156 s.
	tw := &p.peers[0].TransferWorkers[0]
	tw.InFlight = &pluginapi.ChunkInFlight{Chunk: 1, BootstrapRoom: 1, Pages: 1}
	tw.QueuedRooms = []uint64{2}
	h.tick(150)
	if n := p.callCount(); n != 0 {
		t.Fatalf("force-fails %d within the hung chunk's allowance, want none: %v", n, calledRIDs(p))
	}
	h.tick(20)
	if got := calledRIDs(p); got["hung"] != 1 || got["behind"] != 1 {
		t.Fatalf("calls %v, want the hung room and the room behind it force-failed once", got)
	}
}

// A room whose share on the leader was sent (Success) while another rank
// hangs on its own share is force-failed, even where the leader's queue it
// was listed on has a wedge order standing: the order fails the rooms
// behind the leader's wedge, and leaves a Success room alone (the plugin
// answers for it only to a force-fail, which pulls the levers while
// another rank still sends).
func TestPeerHungRoomNotLeftToALeaderWedgeOrder(t *testing.T) {
	p := tp2Rank()
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) { c.FailFast, c.FailFastPerMinute = true, 100 })
	peerHung := r4room("peer-hung", 2, 0, 0, 0)
	peerHung.Poll, peerHung.TransferInFlight, peerHung.PeerChunksQueued = pluginapi.PollSuccess, boolp(true), intp(0)
	p.set(r4room("head", 1, 0, 0, 0), peerHung)
	// The leader's worker hangs on head (one page at 64 pages/s: overdue at
	// the deadline); rank 1's on peer-hung (one page at 64 pages in 50 s:
	// 156 s).
	p.hold(0, 5, 1, 1, 0)
	p.peers[0].TransferWorkers[0].InFlight = &pluginapi.ChunkInFlight{Chunk: 1, BootstrapRoom: 2, Pages: 1}
	h.tick(150)
	if p.orderCount() == 0 || holds(p, "head") {
		t.Fatalf("orders %d, head held %v: want the leader's wedge ordered and head failed by it", p.orderCount(), holds(p, "head"))
	}
	if got := calledRIDs(p); got["peer-hung"] != 0 {
		t.Fatalf("calls %v within rank 1's allowance", got)
	}
	h.tick(20)
	if got := calledRIDs(p); got["peer-hung"] != 1 {
		t.Fatalf("calls %v, want peer-hung force-failed once past rank 1's allowance, not left to the order", got)
	}
}
