package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// realCodeRelease is the SGLang release the real-code server runs.
const realCodeRelease = "sglang-v0.5.18"

// sglangSource returns an unpacked SGLang source tree (DIR/python/sglang):
// $SGLANG_SRC if set, else the release's tarball from $SGLANG_SRC_DIR
// (default ../shared/sglang-src beside the checkout) unpacked once into the
// cache folder scripts/conformance.sh uses. It skips only where no SGLang
// source exists at all.
func sglangSource(t *testing.T, release string) string {
	t.Helper()
	if src := os.Getenv("SGLANG_SRC"); src != "" {
		return src
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			t.Fatal(err)
		}
		cache = filepath.Join(home, ".cache")
	}
	target := filepath.Join(cache, "sglang-watchdog", "sglang-src", release)
	dir := os.Getenv("SGLANG_SRC_DIR")
	if dir == "" {
		dir = filepath.Join(repoRoot, "..", "shared", "sglang-src")
	}
	tarball := filepath.Join(dir, release+".tar.xz")
	marker, markerErr := os.Stat(filepath.Join(target, ".unpacked"))
	tb, tarErr := os.Stat(tarball)
	switch {
	case markerErr == nil && (tarErr != nil || !tb.ModTime().After(marker.ModTime())):
		return target
	case tarErr != nil:
		t.Skipf("SKIPPED: no SGLang source at all (no SGLANG_SRC, no %s, no unpacked %s): nothing was proven on SGLang's own code", tarball, target)
	}
	// Unpacked beside the target, then moved into place, so that a run
	// stopped half way leaves no tree that looks complete.
	tmp, err := os.MkdirTemp(filepath.Dir(target), release+".unpacking-")
	if err != nil {
		if err = os.MkdirAll(filepath.Dir(target), 0o755); err == nil {
			tmp, err = os.MkdirTemp(filepath.Dir(target), release+".unpacking-")
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	defer os.RemoveAll(tmp)
	if err := os.Chmod(tmp, 0o755); err != nil { // as scripts/conformance.sh's mkdir leaves it
		t.Fatal(err)
	}
	if out, err := exec.Command("tar", "-xJf", tarball, "-C", tmp).CombinedOutput(); err != nil {
		t.Fatalf("unpacking %s: %v\n%s (scripts/deps.sh installs xz-utils)", tarball, err, out)
	}
	if err := os.WriteFile(filepath.Join(tmp, ".unpacked"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(target); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, target); err != nil {
		t.Fatal(err)
	}
	return target
}

// realCodePython is the interpreter with the libraries SGLang's PD code
// needs: Debian's python3 (scripts/deps.sh), or $CONFORMANCE_PYTHON as in
// scripts/conformance.sh.
func realCodePython(t *testing.T) string {
	t.Helper()
	python := os.Getenv("CONFORMANCE_PYTHON")
	if python == "" {
		python = "/usr/bin/python3"
	}
	if out, err := exec.Command(python, "-c", "import torch, numpy, zmq, prometheus_client").CombinedOutput(); err != nil {
		t.Fatalf("%s lacks what SGLang's PD code needs (run scripts/deps.sh as root): %v\n%s", python, err, out)
	}
	return python
}

// realCodeServer is sglang_watchdog_plugin.conformance.server: SGLang's own
// prefill inflight pass in a loop with the plugin loaded, serving the
// plugin's endpoints, SGLang's /metrics and the scenario control.
type realCodeServer struct {
	pluginURL string
	control   string // base URL of /metrics and /scenario/*
	collector string
}

// startRealCodeServer starts a prefill server; args are more of the
// server's flags (--mode decode, --attn-tp 2).
func startRealCodeServer(t *testing.T, src, backend, tokenFile string, args ...string) *realCodeServer {
	t.Helper()
	portFile := filepath.Join(t.TempDir(), "ports.json")
	cmd := exec.Command(realCodePython(t), append([]string{"-W", "ignore", "-m", "sglang_watchdog_plugin.conformance.server",
		"--backend", backend, "--port-file", portFile, "--token-file", tokenFile, "--exit-on-stdin-close"}, args...)...)
	cmd.Dir = filepath.Join(repoRoot, "sglang_plugin")
	cmd.Env = append(os.Environ(), "SGLANG_SRC="+src)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr syncBuffer
	cmd.Stdout, cmd.Stderr = io.Discard, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		stdin.Close()
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("real-code server stderr (last 4000 bytes):\n%s", tail([]byte(stderr.String()), 4000))
		}
	})
	var ports struct {
		Plugin    int      `json:"plugin"`
		Metrics   int      `json:"metrics"`
		Collector string   `json:"collector"`
		Notes     []string `json:"metrics_notes"`
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		b, err := os.ReadFile(portFile)
		if err == nil && json.Unmarshal(b, &ports) == nil && ports.Plugin > 0 {
			break
		}
		select {
		case <-exited:
			t.Fatalf("the real-code server exited before writing its port file; stderr:\n%s", tail([]byte(stderr.String()), 4000))
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("the real-code server wrote no port file within 60s; stderr:\n%s", tail([]byte(stderr.String()), 4000))
		}
	}
	t.Logf("real-code server: SGLang %s, %s, /metrics from %s", filepath.Base(src), backend, ports.Collector)
	for _, n := range ports.Notes {
		t.Logf("real-code server: metrics: %s", n)
	}
	return &realCodeServer{
		pluginURL: fmt.Sprintf("http://127.0.0.1:%d", ports.Plugin),
		control:   fmt.Sprintf("http://127.0.0.1:%d", ports.Metrics),
		collector: ports.Collector,
	}
}

// admit puts a request in SGLang's inflight queue with a transfer that
// behaves as told (complete, hang, fail, slow:SECONDS); it returns once the
// plugin lists it (or SGLang's pass already let it go).
func (s *realCodeServer) admit(t *testing.T, rid string, room uint64, behaviour string) {
	t.Helper()
	body := fmt.Sprintf(`{"rid":%q,"room":%d,"behaviour":%q}`, rid, room, behaviour)
	resp, err := http.Post(s.control+"/scenario/admit", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("admit %s: %d %s", rid, resp.StatusCode, b)
	}
}

type realCodeState struct {
	Passes   int      `json:"passes"`
	Errors   []string `json:"errors"`
	Queued   []string `json:"queued"`
	Released []struct {
		RID    string `json:"rid"`
		Reason string `json:"finished_reason"`
	} `json:"released"`
}

func (s *realCodeServer) state(t *testing.T) realCodeState {
	t.Helper()
	resp, err := http.Get(s.control + "/scenario/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st realCodeState
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st
}

func (st realCodeState) reasons() map[string]string {
	out := map[string]string{}
	for _, r := range st.Released {
		out[r.RID] = r.Reason
	}
	return out
}

// sumSamples adds up every sample of a family in a text exposition (the
// family's name followed by labels or a space).
func sumSamples(t *testing.T, exposition, family string) float64 {
	t.Helper()
	var sum float64
	sc := bufio.NewScanner(strings.NewReader(exposition))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, family+"{") && !strings.HasPrefix(line, family+" ") {
			continue
		}
		fields := strings.Fields(line[strings.LastIndex(line, "}")+1:])
		if len(fields) == 0 {
			t.Fatalf("no value in %q", line)
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		sum += v
	}
	return sum
}

func getText(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestRealCodeServerWithTheWatchdog runs the watchdog binary in auto mode
// against SGLang's own prefill code (release realCodeRelease, its real KV
// manager and transfer worker over the fake NIXL agent or Mooncake engine,
// its real process_disagg_prefill_inflight_queue with the plugin loaded, its
// own metrics collector). Three requests share one transfer queue, which
// SGLang's worker serves one chunk at a time: a healthy one, a slow one
// (4 s: longer than the stall window, within the deadline) and a pinned one
// whose handle never completes. The pin is listed, judged (its chunk held
// past its allowance wedges the queue), released by the queue's wedge order
// and confirmed by SGLang's own counter; the other two are let finish by
// SGLang; the watchdog's released count equals SGLang's
// num_transfer_failed_reqs_total and nothing else was attempted.
func TestRealCodeServerWithTheWatchdog(t *testing.T) {
	src := sglangSource(t, realCodeRelease)
	for i, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			realCodeScene(t, src, backend, uint64(7001+100*i), 4)
		})
	}
}

// realCodeScene plays one scene on a fresh real-code server (a hung handle
// holds its transfer worker for ever, as in SGLang, so scenes never share
// one): a healthy request, one whose transfer takes slowSeconds, and a
// pinned one, admitted in that order on one transfer queue.
func realCodeScene(t *testing.T, src, backend string, room uint64, slowSeconds int) {
	started := time.Now()
	tok := tokenFile(t, "realcode-token")
	srv := startRealCodeServer(t, src, backend, tok)
	t.Logf("server up in %s", time.Since(started).Round(10*time.Millisecond))
	if !strings.Contains(srv.collector, "SchedulerMetricsCollector") {
		t.Errorf("/metrics is not from SGLang's own collector on %s: %s", realCodeRelease, srv.collector)
	}

	wd := startWatchdog(t, "--plugin.url="+srv.pluginURL, "--plugin.token-file="+tok,
		"--sglang.metrics-url="+srv.control+"/metrics", "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
		"--watchdog.deadline=5s", "--watchdog.stall-window=2s", "--force-fail.mode=auto",
		"--force-fail.confirm-timeout=20s",
		// One link carries all three: once it showed the slow chunk, the
		// hung one is overdue at margin x that chunk's time, 800 s at the
		// shipped 200; 5 keeps the scene inside its wait, and the slow
		// chunk inside its allowance.
		"--watchdog.link-margin=5")

	healthy, slow, pinned := fmt.Sprintf("healthy-%d", room), fmt.Sprintf("slow-%d", room+1), fmt.Sprintf("pinned-%d", room+2)
	srv.admit(t, healthy, room, "complete")
	srv.admit(t, slow, room+1, fmt.Sprintf("slow:%d", slowSeconds))
	srv.admit(t, pinned, room+2, "hang")
	admitted := time.Now()

	// Listed, as SGLang's own objects say.
	l, err := pluginapi.NewClient(srv.pluginURL, pluginapi.ClientOptions{Timeout: 2 * time.Second}).Inflight(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var listed bool
	for _, r := range l.Inflight {
		if r.RID == pinned {
			listed = true
			if r.BootstrapRoom != room+2 || r.Poll == "Failed" || r.Poll == "Success" || r.HealthCheck {
				t.Errorf("the pinned request listed as %+v", r)
			}
		}
	}
	if !listed || l.Server.TransferBackend != backend || len(l.Server.Levers) == 0 {
		t.Fatalf("listing %+v: want %s listed, backend %s, a lever", l, pinned, backend)
	}

	// Judged, released, confirmed: the binary counts a release only once the
	// request left the listing and SGLang's counter rose.
	waitFor(t, "the pinned request released and confirmed", 40*time.Second, func() bool {
		return wd.has(t, `sglang_watchdog_force_fails_total{result="released",role="prefill",trigger="fail_fast"} 1`)
	})
	t.Logf("a release confirmed %s after admission", time.Since(admitted).Round(10*time.Millisecond))
	waitFor(t, "SGLang to let every request go", 15*time.Second, func() bool {
		return len(srv.state(t).reasons()) == 3
	})
	// One more judgement cycle and scrape: nothing else may be attempted.
	time.Sleep(2500 * time.Millisecond)
	exposition := wd.metrics(t)
	wd.stop()

	st := srv.state(t)
	if len(st.Errors) > 0 {
		t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", st.Errors)
	}
	want := map[string]string{healthy: "FINISH_LENGTH", slow: "FINISH_LENGTH", pinned: "FINISH_ABORT"}
	if got := st.reasons(); !equalMaps(got, want) {
		t.Errorf("released by SGLang's pass: %v, want %v", got, want)
	}
	if len(st.Queued) != 0 {
		t.Errorf("still in SGLang's inflight queue: %v", st.Queued)
	}
	attempts := sumSamples(t, exposition, "sglang_watchdog_force_fails_total")
	released := sumSamples(t, grepLines(exposition, `result="released"`), "sglang_watchdog_force_fails_total")
	if attempts != 1 || !strings.Contains(exposition, `sglang_watchdog_force_fails_total{result="released",role="prefill",trigger="fail_fast"} 1`) {
		t.Errorf("the watchdog attempted %v force-fails, want only the pinned request's (released by its queue's wedge order, fail_fast):\n%s", attempts,
			grepLines(exposition, "sglang_watchdog_force_fails_total"))
	}
	logs := wd.logs.String()
	if !strings.Contains(logs, `msg="release confirmed"`) || !strings.Contains(logs, "rid="+pinned) {
		t.Errorf("the watchdog's log does not confirm the release of %s", pinned)
	}
	// The watchdog's released count agrees with SGLang's own counter.
	sglangFailed := sumSamples(t, getText(t, srv.control+"/metrics"), "sglang:num_transfer_failed_reqs_total")
	if released != sglangFailed {
		t.Errorf("sglang_watchdog_force_fails_total{result=\"released\"} %v, SGLang's num_transfer_failed_reqs_total %v", released, sglangFailed)
	}
	t.Logf("%s: %d passes of SGLang's inflight pass, %s in all", backend, st.Passes, time.Since(started).Round(10*time.Millisecond))
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
