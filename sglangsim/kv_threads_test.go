package sglangsim

import (
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// threadOf is the listing's kv_threads entry of queue qi's transfer worker.
func threadOf(t *testing.T, l pluginapi.Listing, qi int) pluginapi.KVThread {
	t.Helper()
	for _, th := range l.KVThreads {
		if th.Role == pluginapi.ThreadTransferWorker && th.TransferQueue != nil && *th.TransferQueue == qi {
			return th
		}
	}
	t.Fatalf("no transfer worker of queue %d in kv_threads %+v", qi, l.KVThreads)
	return pluginapi.KVThread{}
}

// TestKillTransferWorker: a worker killed while it holds a chunk lets go of
// it as it settles and dies; the room's later chunks and every room behind
// it on that queue are never sent (nothing in flight, chunks queued), while
// the other queues serve as usual. A restart brings the worker back.
func TestKillTransferWorker(t *testing.T) {
	s, c := newSim(t, Options{})
	l := s.Listing(0)
	if len(l.KVThreads) != 1+TransferQueues || l.KVThreads[0] != (pluginapi.KVThread{Role: pluginapi.ThreadBootstrap, Function: "bootstrap_thread", Alive: true}) {
		t.Fatalf("kv_threads %+v, want the bootstrap thread and %d live transfer workers", l.KVThreads, TransferQueues)
	}
	for qi := range TransferQueues {
		if !threadOf(t, l, qi).Alive {
			t.Fatalf("worker %d dead from the start", qi)
		}
	}
	// Queue 1: four chunks of 245 ms; queue 2: another room.
	head, _ := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 4000, Transfer: time.Second, Chunks: 4})
	behind, _ := s.Submit(RequestSpec{DecodePort: 17005, Transfer: time.Second})
	other, _ := s.Submit(RequestSpec{DecodePort: 17002, Transfer: time.Second})
	s.Step()
	c.Advance(100 * time.Millisecond)
	s.Step()
	if err := s.KillTransferWorker(0, 1); err != nil {
		t.Fatal(err)
	}
	if !threadOf(t, s.Listing(0), 1).Alive {
		t.Fatal("the worker died holding its chunk; it dies as it lets go of it")
	}
	run(s, c, time.Minute, 100*time.Millisecond)
	l = s.Listing(0)
	if threadOf(t, l, 1).Alive || !threadOf(t, l, 0).Alive || !threadOf(t, l, 2).Alive {
		t.Fatalf("kv_threads %+v, want worker 1 dead alone", l.KVThreads)
	}
	w := workerOf(t, l, 1)
	if w.InFlight != nil || w.ChunksTaken != 1 || w.Depth <= 3 {
		t.Fatalf("dead worker %+v, want its first chunk taken and nothing after", w)
	}
	for _, rid := range []string{head, behind} {
		r := mustRoom(t, l, rid)
		if r.Poll != pluginapi.PollWaitingForInput && r.Poll != pluginapi.PollTransferring || r.TransferInFlight == nil || *r.TransferInFlight ||
			r.ChunksQueued == nil || *r.ChunksQueued == 0 {
			t.Fatalf("room %s on the dead queue: %+v", rid, r)
		}
		if k := recordOf(t, s, rid).Kind; k != KindBlockedByWedge {
			t.Fatalf("room %s recorded %s", rid, k)
		}
	}
	if _, ok := room(l, other); ok {
		t.Fatal("the room on a live queue did not complete")
	}
	if err := s.KillTransferWorker(0, TransferQueues); err == nil {
		t.Fatal("killed a worker of a queue that does not exist")
	}
	s.Restart()
	run(s, c, time.Minute, 100*time.Millisecond)
	if !threadOf(t, s.Listing(0), 1).Alive {
		t.Fatal("the restarted server's worker of queue 1 is dead")
	}
	done, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: time.Second})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	if _, ok := room(s.Listing(0), done); ok {
		t.Fatal("queue 1 does not serve after the restart")
	}
}

// Decode lists its listener and heartbeat checker; the parity scene,
// whose stand-in starts no threads, and a plugin older than round 4 list
// none.
func TestKVThreadsListed(t *testing.T) {
	s, _ := newSim(t, Options{DecodeDPSize: 1})
	if th := s.DecodeListing(0).KVThreads; len(th) != 2 || th[0].Role != pluginapi.ThreadDecodeListener || th[1].Role != pluginapi.ThreadHeartbeat || !th[0].Alive || !th[1].Alive {
		t.Fatalf("decode kv_threads %+v", th)
	}
	old, _ := newSim(t, Options{PreRound4Plugin: true})
	if th := old.Listing(0).KVThreads; th != nil {
		t.Fatalf("a pre-round-4 plugin lists kv_threads %+v", th)
	}
	p, _ := newSim(t, Options{})
	if err := p.SetScenario(ScenarioParity); err != nil {
		t.Fatal(err)
	}
	if th := p.Listing(0).KVThreads; th != nil {
		t.Fatalf("the parity scene lists kv_threads %+v", th)
	}
}
