package sglangsim

import (
	"bytes"
	"encoding/json"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// workerOf is queue qi's entry of the listing's transfer_workers.
func workerOf(t *testing.T, l pluginapi.Listing, qi int) pluginapi.TransferWorker {
	t.Helper()
	if l.Server.TransferProgress == nil || !*l.Server.TransferProgress || len(l.TransferWorkers) != TransferQueues {
		t.Fatalf("no transfer progress: %+v, %d workers", l.Server.TransferProgress, len(l.TransferWorkers))
	}
	w := l.TransferWorkers[qi]
	if w.TransferQueue != qi || !w.Tracked {
		t.Fatalf("worker %d: %+v", qi, w)
	}
	return w
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

// TestTransferWorkerChunkByChunk: the worker holds one chunk at a time,
// in_flight names it with its pages, the time held and its link, recent
// and finished list the finished ones oldest first (finished with the
// number in_flight gave each and its link), and chunks_queued, depth and
// chunks_taken count what is left and what was taken.
func TestTransferWorkerChunkByChunk(t *testing.T) {
	s, c := newSim(t, Options{})
	// Queue 1 (decode port 17001). 1 s planned: 20 ms pickup, then four
	// chunks of 245 ms; the first one includes the pickup.
	rid, rm := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 4000, Transfer: time.Second, Chunks: 4})
	s.Step() // into the inflight queue at t0
	c.Advance(100 * time.Millisecond)
	s.Step()
	l := s.Listing(0)
	w := workerOf(t, l, 1)
	link := DestinationName(BackendNIXL, 17001)
	if w.InFlight == nil || *w.InFlight != (pluginapi.ChunkInFlight{Chunk: 1, BootstrapRoom: rm, Pages: 1000, Seconds: 0.1, Link: link}) ||
		w.ChunksTaken != 1 || w.Depth != 3 || len(w.Recent) != 0 {
		t.Fatalf("first chunk: %+v in flight %+v", w, w.InFlight)
	}
	if rq := mustRoom(t, l, rid); rq.ChunksQueued == nil || *rq.ChunksQueued != 3 {
		t.Fatalf("room: %+v", rq)
	}
	c.Advance(200 * time.Millisecond) // 300 ms: chunk 0 ended at 265 ms
	s.Step()
	w = workerOf(t, s.Listing(0), 1)
	if w.InFlight == nil || w.InFlight.Chunk != 2 || !near(w.InFlight.Seconds, 0.035) || w.Depth != 2 ||
		len(w.Recent) != 1 || w.Recent[0] != [2]float64{1000, 0.265} {
		t.Fatalf("second chunk: %+v in flight %+v", w, w.InFlight)
	}
	c.Advance(500 * time.Millisecond) // 800 ms: the last chunk (755 ms on)
	s.Step()
	w = workerOf(t, s.Listing(0), 1)
	if w.InFlight == nil || w.InFlight.Chunk != 4 || !w.InFlight.LastChunk || w.Depth != 0 {
		t.Fatalf("last chunk: %+v in flight %+v", w, w.InFlight)
	}
	c.Advance(300 * time.Millisecond)
	s.Step()
	l = s.Listing(0)
	w = workerOf(t, l, 1)
	want := [][2]float64{{1000, 0.265}, {1000, 0.245}, {1000, 0.245}, {1000, 0.245}}
	if w.InFlight != nil || w.ChunksTaken != 4 || len(w.Recent) != 4 {
		t.Fatalf("after the transfer: %+v", w)
	}
	if len(w.Finished) != len(want) {
		t.Fatalf("finished = %+v, want %d chunks", w.Finished, len(want))
	}
	for i := range want {
		if !near(w.Recent[i][0], want[i][0]) || !near(w.Recent[i][1], want[i][1]) {
			t.Fatalf("recent = %v, want %v", w.Recent, want)
		}
		f := w.Finished[i]
		if f.Chunk != int64(i+1) || f.Pages != int(want[i][0]) || !near(f.Seconds, want[i][1]) || f.Link != link {
			t.Fatalf("finished[%d] = %+v, want chunk %d, %v on %s", i, f, i+1, want[i], link)
		}
	}
	if _, ok := room(l, rid); ok || recordOf(t, s, rid).Outcome != OutcomeSuccess {
		t.Fatal("the room did not succeed")
	}
	// Other queues never moved.
	for _, qi := range []int{0, 2, 3} {
		if w := workerOf(t, l, qi); w.ChunksTaken != 0 || w.InFlight != nil || w.Depth != 0 {
			t.Fatalf("worker %d: %+v", qi, w)
		}
	}
}

// TestDestinationSpeed: a link is a destination, not a queue. Decode
// ports 17001 and 17005 share queue 1; with 17005 at 10%, its room takes
// ten times as long over the same worker as the room to 17001, and
// finished names each chunk's link. SetLinkSpeed on the queue then sets
// every destination on it, 17005's own speed included. Mooncake names a
// destination by its session id.
func TestDestinationSpeed(t *testing.T) {
	s, c := newSim(t, Options{})
	if err := s.SetDestinationSpeed(0, -1, 17005, 0.1); err != nil {
		t.Fatal(err)
	}
	slow, _ := s.Submit(RequestSpec{DecodePort: 17005, PromptTokens: 2000, Transfer: time.Second, Chunks: 2})
	fast, _ := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 2000, Transfer: time.Second, Chunks: 2})
	run(s, c, 12*time.Second, 100*time.Millisecond)
	for _, rid := range []string{slow, fast} {
		if rec := recordOf(t, s, rid); rec.Outcome != OutcomeSuccess || rec.TransferQueue != 1 {
			t.Fatalf("%+v, want a success on queue 1", rec)
		}
	}
	w := workerOf(t, s.Listing(0), 1)
	took := map[string]float64{}
	for _, f := range w.Finished {
		took[f.Link] += f.Seconds
	}
	slowLink, fastLink := DestinationName(BackendNIXL, 17005), DestinationName(BackendNIXL, 17001)
	if len(w.Finished) != 4 || len(took) != 2 || !near(took[slowLink], 10*took[fastLink]) {
		t.Fatalf("finished %+v: seconds by link %v, want 17005's ten times 17001's", w.Finished, took)
	}
	if err := s.SetLinkSpeed(0, 1, 1); err != nil {
		t.Fatal(err)
	}
	again, _ := s.Submit(RequestSpec{DecodePort: 17005, PromptTokens: 2000, Transfer: time.Second, Chunks: 2})
	run(s, c, 2*time.Second, 100*time.Millisecond)
	if rec := recordOf(t, s, again); rec.Outcome != OutcomeSuccess {
		t.Fatalf("%+v: 17005 still slow after its queue was set to full speed", rec)
	}
	if s.SetDestinationSpeed(0, -1, 0, 1) == nil || s.SetDestinationSpeed(0, -1, 70000, 1) == nil ||
		s.SetDestinationSpeed(1, -1, 17005, 1) == nil || s.SetDestinationSpeed(0, -1, 17005, -1) == nil {
		t.Fatal("a port, rank or speed out of range was accepted")
	}

	m, mc := newSim(t, Options{Backend: BackendMooncake})
	mrid, _ := m.Submit(RequestSpec{DecodePort: 17002, PromptTokens: 2000, Transfer: 10 * time.Second, Chunks: 2})
	run(m, mc, time.Second, 100*time.Millisecond)
	if in := workerOf(t, m.Listing(0), recordOf(t, m, mrid).TransferQueue).InFlight; in == nil || in.Link != "127.0.0.1:17002" {
		t.Fatalf("Mooncake in flight %+v, want link 127.0.0.1:17002", in)
	}
}

// TestLinkSpeed: a queue's link at 10% takes ten times as long per chunk,
// from the moment the speed changes; the other queues keep their speed;
// recent keeps the 32 newest chunks.
func TestLinkSpeed(t *testing.T) {
	s, c := newSim(t, Options{})
	slow, _ := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 2000, Transfer: 1020 * time.Millisecond, Chunks: 2})
	fast, _ := s.Submit(RequestSpec{DecodePort: 17002, PromptTokens: 2000, Transfer: 1020 * time.Millisecond, Chunks: 2})
	s.Step()
	c.Advance(270 * time.Millisecond) // chunk 0 of each: 20 + 250 of its 520 ms
	if err := s.SetLinkSpeed(0, 1, 0.1); err != nil {
		t.Fatal(err)
	}
	run(s, c, 1300*time.Millisecond, 100*time.Millisecond)
	if recordOf(t, s, fast).Outcome != OutcomeSuccess {
		t.Fatal("the room on the fast link did not complete in time")
	}
	w := workerOf(t, s.Listing(0), 1)
	if _, ok := room(s.Listing(0), slow); !ok || w.InFlight == nil || w.InFlight.Chunk != 1 || len(w.Recent) != 0 {
		t.Fatalf("slow link after 1.57 s: %+v", w)
	}
	// Chunk 0 (20.4 ms pickup and 499.8 ms): 270 ms at full speed, the
	// remaining 250.2 ms of work at 10%.
	run(s, c, 2*time.Second, 100*time.Millisecond)
	w = workerOf(t, s.Listing(0), 1)
	if len(w.Recent) != 1 || !near(w.Recent[0][1], 2.772) {
		t.Fatalf("slow link, first chunk: %+v", w)
	}
	if err := s.SetLinkSpeed(-1, -1, 1); err != nil {
		t.Fatal(err)
	}
	run(s, c, time.Second, 100*time.Millisecond)
	if recordOf(t, s, slow).Outcome != OutcomeSuccess {
		t.Fatal("the room on the restored link did not complete")
	}
	for _, bad := range []float64{-1, math.NaN(), math.Inf(1)} {
		if s.SetLinkSpeed(0, 0, bad) == nil {
			t.Fatalf("speed %v accepted", bad)
		}
	}
	if s.SetLinkSpeed(0, TransferQueues, 1) == nil {
		t.Fatal("queue out of range accepted")
	}
	// 40 rooms of 1 chunk: recent keeps the last 32, oldest first.
	for i := range 40 {
		s.Submit(RequestSpec{DecodePort: 17003, PromptTokens: 100 + i, Transfer: 10 * time.Millisecond, Chunks: 1})
	}
	run(s, c, 2*time.Second, 100*time.Millisecond)
	w = workerOf(t, s.Listing(0), 3)
	if w.ChunksTaken != 40 || len(w.Recent) != recentChunks || w.Recent[0][0] != 108 || w.Recent[31][0] != 139 {
		t.Fatalf("recent of 40 chunks: taken %d, %v", w.ChunksTaken, w.Recent)
	}
}

// TestSkippedChunksAndStuckHandle: the chunks of a room failed while it
// waits stay queued until the worker reaches them, then are skipped at
// once (counted, short); a stuck handle holds its chunk for ever with
// chunks_taken still.
func TestSkippedChunksAndStuckHandle(t *testing.T) {
	s, c := newSim(t, Options{Token: "t"})
	head, _ := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 2000, Transfer: 5 * time.Second, Chunks: 2})
	behind, _ := s.Submit(RequestSpec{DecodePort: 17005, PromptTokens: 3000, Transfer: time.Second, Chunks: 3})
	run(s, c, time.Second, 100*time.Millisecond)
	if rq := mustRoom(t, s.Listing(0), behind); *rq.ChunksQueued != 3 || rq.Poll != pluginapi.PollWaitingForInput {
		t.Fatalf("behind: %+v", rq)
	}
	flip(t, s, 0, behind)
	run(s, c, time.Second, 100*time.Millisecond)
	w := workerOf(t, s.Listing(0), 1)
	if w.Depth != 4 || w.ChunksTaken != 1 { // head's second chunk and behind's three
		t.Fatalf("released room's chunks left the queue early: %+v", w)
	}
	run(s, c, 5*time.Second, 100*time.Millisecond)
	w = workerOf(t, s.Listing(0), 1)
	if recordOf(t, s, head).Outcome != OutcomeSuccess || w.ChunksTaken != 5 || w.InFlight != nil || len(w.Recent) != 5 {
		t.Fatalf("after the head: %+v", w)
	}
	for _, r := range w.Recent[2:] {
		if r != [2]float64{1000, 0} {
			t.Fatalf("skipped chunks: %v", w.Recent)
		}
	}

	// A stuck handle on its second chunk: the rooms behind pile up.
	pin, pinRoom := s.Submit(RequestSpec{DecodePort: 17001, Behavior: BehaviorPinStuckHandle, PromptTokens: 3000, Transfer: 3 * time.Second, Chunks: 3, FreezeAt: 1})
	s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 1000, Transfer: time.Second, Chunks: 2})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	w = workerOf(t, s.Listing(0), 1)
	if w.InFlight == nil || w.InFlight.Chunk != 7 || w.InFlight.BootstrapRoom != pinRoom || w.InFlight.Pages != 1000 ||
		w.InFlight.Seconds < 8 || w.Depth != 3 {
		t.Fatalf("wedged worker: %+v in flight %+v", w, w.InFlight)
	}
	// Released, the pin's chunk stays in the worker's hands (an orphan).
	flip(t, s, 0, pin)
	run(s, c, time.Minute, time.Second)
	w = workerOf(t, s.Listing(0), 1)
	if w.InFlight == nil || w.InFlight.Chunk != 7 || w.ChunksTaken != 7 || w.InFlight.Seconds < 68 {
		t.Fatalf("wedge after the release: %+v", w)
	}
}

// TestPreRound4Listing: the older plugin lists none of round 4's fields
// and has no wedge-order path.
func TestPreRound4Listing(t *testing.T) {
	s, c := newSim(t, Options{PreRound4Plugin: true, Token: "t"})
	rid, _ := s.Submit(RequestSpec{PromptTokens: 1000, Transfer: 10 * time.Second})
	run(s, c, time.Second, 100*time.Millisecond)
	l := s.Listing(0)
	if l.Server.TransferProgress != nil || l.TransferWorkers != nil || l.WedgeOrders != nil || mustRoom(t, l, rid).ChunksQueued != nil {
		t.Fatalf("pre-round-4 listing: %+v", l)
	}
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(b, []byte(`"transfer_workers":null`)) || bytes.Contains(b, []byte("transfer_progress")) {
		t.Fatalf("wire form: %s", b)
	}
	rec := httptest.NewRecorder()
	s.PluginHandler(0).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, pluginapi.PathWedgeOrder,
		strings.NewReader(`{"transfer_queue":0,"chunk":1,"ttl_seconds":5}`)))
	if rec.Code != 404 {
		t.Fatalf("older plugin: %d %s", rec.Code, rec.Body)
	}
	// Mid-2025 NIXL: a round-4 plugin with nothing to watch.
	s2, _ := newSim(t, Options{LeverEra: LeversNIXLMid2025})
	l = s2.Listing(0)
	if l.Server.TransferProgress == nil || *l.Server.TransferProgress || l.TransferWorkers != nil || l.WedgeOrders == nil {
		t.Fatalf("mid-2025 NIXL listing: %+v", l)
	}
}

// wedgeScene is a stuck handle on queue 1 of rank 0 with rooms behind it:
// one old enough, one young, one on another queue, a health check.
type wedgeScene struct {
	s                  *Sim
	c                  *clock.Fake
	pin, old, young    string
	otherQueue, hc     string
	chunk              int64
	pinRoom, youngRoom uint64
}

func newWedgeScene(t *testing.T, o Options) *wedgeScene {
	t.Helper()
	o.Token = "t"
	s, c := newSim(t, o)
	w := &wedgeScene{s: s, c: c}
	w.pin, w.pinRoom = s.Submit(RequestSpec{DecodePort: 17001, Behavior: BehaviorPinStuckHandle, PromptTokens: 2000, Transfer: time.Second, Chunks: 2})
	w.old, _ = s.Submit(RequestSpec{DecodePort: 17005, PromptTokens: 1000, Transfer: time.Second})
	w.hc, _ = s.Submit(RequestSpec{Behavior: BehaviorStuckHealthCheck})
	w.otherQueue, _ = s.Submit(RequestSpec{DecodePort: 17002, PromptTokens: 1000, Transfer: time.Hour})
	run(s, c, 30*time.Second, 100*time.Millisecond)
	w.young, w.youngRoom = s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 1000, Transfer: time.Second})
	run(s, c, time.Second, 100*time.Millisecond)
	tw := workerOf(t, s.Listing(0), 1)
	if tw.InFlight == nil || tw.InFlight.BootstrapRoom != w.pinRoom {
		t.Fatalf("no wedge: %+v", tw)
	}
	w.chunk = tw.InFlight.Chunk
	return w
}

func (w *wedgeScene) order(req pluginapi.WedgeOrderRequest) (int, pluginapi.WedgeOrderResponse) {
	return w.s.WedgeOrder(0, req, "Bearer t")
}

func rids(rooms []pluginapi.FailedRoom) []string {
	out := []string{}
	for _, r := range rooms {
		out = append(out, r.RID)
	}
	return out
}

// TestWedgeOrderRefusals: the answers that stand nothing (table).
func TestWedgeOrderRefusals(t *testing.T) {
	w := newWedgeScene(t, Options{})
	ok := pluginapi.WedgeOrderRequest{TransferQueue: 1, Chunk: w.chunk, TTLSeconds: 10}
	with := func(f func(*pluginapi.WedgeOrderRequest)) pluginapi.WedgeOrderRequest {
		r := ok
		f(&r)
		return r
	}
	for _, tc := range []struct {
		name   string
		req    pluginapi.WedgeOrderRequest
		auth   string
		status int
		result string
	}{
		{"no token", ok, "", 401, pluginapi.ResultUnauthorized},
		{"ttl 0", with(func(r *pluginapi.WedgeOrderRequest) { r.TTLSeconds = 0 }), "Bearer t", 400, pluginapi.ResultBadRequest},
		{"ttl 301", with(func(r *pluginapi.WedgeOrderRequest) { r.TTLSeconds = 301 }), "Bearer t", 400, pluginapi.ResultBadRequest},
		{"negative min age", with(func(r *pluginapi.WedgeOrderRequest) { r.MinAgeSeconds = -1 }), "Bearer t", 400, pluginapi.ResultBadRequest},
		{"negative chunk", with(func(r *pluginapi.WedgeOrderRequest) { r.Chunk = -1 }), "Bearer t", 400, pluginapi.ResultBadRequest},
		{"no such queue", with(func(r *pluginapi.WedgeOrderRequest) { r.TransferQueue = TransferQueues }), "Bearer t", 404, pluginapi.ResultNotFound},
		{"another chunk", with(func(r *pluginapi.WedgeOrderRequest) { r.Chunk = w.chunk - 1 }), "Bearer t", 409, pluginapi.ResultWedgeCleared},
		{"idle worker", with(func(r *pluginapi.WedgeOrderRequest) { r.TransferQueue = 3 }), "Bearer t", 409, pluginapi.ResultWedgeCleared},
	} {
		st, resp := w.s.WedgeOrder(0, tc.req, tc.auth)
		if st != tc.status || resp.Result != tc.result || resp.Failed == nil || len(resp.Failed) != 0 {
			t.Errorf("%s: %d %+v, want %d %s", tc.name, st, resp, tc.status, tc.result)
		}
	}
	if l := w.s.Listing(0); len(l.WedgeOrders) != 0 || len(mustRoom(t, l, w.old).Poll) == 0 || recordOf(t, w.s, w.old).ForcedAt != (time.Time{}) {
		t.Fatalf("a refused order stood or failed something: %+v", l.WedgeOrders)
	}
	for _, tc := range []struct {
		o    Options
		note bool
	}{{Options{LeverEra: LeversNIXLMid2025}, false}, {Options{LeverEra: LeversEarly}, true}} {
		s, _ := newSim(t, tc.o)
		st, resp := s.WedgeOrder(0, ok, "")
		if st != 501 || resp.Result != pluginapi.ResultUnsupported || (resp.LeverNote != "") != tc.note {
			t.Errorf("%s: %d %+v", tc.o.LeverEra, st, resp)
		}
	}
}

// TestWedgeOrderLifecycle: a dry run lists without failing; an order
// fails the queue's rooms old enough from the next pass on (its first
// answer lists none, as the plugin's) and the young one once it is old
// enough, each reported once by the next call; it spares health checks
// and other queues; it lapses without renewal and is void once the worker
// takes another chunk.
func TestWedgeOrderLifecycle(t *testing.T) {
	w := newWedgeScene(t, Options{})
	s := w.s
	req := pluginapi.WedgeOrderRequest{TransferQueue: 1, Chunk: w.chunk, TTLSeconds: 5, MinAgeSeconds: 10, Reason: "test"}
	dry := req
	dry.DryRun = true
	st, resp := w.order(dry)
	if st != 200 || resp.Result != pluginapi.ResultWouldOrder || strings.Join(rids(resp.Failed), ",") != w.pin+","+w.old {
		t.Fatalf("dry run: %d %+v", st, resp)
	}
	if l := s.Listing(0); len(l.WedgeOrders) != 0 || !recordOf(t, s, w.pin).ForcedAt.IsZero() {
		t.Fatal("a dry run stood or failed")
	}
	st, resp = w.order(req)
	if st != 200 || resp.Result != pluginapi.ResultOrdered || resp.ExpiresInSeconds != 5 || len(resp.Failed) != 0 {
		t.Fatalf("order: %d %+v", st, resp)
	}
	if !recordOf(t, s, w.pin).ForcedAt.IsZero() {
		t.Fatal("the order failed a room before the next pass")
	}
	// Released on the next pass; the young room, 1 s old, waits.
	run(s, w.c, 2*time.Second, 100*time.Millisecond)
	l := s.Listing(0)
	for _, rid := range []string{w.pin, w.old} {
		if r := recordOf(t, s, rid); r.Outcome != OutcomeFailedForced || !r.WedgeOrdered {
			t.Fatalf("%s: %+v", rid, r)
		}
	}
	if len(l.WedgeOrders) != 1 || l.WedgeOrders[0].Chunk != w.chunk || l.WedgeOrders[0].RoomsFailed != 2 ||
		!near(l.WedgeOrders[0].ExpiresInSeconds, 3) {
		t.Fatalf("standing orders: %+v", l.WedgeOrders)
	}
	st, resp = w.order(req) // renewed: the two the passes failed
	if st != 200 || strings.Join(rids(resp.Failed), ",") != w.pin+","+w.old || len(resp.Failed[0].Levers) != 2 {
		t.Fatalf("renewal: %d %+v", st, resp)
	}
	if st, resp = w.order(req); st != 200 || len(resp.Failed) != 0 { // nothing failed since
		t.Fatalf("second renewal: %d %+v", st, resp)
	}
	// Renewed every 2 s, the order fails the young room once 10 s old, at
	// a pass; the next call reports it.
	for range 4 {
		run(s, w.c, 2*time.Second, 100*time.Millisecond)
		st, resp = w.order(req)
		if len(resp.Failed) > 0 {
			break
		}
	}
	if st != 200 || strings.Join(rids(resp.Failed), ",") != w.young || resp.Failed[0].BootstrapRoom != w.youngRoom {
		t.Fatalf("young room: %d %+v", st, resp)
	}
	if r := recordOf(t, s, w.young); !r.WedgeOrdered || r.ForcedAt.Sub(r.EnteredInflight) < 10*time.Second ||
		r.ForcedAt.Sub(r.EnteredInflight) > 10*time.Second+100*time.Millisecond {
		t.Fatalf("young room failed at age %v", r.ForcedAt.Sub(r.EnteredInflight))
	}
	for _, rid := range []string{w.otherQueue, w.hc} {
		if r := recordOf(t, s, rid); !r.ForcedAt.IsZero() {
			t.Fatalf("%s failed: %+v", rid, r)
		}
	}
	// Not renewed: it lapses after its ttl, and a later room stays.
	run(s, w.c, 6*time.Second, 100*time.Millisecond)
	late, _ := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 1000, Transfer: time.Second})
	run(s, w.c, 20*time.Second, 100*time.Millisecond)
	if l := s.Listing(0); len(l.WedgeOrders) != 0 || !recordOf(t, s, late).ForcedAt.IsZero() {
		t.Fatalf("the order outlived its ttl: %+v", l.WedgeOrders)
	}
	// A fresh order with min age 0 fails the late room at the next pass.
	req.MinAgeSeconds = 0
	if st, resp = w.order(req); st != 200 || len(resp.Failed) != 0 {
		t.Fatalf("fresh order: %d %+v", st, resp)
	}
	run(s, w.c, 200*time.Millisecond, 100*time.Millisecond)
	if st, resp = w.order(req); st != 200 || strings.Join(rids(resp.Failed), ",") != late {
		t.Fatalf("fresh order, renewed: %d %+v", st, resp)
	}
}

// TestWedgeOrderVoidWhenTheChunkSettles: an order on a slow chunk that
// was not stuck after all is void the moment the worker takes another
// chunk; the call then answers wedge_cleared and rooms are left alone.
func TestWedgeOrderVoidWhenTheChunkSettles(t *testing.T) {
	s, c := newSim(t, Options{Token: "t"})
	slow, _ := s.Submit(RequestSpec{DecodePort: 17001, PromptTokens: 2000, Transfer: 20 * time.Second, Chunks: 2})
	run(s, c, 5*time.Second, 100*time.Millisecond)
	tw := workerOf(t, s.Listing(0), 1)
	req := pluginapi.WedgeOrderRequest{TransferQueue: 1, Chunk: tw.InFlight.Chunk, TTLSeconds: 60, MinAgeSeconds: 30}
	if st, resp := s.WedgeOrder(0, req, "Bearer t"); st != 200 || resp.Result != pluginapi.ResultOrdered || len(resp.Failed) != 0 {
		t.Fatalf("order: %d %+v", st, resp)
	}
	run(s, c, 6*time.Second, 100*time.Millisecond) // the first chunk ends at 10.2 s
	if l := s.Listing(0); len(l.WedgeOrders) != 0 {
		t.Fatalf("the order outlived its chunk: %+v", l.WedgeOrders)
	}
	if st, resp := s.WedgeOrder(0, req, "Bearer t"); st != 409 || resp.Result != pluginapi.ResultWedgeCleared {
		t.Fatalf("after the chunk: %d %+v", st, resp)
	}
	run(s, c, 30*time.Second, 100*time.Millisecond)
	if r := recordOf(t, s, slow); r.Outcome != OutcomeSuccess {
		t.Fatalf("the slow room: %+v", r)
	}
}

// TestWedgeOrderHTTP: the body rules name the field; the path answers as
// WedgeOrder does.
func TestWedgeOrderHTTP(t *testing.T) {
	w := newWedgeScene(t, Options{})
	h := w.s.PluginHandler(0)
	post := func(body, auth string) (int, pluginapi.WedgeOrderResponse) {
		req := httptest.NewRequest(http.MethodPost, pluginapi.PathWedgeOrder, strings.NewReader(body))
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		var resp pluginapi.WedgeOrderResponse
		if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
			t.Fatalf("%s: %v: %s", body, err, rec.Body)
		}
		return rec.Code, resp
	}
	for body, field := range map[string]string{
		`{"chunk":1,"ttl_seconds":5}`:                                         "transfer_queue",
		`{"transfer_queue":1.5,"chunk":1,"ttl_seconds":5}`:                    "transfer_queue",
		`{"transfer_queue":1,"ttl_seconds":5}`:                                "chunk",
		`{"transfer_queue":1,"chunk":1}`:                                      "ttl_seconds",
		`{"transfer_queue":1,"chunk":1,"ttl_seconds":"5"}`:                    "ttl_seconds",
		`{"transfer_queue":1,"chunk":1,"ttl_seconds":5,"min_age_seconds":-2}`: "min_age_seconds",
		`{"transfer_queue":1,"chunk":1,"ttl_seconds":5,"dry_run":1}`:          "dry_run",
		`{"transfer_queue":1,"chunk":1,"ttl_seconds":5,"reason":3}`:           "reason",
		`[1]`: "JSON object",
	} {
		st, resp := post(body, "Bearer t")
		if st != 400 || resp.Result != pluginapi.ResultBadRequest || !strings.Contains(resp.Error, field) {
			t.Errorf("%s: %d %+v, want 400 naming %s", body, st, resp, field)
		}
	}
	if st, _ := post(`{}`, ""); st != 401 {
		t.Fatalf("no token: %d", st)
	}
	body := `{"transfer_queue":1,"chunk":` + strconv.FormatInt(w.chunk, 10) + `,"ttl_seconds":5,"dry_run":true}`
	if st, resp := post(body, "Bearer t"); st != 200 || resp.Result != pluginapi.ResultWouldOrder || len(resp.Failed) != 3 {
		t.Fatalf("dry run: %d %+v", st, resp)
	}
}
