package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// Issue 17's false-positive matrix on SGLang's own prefill code: the
// watchdog binary in auto mode (restarts in dry-run, so that a wrong one is
// counted, not carried out) against the real-code server, whose transfers
// run SGLang's real transfer worker over the fake NIXL agent or Mooncake
// engine, with a link speed in seconds per page. Every transfer of a room
// is served one chunk at a time by its queue's worker, as in SGLang, so the
// classes below also queue rooms past the deadline behind slow chunks.
//
// The watchdog runs with a 3 s deadline and a 1 s stall window (the
// production defaults are 60 s and 30 s); every duration below is scaled to
// them.
const (
	matrixDeadline = 3 * time.Second
	// healthyPerPage: 40 ms for a request's 4 pages, the pace the watchdog
	// learns from the warm-up (its allowance for a 4-page chunk: 200 x 40 ms
	// at the slow end of that pace).
	healthyPerPage = 0.01
	// fastPerPage: the stuck scene's link, where a chunk's allowance is the
	// stall window and a hung handle can be told from a slow one at the
	// deadline (the physical limit: BENCHMARKS.md, "Slow links").
	fastPerPage = 0.0005
)

// matrixReleases are the releases and backends the matrix runs on: the
// newest for both backends, and an older Mooncake (NIXL reports no
// transfer workers before v0.5.18).
var matrixReleases = []struct{ release, backend string }{
	{realCodeRelease, sglangsim.BackendNIXL},
	{realCodeRelease, sglangsim.BackendMooncake},
	{"sglang-v0.5.11", sglangsim.BackendMooncake},
}

func TestRealCodeFalsePositiveMatrix(t *testing.T) {
	for _, c := range matrixReleases {
		src := sglangSource(t, c.release)
		t.Run(c.release+"/"+c.backend, func(t *testing.T) {
			t.Run("would-complete", func(t *testing.T) {
				t.Parallel()
				matrixWouldComplete(t, src, c.backend)
			})
			t.Run("stuck", func(t *testing.T) {
				t.Parallel()
				matrixStuck(t, src, c.backend)
			})
		})
	}
}

// matrixScene is one real-code server watched by the binary, with the
// release times of every request seen.
type matrixScene struct {
	srv *realCodeServer
	wd  *watchdogProc

	mu       sync.Mutex
	admitted map[string]time.Time
	released map[string]time.Time
	reasons  map[string]string
	stop     chan struct{}
	done     chan struct{}
}

func startMatrixScene(t *testing.T, src, backend string, perPage float64) *matrixScene {
	tok := tokenFile(t, "matrix-token")
	srv := startRealCodeServer(t, src, backend, tok)
	s := &matrixScene{srv: srv, admitted: map[string]time.Time{}, released: map[string]time.Time{}, reasons: map[string]string{},
		stop: make(chan struct{}), done: make(chan struct{})}
	s.post(t, "/scenario/link", map[string]any{"seconds_per_page": perPage})
	l, err := pluginapi.NewClient(srv.pluginURL, pluginapi.ClientOptions{Timeout: 2 * time.Second}).Inflight(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if l.Server.TransferProgress == nil || !*l.Server.TransferProgress || len(l.Server.Levers) == 0 {
		t.Fatalf("the plugin on %s reports transfer_progress %v, levers %v: the matrix would prove nothing", backend, l.Server.TransferProgress, l.Server.Levers)
	}
	s.wd = startWatchdog(t, "--plugin.url="+srv.pluginURL, "--plugin.token-file="+tok,
		"--sglang.metrics-url="+srv.control+"/metrics", "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
		"--watchdog.interval=500ms", "--watchdog.deadline="+matrixDeadline.String(), "--watchdog.stall-window=1s",
		"--force-fail.mode=auto", "--force-fail.confirm-timeout=20s", "--restart.mode=dry-run", "--restart.min-interval=1m")
	go s.watch(t)
	t.Cleanup(func() { close(s.stop); <-s.done })
	return s
}

// watch records when SGLang's pass let each request go, every 100 ms.
func (s *matrixScene) watch(t *testing.T) {
	defer close(s.done)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
		resp, err := http.Get(s.srv.control + "/scenario/state")
		if err != nil {
			continue
		}
		var st realCodeState
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if err != nil {
			continue
		}
		now := time.Now()
		s.mu.Lock()
		for _, r := range st.Released {
			if _, ok := s.released[r.RID]; !ok {
				s.released[r.RID], s.reasons[r.RID] = now, r.Reason
			}
		}
		s.mu.Unlock()
	}
}

func (s *matrixScene) post(t *testing.T, path string, body map[string]any) []byte {
	t.Helper()
	return s.srv.post(t, path, body)
}

// post sends body to one of the server's control endpoints and returns
// its answer, failing the test on anything but 200.
func (s *realCodeServer) post(t *testing.T, path string, body map[string]any) []byte {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(s.control+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s %s: %d %s", path, b, resp.StatusCode, out)
	}
	return out
}

// admit puts a request in SGLang's inflight queue; behaviour is one for
// every chunk or a list, one per chunk. It returns the request's transfer
// queue.
func (s *matrixScene) admit(t *testing.T, rid string, room uint64, chunks int, behaviour any) int {
	t.Helper()
	var out struct {
		Queue int `json:"transfer_queue"`
	}
	if err := json.Unmarshal(s.post(t, "/scenario/admit", map[string]any{"rid": rid, "room": room, "chunks": chunks, "behaviour": behaviour}), &out); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.admitted[rid] = time.Now()
	s.mu.Unlock()
	return out.Queue
}

// drain waits until SGLang let every admitted request go.
func (s *matrixScene) drain(t *testing.T, what string, timeout time.Duration) {
	t.Helper()
	waitFor(t, what, timeout, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		for rid := range s.admitted {
			if _, ok := s.released[rid]; !ok {
				return false
			}
		}
		return true
	})
}

func (s *matrixScene) reason(rid string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reasons[rid]
}

// warmUp lets the worker finish ten healthy chunks, from which the
// watchdog learns the link's pace; it returns their transfer queue (the
// real-code server has one decode peer, so every room takes the same).
func (s *matrixScene) warmUp(t *testing.T, room uint64) int {
	var queue int
	for i := range 10 {
		queue = s.admit(t, fmt.Sprintf("warm-%d", i), room+uint64(i), 1, "complete")
	}
	s.drain(t, "the warm-up", 20*time.Second)
	return queue
}

// matrixWouldComplete plays the classes of transfers that complete:
// nothing may be force-failed, ordered or restarted.
func matrixWouldComplete(t *testing.T, src, backend string) {
	s := startMatrixScene(t, src, backend, healthyPerPage)
	room := uint64(20000)
	next := func() uint64 { room++; return room }
	queue := s.warmUp(t, next())
	room += 10

	// A long prompt: four chunks of 1.2 s each, past the deadline in all.
	s.admit(t, "long-prompt", next(), 4, "slow:1.2")
	s.drain(t, "the long prompt", 20*time.Second)
	// A single huge chunk: 6 s, twice the deadline.
	s.admit(t, "huge-chunk", next(), 1, "slow:6")
	s.drain(t, "the huge chunk", 20*time.Second)
	// Every queue at 1% speed: 4 s a request; the second waits for the
	// first, 8 s in all.
	s.post(t, "/scenario/link", map[string]any{"seconds_per_page": 100 * healthyPerPage})
	s.admit(t, "link-1pct-a", next(), 1, "complete")
	s.admit(t, "link-1pct-b", next(), 1, "complete")
	s.drain(t, "the 1% link", 30*time.Second)
	// One queue at 10%: the queue the rooms take.
	s.post(t, "/scenario/link", map[string]any{"seconds_per_page": healthyPerPage})
	s.post(t, "/scenario/link", map[string]any{"seconds_per_page": 10 * healthyPerPage, "transfer_queue": queue})
	for i := range 3 {
		s.admit(t, fmt.Sprintf("link-10pct-%d", i), next(), 2, "complete")
	}
	s.drain(t, "the 10% link", 20*time.Second)
	s.post(t, "/scenario/link", map[string]any{"seconds_per_page": healthyPerPage})
	// A burst queued behind a slow chunk: every room waits past the
	// deadline in the queue.
	s.admit(t, "burst-head", next(), 1, "slow:4")
	for i := range 8 {
		s.admit(t, fmt.Sprintf("burst-%d", i), next(), 1, "complete")
	}
	s.drain(t, "the burst", 30*time.Second)
	// A client abort behind a slow chunk.
	s.admit(t, "abort-head", next(), 1, "slow:4")
	s.admit(t, "aborted", next(), 1, "complete")
	s.post(t, "/scenario/abort", map[string]any{"rid": "aborted"})
	s.drain(t, "the abort behind a slow chunk", 30*time.Second)
	// A chunk that errors after 2 s and settles: the rooms behind it go on.
	s.admit(t, "erroring", next(), 1, "fail:2")
	s.admit(t, "after-error", next(), 1, "complete")
	s.drain(t, "the chunk that errors", 30*time.Second)

	// Two more judgement cycles and a scrape: nothing may be attempted.
	time.Sleep(1500 * time.Millisecond)
	exposition := s.wd.metrics(t)
	for _, family := range []string{"sglang_watchdog_force_fails_total", "sglang_watchdog_wedge_orders_total", "sglang_watchdog_restarts_total"} {
		if n := sumSamples(t, exposition, family); n != 0 {
			t.Errorf("%s: %v, want 0 (nothing here was stuck):\n%s", family, n, grepLines(exposition, family))
		}
	}
	if logs := s.wd.logs.String(); strings.Contains(logs, `msg="request stuck"`) || strings.Contains(logs, "transfer queue wedged") {
		t.Errorf("the watchdog judged a transfer that completes stuck or wedged:\n%s", grepLines(logs, "stuck"))
	}
	for rid := range s.admitted {
		want := "FINISH_LENGTH"
		switch {
		case rid == "aborted" || rid == "erroring": // the client's abort, the transport's error: SGLang's own failures
			want = "FINISH_ABORT"
		case rid == "after-error" && backend == sglangsim.BackendMooncake:
			// Mooncake blacklists a session whose transfer failed
			// (failed_sessions in mooncake/conn.py, v0.5.11 and v0.5.18) and
			// fails the later rooms bound to it itself.
			want = "FINISH_ABORT"
		}
		if got := s.reason(rid); got != want {
			t.Errorf("%s: SGLang let it go as %q, want %q", rid, got, want)
		}
	}
	if st := s.srv.state(t); len(st.Errors) > 0 {
		t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", st.Errors)
	}
}

// matrixStuck plays a hung handle with rooms queued behind it on a fast
// link: the head is released by the watchdog within deadline + 3 s of its
// admission, and the rooms behind it get their error within 3 s of the
// diagnosis, each through SGLang's own Failed branch.
func matrixStuck(t *testing.T, src, backend string) {
	s := startMatrixScene(t, src, backend, fastPerPage)
	s.warmUp(t, 30000)
	s.admit(t, "hung", 30100, 1, "hang")
	s.admit(t, "behind-1", 30101, 1, "complete")
	s.admit(t, "behind-2", 30102, 1, "complete")
	s.drain(t, "every stuck room released", 30*time.Second)
	var diagnosed time.Time
	waitFor(t, "the wedge in the watchdog's log", 5*time.Second, func() bool {
		for _, line := range strings.Split(s.wd.logs.String(), "\n") {
			if strings.Contains(line, "transfer queue wedged") {
				diagnosed = logTime(t, line)
				return true
			}
		}
		return false
	})
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rid := range []string{"hung", "behind-1", "behind-2"} {
		if s.reasons[rid] != "FINISH_ABORT" {
			t.Errorf("%s: let go as %q, want FINISH_ABORT", rid, s.reasons[rid])
		}
		// released is sampled every 100 ms.
		if d := s.released[rid].Sub(diagnosed); d > 3*time.Second+100*time.Millisecond {
			t.Errorf("%s: error %s after the wedge's diagnosis, want within 3 s", rid, d.Round(10*time.Millisecond))
		}
	}
	if d := s.released["hung"].Sub(s.admitted["hung"]); d > matrixDeadline+3*time.Second+100*time.Millisecond {
		t.Errorf("the hung handle released %s after admission, want within the deadline + 3 s", d.Round(10*time.Millisecond))
	}
	t.Logf("%s: hung handle released %s after admission; rooms behind it %s and %s after the diagnosis", backend,
		s.released["hung"].Sub(s.admitted["hung"]).Round(10*time.Millisecond),
		s.released["behind-1"].Sub(diagnosed).Round(10*time.Millisecond), s.released["behind-2"].Sub(diagnosed).Round(10*time.Millisecond))
}

// logTime reads the ts= field of a logfmt line.
func logTime(t *testing.T, line string) time.Time {
	t.Helper()
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, "ts="); ok {
			ts, err := time.Parse(time.RFC3339Nano, v)
			if err != nil {
				t.Fatalf("ts in %q: %v", line, err)
			}
			return ts
		}
	}
	t.Fatalf("no ts in %q", line)
	return time.Time{}
}
