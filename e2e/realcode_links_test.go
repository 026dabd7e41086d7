package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Issue 23's mixed scenes on SGLang's own prefill code: the watchdog
// binary in auto mode (restarts in dry-run, so that a wrong one is
// counted, not carried out) against the real-code server with several
// decode destinations per prefill rank, each SGLang's own decode KV manager
// (its own NIXL agent, or Mooncake session) with its own link speed, which
// the fake transports time every KV transfer by. Every link is judged by
// what it has shown; a link slower than another must never be condemned by
// the other's pace, nor a stuck handle on a fast link be left to a slow
// link's.
//
// The clock is compressed: a 3 s deadline, a 1 s stall window and a link
// margin of 20 stand for the shipped 60 s, 30 s and 200. Requests have 4 KV
// pages; link speeds are in seconds per page.
const (
	linksDeadline = 3 * time.Second
	linksStall    = time.Second
	linksMargin   = 20.0
	// linkFast is 100%: a 4-page chunk in 0.04 s; linkTenth 10% (0.4 s),
	// linkHundredth 1% (4 s).
	linkFast      = 0.01
	linkTenth     = 0.1
	linkHundredth = 1.0
	// linksSlack is what a release may take past its bound: the 3 s of
	// issue 23 (a few watch cycles, the confirmation) plus the 100 ms the
	// scene samples SGLang's state at.
	linksSlack = 3*time.Second + 100*time.Millisecond
)

// TestRealCodeLinks plays issue 23's mixed scenes on v0.5.18 (NIXL,
// Mooncake) and v0.5.11 (Mooncake), each on a server of its own and all
// at once: the issue's own scene with five and with nine healthy requests
// on the fast link before the stuck one, three links of 100%, 10% and 1%
// on one rank with a queue two of them share, a link that slows down within
// the margin and recovers, one that appears after the others were measured,
// stuck handles on the fastest link and on a slower one, and (v0.5.18) a
// TP2 prefill whose ranks send over links of different speeds.
func TestRealCodeLinks(t *testing.T) {
	if testing.Short() {
		t.Skip("starts SGLang's own code")
	}
	for _, c := range matrixReleases {
		src := sglangSource(t, c.release)
		t.Run(c.release+"/"+c.backend, func(t *testing.T) {
			t.Parallel()
			t.Run("issue-5", func(t *testing.T) {
				t.Parallel()
				linksIssueScene(t, src, c.backend, 5)
			})
			if c.release == realCodeRelease {
				// On the older release the harness is what differs, not the
				// watchdog: the five-request variant and the mixed scene
				// cover it.
				t.Run("issue-9", func(t *testing.T) {
					t.Parallel()
					linksIssueScene(t, src, c.backend, 9)
				})
			}
			t.Run("mixed", func(t *testing.T) {
				t.Parallel()
				linksMixedScene(t, src, c.backend)
			})
			if c.release == realCodeRelease {
				t.Run("tp2", func(t *testing.T) {
					t.Parallel()
					linksTP2Scene(t, src, c.backend)
				})
			}
		})
	}
	t.Run("sglang-v0.5.11/nixl", func(t *testing.T) {
		t.Skip("NIXL before v0.5.18 has no transfer workers: the scheduler thread posts each chunk itself, so no chunk is " +
			"held by a worker nor has a link to be paced by (the plugin reports transfer_progress false there)")
	})
}

// linksScene is one real-code server watched by the binary, with the
// release times of every request, the finished chunks each link showed in
// the plugin's listing and when each room's chunk was first in a worker's
// hands.
type linksScene struct {
	*matrixScene
	client  *pluginapi.Client
	keys    map[string]string                    // link name -> SGLang's key of the destination
	samples map[string][]pluginapi.FinishedChunk // SGLang's key -> finished chunks, as first listed
	seen    map[string]bool                      // rank/queue/chunk of every sample taken
	taken   map[uint64]time.Time                 // room -> first listed in a worker's hands
}

func startLinksScene(t *testing.T, src, backend string, serverArgs ...string) *linksScene {
	tok := tokenFile(t, "links-token")
	// SGLang's event loop every 20 ms: time enough for these scenes, and a
	// lighter load on a CI machine that runs several of them at once.
	srv := startRealCodeServer(t, src, backend, tok, append([]string{"--pass-interval", "0.02"}, serverArgs...)...)
	s := &linksScene{
		matrixScene: &matrixScene{srv: srv, admitted: map[string]time.Time{}, released: map[string]time.Time{},
			reasons: map[string]string{}, stop: make(chan struct{}), done: make(chan struct{})},
		client: pluginapi.NewClient(srv.pluginURL, pluginapi.ClientOptions{Timeout: 2 * time.Second}),
		keys:   map[string]string{}, samples: map[string][]pluginapi.FinishedChunk{}, seen: map[string]bool{},
		taken: map[uint64]time.Time{},
	}
	l, err := s.client.Inflight(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if l.Server.TransferProgress == nil || !*l.Server.TransferProgress {
		t.Fatalf("the plugin on %s reports no transfer_progress: no chunk has a link here", backend)
	}
	s.wd = startWatchdog(t, "--plugin.url="+srv.pluginURL, "--plugin.token-file="+tok,
		"--sglang.metrics-url="+srv.control+"/metrics", "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
		"--watchdog.interval=500ms", "--watchdog.deadline="+linksDeadline.String(), "--watchdog.stall-window="+linksStall.String(),
		fmt.Sprintf("--watchdog.link-margin=%g", linksMargin),
		"--force-fail.mode=auto", "--force-fail.confirm-timeout=20s", "--restart.mode=dry-run", "--restart.min-interval=1m")
	go s.watch()
	t.Cleanup(func() { close(s.stop); <-s.done })
	return s
}

// watch records, every 100 ms, the requests SGLang's pass let go, each
// link's finished chunks and the rooms in the workers' hands.
func (s *linksScene) watch() {
	defer close(s.done)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
		now := time.Now()
		var st realCodeState
		if resp, err := http.Get(s.srv.control + "/scenario/state"); err == nil {
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err != nil {
				continue
			}
		}
		l, err := s.client.Inflight(context.Background())
		if err != nil {
			continue
		}
		s.mu.Lock()
		for _, r := range st.Released {
			if _, ok := s.released[r.RID]; !ok {
				s.released[r.RID], s.reasons[r.RID] = now, r.Reason
			}
		}
		s.record("leader", l.TransferWorkers, now)
		for _, p := range l.PeerTransferWorkers {
			s.record(p.Rank, p.TransferWorkers, now)
		}
		s.mu.Unlock()
	}
}

// record takes one rank's workers into the scene's samples and rooms held;
// caller holds s.mu.
func (s *linksScene) record(rank string, workers []pluginapi.TransferWorker, now time.Time) {
	for _, w := range workers {
		if f := w.InFlight; f != nil && f.Pages > 0 {
			if _, ok := s.taken[f.BootstrapRoom]; !ok {
				s.taken[f.BootstrapRoom] = now.Add(-time.Duration(f.Seconds * float64(time.Second)))
			}
		}
		for _, c := range w.Finished {
			id := fmt.Sprintf("%s/%d/%d", rank, w.TransferQueue, c.Chunk)
			if !s.seen[id] {
				s.seen[id] = true
				s.samples[c.Link] = append(s.samples[c.Link], c)
			}
		}
	}
}

// destination adds a decode destination whose rooms SGLang puts on queue.
func (s *linksScene) destination(t *testing.T, name string, queue int, perPage float64) {
	t.Helper()
	var out struct {
		Key   string `json:"key"`
		Queue int    `json:"transfer_queue"`
	}
	if err := json.Unmarshal(s.post(t, "/scenario/destination", map[string]any{"link": name, "transfer_queue": queue, "seconds_per_page": perPage}), &out); err != nil {
		t.Fatal(err)
	}
	if out.Queue != queue || out.Key == "" {
		t.Fatalf("destination %s: %+v, want a key on queue %d", name, out, queue)
	}
	s.keys[name] = out.Key
}

func (s *linksScene) speed(t *testing.T, name string, perPage float64) {
	s.post(t, "/scenario/link", map[string]any{"link": name, "seconds_per_page": perPage})
}

// send admits a request to a destination; SGLang's transfer_infos must key
// the room's one destination by the destination's own key.
func (s *linksScene) send(t *testing.T, rid string, room uint64, link string, chunks int, behaviour string) {
	t.Helper()
	var out struct {
		Destinations []string `json:"destinations"`
	}
	body := map[string]any{"rid": rid, "room": room, "link": link, "chunks": chunks, "behaviour": behaviour}
	if err := json.Unmarshal(s.post(t, "/scenario/admit", body), &out); err != nil {
		t.Fatal(err)
	}
	if len(out.Destinations) != 1 || out.Destinations[0] != s.keys[link] {
		t.Fatalf("%s: SGLang keys the room's destinations %v, want [%s] (link %s)", rid, out.Destinations, s.keys[link], link)
	}
	s.mu.Lock()
	s.admitted[rid] = time.Now()
	s.mu.Unlock()
}

// allowance is how long a 4-page chunk of this link (SGLang's key) may be
// held, from what the link has shown: the margin times its size at the 10%
// quantile of the link's last 32 paces (nearest rank, rounding down), never
// below the stall window; twice the deadline while it has shown none.
func (s *linksScene) allowance(key string) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	samples := s.samples[key]
	if len(samples) > 32 {
		samples = samples[len(samples)-32:]
	}
	var paces []float64
	for _, c := range samples {
		if c.Pages > 0 && c.Seconds > 0 {
			paces = append(paces, float64(c.Pages)/c.Seconds)
		}
	}
	if len(paces) == 0 {
		return 2 * linksDeadline
	}
	sort.Float64s(paces)
	pace := paces[int(0.1*float64(len(paces)-1))]
	return max(linksStall, time.Duration(linksMargin*4/pace*float64(time.Second)))
}

// wedgeDiagnosed is when the watchdog logged the wedge of the room's chunk.
func (s *linksScene) wedgeDiagnosed(t *testing.T, room uint64) time.Time {
	t.Helper()
	var at time.Time
	waitFor(t, fmt.Sprintf("the wedge of room %d in the watchdog's log", room), 5*time.Second, func() bool {
		for _, line := range strings.Split(s.wd.logs.String(), "\n") {
			if strings.Contains(line, "transfer queue wedged") && strings.Contains(line, fmt.Sprintf(" room=%d ", room)) {
				at = logTime(t, line)
				return true
			}
		}
		return false
	})
	return at
}

// stuckReleased checks that a stuck handle was released within its own
// link's allowance (or the deadline, whichever is later) plus the slack,
// counted from when its chunk was first in the worker's hands, and
// returns how long it took (0: not released).
func (s *linksScene) stuckReleased(t *testing.T, rid string, room uint64, key string) time.Duration {
	t.Helper()
	bound := max(s.allowance(key), linksDeadline) + linksSlack
	// Not fatal: the rest of the scene still shows what else went wrong.
	for end := time.Now().Add(bound + 5*time.Second); s.reason(rid) == ""; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(end) {
			t.Errorf("%s: stuck handle not released %s after admission, want within %s (its link's allowance or the deadline, + 3 s)",
				rid, (bound + 5*time.Second).Round(100*time.Millisecond), bound.Round(100*time.Millisecond))
			return 0
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	from := s.admitted[rid]
	if taken, ok := s.taken[room]; ok && taken.After(from) {
		from = taken
	}
	took := s.released[rid].Sub(from)
	if took > bound {
		t.Errorf("%s: stuck handle released %s after its chunk was taken, want within %s (its link's allowance or the deadline, + 3 s)",
			rid, took.Round(10*time.Millisecond), bound.Round(10*time.Millisecond))
	}
	return took
}

// behindReleased checks that each room was failed within 3 s of the
// wedge's diagnosis.
func (s *linksScene) behindReleased(t *testing.T, diagnosed time.Time, rids ...string) {
	t.Helper()
	waitFor(t, "the rooms behind the stuck handle released", 10*time.Second, func() bool {
		for _, rid := range rids {
			if s.reason(rid) == "" {
				return false
			}
		}
		return true
	})
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rid := range rids {
		if d := s.released[rid].Sub(diagnosed); d > linksSlack {
			t.Errorf("%s: failed %s after the wedge's diagnosis, want within 3 s", rid, d.Round(10*time.Millisecond))
		}
	}
}

// check ends the scene: the stuck handles' transfers end (a fabric that
// recovers), SGLang serves one more request end to end on each stuck
// handle's link (links: stuck rid -> link name), whose worker was held,
// every request but the stuck ones and those behind them completed, and
// the watchdog attempted nothing else.
func (s *linksScene) check(t *testing.T, room uint64, stuck map[string]uint64, links map[string]string, aborted map[string]bool) {
	t.Helper()
	for _, r := range stuck {
		s.post(t, "/scenario/end_hang", map[string]any{"room": r, "outcome": "complete"})
	}
	names := make([]string, 0, len(stuck))
	for rid := range stuck {
		names = append(names, rid)
	}
	sort.Strings(names)
	for i, rid := range names {
		s.send(t, "after-"+rid, room+uint64(i), links[rid], 1, "complete")
	}
	s.drain(t, "a new request on each stuck handle's link after the scene", 30*time.Second)
	// Two more judgement cycles and a scrape.
	time.Sleep(1500 * time.Millisecond)
	s.mu.Lock()
	for rid := range s.admitted {
		want := "FINISH_LENGTH"
		if aborted[rid] {
			want = "FINISH_ABORT"
		}
		if got := s.reasons[rid]; got != want {
			t.Errorf("%s: SGLang let it go as %q, want %q", rid, got, want)
		}
	}
	s.mu.Unlock()
	exposition := s.wd.metrics(t)
	released := sumSamples(t, grepLines(exposition, `result="released"`), "sglang_watchdog_force_fails_total")
	if all := sumSamples(t, exposition, "sglang_watchdog_force_fails_total"); all != released || released != float64(len(aborted)) {
		t.Errorf("force-fails: %v attempted, %v released, want exactly the %d stuck and behind:\n%s", all, released, len(aborted),
			grepLines(exposition, "sglang_watchdog_force_fails_total"))
	}
	s.restartsOnlyFor(t, stuck)
	if st := s.srv.state(t); len(st.Errors) > 0 {
		t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", st.Errors)
	}
}

// restartsOnlyFor checks that every restart the watchdog escalated to (in
// dry-run) was for the wedge of a stuck handle's chunk: a restart is the
// cure of a worker held by a dead handle, never of a slow link.
func (s *linksScene) restartsOnlyFor(t *testing.T, stuck map[string]uint64) {
	t.Helper()
	rooms := map[string]bool{}
	for _, r := range stuck {
		rooms[fmt.Sprintf(" room=%d ", r)] = true
	}
	for _, line := range strings.Split(s.wd.logs.String(), "\n") {
		if !strings.Contains(line, `msg="restart escalation"`) {
			continue
		}
		ok := false
		for room := range rooms {
			ok = ok || strings.Contains(line, room)
		}
		if !ok {
			t.Errorf("a restart escalation for no stuck handle: %s", line)
		}
	}
}

// linksIssueScene is issue 23's scene: link A healthy, link B at 1% of
// A's speed, on queues of their own. B's first chunk shows B's pace (alone
// on the rank, under the first-chunk rule); then healthyOnA requests on A
// (7 chunks for five, 13 for nine), then S, whose handle on A never
// completes, four more requests queued behind S on A, and B1 and B2,
// healthy on B, 4 s each. With five, the pooled estimator gave S link B's
// pace (A had 7 samples of its own, fewer than 8): S was never released;
// with nine, it gave B1 and B2 link A's (B had one): they were failed.
func linksIssueScene(t *testing.T, src, backend string, healthyOnA int) {
	started := time.Now()
	s := startLinksScene(t, src, backend)
	s.destination(t, "A", 1, linkFast)
	s.destination(t, "B", 3, linkHundredth)
	room := uint64(41000 + 100*healthyOnA)
	next := func() uint64 { room++; return room }

	s.send(t, "B0", next(), "B", 1, "complete")
	s.drain(t, "B's first chunk", 15*time.Second)
	twoChunks := map[int]int{5: 2, 9: 4}[healthyOnA] // 7 chunks for five requests, 13 for nine
	for i := range healthyOnA {
		s.send(t, fmt.Sprintf("A%d", i), next(), "A", map[bool]int{true: 2, false: 1}[i < twoChunks], "complete")
	}
	s.drain(t, "the healthy requests on A", 15*time.Second)

	stuck := next()
	s.send(t, "S", stuck, "A", 1, "hang")
	aborted := map[string]bool{"S": true}
	var behind []string
	for i := range 4 {
		rid := fmt.Sprintf("behind-S-%d", i)
		s.send(t, rid, next(), "A", 1, "complete")
		behind, aborted[rid] = append(behind, rid), true
	}
	s.send(t, "B1", next(), "B", 1, "complete")
	s.send(t, "B2", next(), "B", 1, "complete")

	took := s.stuckReleased(t, "S", stuck, s.keys["A"])
	if took > 0 {
		s.behindReleased(t, s.wedgeDiagnosed(t, stuck), behind...)
	}
	waitFor(t, "B1 and B2 to complete (4 s each on link B)", 20*time.Second, func() bool {
		return s.reason("B1") != "" && s.reason("B2") != ""
	})
	s.check(t, room+1, map[string]uint64{"S": stuck}, map[string]string{"S": "A"}, aborted)
	t.Logf("%s, %d healthy on A first: S released %s after its chunk was taken; scene in %s", backend, healthyOnA,
		took.Round(10*time.Millisecond), time.Since(started).Round(100*time.Millisecond))
}

// linksMixedScene plays, on one rank, links of 100% (F), 10% (T) and 1%
// (H) of one speed, F and H on one queue (SGLang's port-sum rule puts both
// there), T on the other; a link D that slows down tenfold mid-run (inside
// the margin) and recovers; a link N that appears once the others were
// measured, on T's queue; then stuck handles on the fastest link and on
// the slower T, each with rooms queued behind it.
func linksMixedScene(t *testing.T, src, backend string) {
	started := time.Now()
	s := startLinksScene(t, src, backend)
	s.destination(t, "F", 1, linkFast)
	s.destination(t, "H", 1, linkHundredth)
	s.destination(t, "T", 3, linkTenth)
	s.destination(t, "D", 3, linkTenth/2)
	room := uint64(43000)
	next := func() uint64 { room++; return room }

	// Every link measured: F ten times, T and D three times each.
	for i := range 10 {
		s.send(t, fmt.Sprintf("F%d", i), next(), "F", 1, "complete")
	}
	for i := range 3 {
		s.send(t, fmt.Sprintf("T%d", i), next(), "T", 1, "complete")
		s.send(t, fmt.Sprintf("D%d", i), next(), "D", 1, "complete")
	}
	s.drain(t, "the fast and 10% links measured", 15*time.Second)

	// H's first chunk (4 s, under the first-chunk rule) on F's queue, F's
	// rooms queued behind it, then H's second chunk, judged by H's own pace
	// with the room past the deadline, never by F's samples on the queue.
	s.send(t, "H0", next(), "H", 1, "complete")
	for i := range 3 {
		s.send(t, fmt.Sprintf("F-behind-H0-%d", i), next(), "F", 1, "complete")
	}
	s.send(t, "H1", next(), "H", 1, "complete")
	// Meanwhile on the other queue: D slows down tenfold (2 s a chunk,
	// inside the margin of its 0.2 s), three rooms in a row, the last past
	// the deadline; then it recovers.
	s.speed(t, "D", 10*linkTenth/2)
	for i := range 3 {
		s.send(t, fmt.Sprintf("D-slow-%d", i), next(), "D", 1, "complete")
	}
	waitFor(t, "D's slow chunks", 20*time.Second, func() bool { return s.reason("D-slow-2") != "" })
	s.speed(t, "D", linkTenth/2)
	for i := range 3 {
		s.send(t, fmt.Sprintf("D-recovered-%d", i), next(), "D", 1, "complete")
	}
	// A new link on T's queue, 2 s a chunk: its first chunk under the
	// first-chunk rule, its second past the deadline, judged by its own.
	s.destination(t, "N", 3, 5*linkTenth)
	s.send(t, "N0", next(), "N", 1, "complete")
	s.send(t, "N1", next(), "N", 1, "complete")
	s.drain(t, "the slow, degraded, recovered and new links", 30*time.Second)

	// Stuck handles on the fastest link and on T, at once (their queues
	// differ), two rooms queued behind each.
	aborted := map[string]bool{}
	stuck := map[string]uint64{"SF": next(), "ST": next()}
	behind := map[string][]string{}
	for _, rid := range []string{"SF", "ST"} {
		link := rid[1:]
		s.send(t, rid, stuck[rid], link, 1, "hang")
		aborted[rid] = true
		for i := range 2 {
			b := fmt.Sprintf("behind-%s-%d", rid, i)
			s.send(t, b, next(), link, 1, "complete")
			behind[rid], aborted[b] = append(behind[rid], b), true
		}
	}
	for _, rid := range []string{"SF", "ST"} {
		took := s.stuckReleased(t, rid, stuck[rid], s.keys[rid[1:]])
		if took > 0 {
			s.behindReleased(t, s.wedgeDiagnosed(t, stuck[rid]), behind[rid]...)
		}
		t.Logf("%s: %s released %s after its chunk was taken (its link's allowance %s)", backend, rid,
			took.Round(10*time.Millisecond), s.allowance(s.keys[rid[1:]]).Round(10*time.Millisecond))
	}
	s.check(t, room+1, stuck, map[string]string{"SF": "F", "ST": "T"}, aborted)
	t.Logf("%s: mixed scene in %s", backend, time.Since(started).Round(100*time.Millisecond))
}

// linksTP2Scene: a TP2 prefill whose rank 0 sends over a fast link and
// rank 1 over one at 10% of it (each rank's own decode peer). Healthy
// requests queue on rank 1's link past the deadline; a handle stuck on
// rank 1's link (the slowest) is released within that link's allowance,
// one stuck on rank 0's (the fastest) within its own, by a wedge order.
func linksTP2Scene(t *testing.T, src, backend string) {
	started := time.Now()
	s := startLinksScene(t, src, backend, "--attn-tp", "2")
	dests := s.linksTP2Destinations(t)
	if len(dests) != 2 || dests[0] == dests[1] {
		t.Fatalf("the TP2 ranks' decode peers: %v, want two destinations", dests)
	}
	s.post(t, "/scenario/link", map[string]any{"rank": 0, "seconds_per_page": linkFast})
	s.post(t, "/scenario/link", map[string]any{"rank": 1, "seconds_per_page": linkTenth})
	room := uint64(45000)
	next := func() uint64 { room++; return room }
	admit := func(rid string, r uint64, behaviour, rank1 string) {
		s.srv.admitTP2(t, rid, r, behaviour, rank1)
		s.mu.Lock()
		s.admitted[rid] = time.Now()
		s.mu.Unlock()
	}
	// Ten healthy requests at once: 0.4 s each on rank 1's link, so the
	// last ones wait past the deadline.
	for i := range 10 {
		admit(fmt.Sprintf("tp2-%d", i), next(), "complete", "")
	}
	s.drain(t, "the healthy requests", 20*time.Second)

	aborted := map[string]bool{"stuck-rank1": true, "stuck-rank0": true}
	stuck := map[string]uint64{"stuck-rank1": next(), "stuck-rank0": next()}
	admit("stuck-rank1", stuck["stuck-rank1"], "complete", "hang")
	took1 := s.stuckReleased(t, "stuck-rank1", stuck["stuck-rank1"], dests[1])
	s.post(t, "/scenario/end_hang", map[string]any{"room": stuck["stuck-rank1"], "outcome": "complete"})
	admit("stuck-rank0", stuck["stuck-rank0"], "hang", "complete")
	took0 := s.stuckReleased(t, "stuck-rank0", stuck["stuck-rank0"], dests[0])
	s.post(t, "/scenario/end_hang", map[string]any{"room": stuck["stuck-rank0"], "outcome": "complete"})
	admit("tp2-after", next(), "complete", "")
	s.drain(t, "a new request on both ranks after the scene", 20*time.Second)

	time.Sleep(1500 * time.Millisecond)
	final := s.srv.tp2State(t)
	for i, rk := range final.Ranks {
		for _, r := range rk.Released {
			want := map[bool]string{true: "FINISH_ABORT", false: "FINISH_LENGTH"}[aborted[r.RID]]
			if r.RID != "tp2-first-request" && r.Reason != want {
				t.Errorf("rank %d let %s go as %s, want %s", i, r.RID, r.Reason, want)
			}
		}
	}
	exposition := s.wd.metrics(t)
	released := sumSamples(t, grepLines(exposition, `result="released"`), "sglang_watchdog_force_fails_total")
	if all := sumSamples(t, exposition, "sglang_watchdog_force_fails_total"); all != released || released != 2 {
		t.Errorf("force-fails: %v attempted, %v released, want the 2 stuck:\n%s", all, released, grepLines(exposition, "sglang_watchdog_force_fails_total"))
	}
	s.restartsOnlyFor(t, stuck)
	if len(final.Errors) > 0 {
		t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", final.Errors)
	}
	t.Logf("%s TP2: stuck on rank 1's link released in %s, on rank 0's in %s; scene in %s", backend, took1.Round(10*time.Millisecond),
		took0.Round(10*time.Millisecond), time.Since(started).Round(100*time.Millisecond))
}

// linksTP2Destinations are SGLang's keys of each TP2 rank's decode peer.
func (s *linksScene) linksTP2Destinations(t *testing.T) []string {
	t.Helper()
	resp, err := http.Get(s.srv.control + "/scenario/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st struct {
		Destinations []string `json:"destinations"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st.Destinations
}
