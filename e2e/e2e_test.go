// Package e2e holds the end-to-end tests: they build the sglang-watchdog
// binary and drive it over HTTP, against the simulator, the real Python
// plugin, and the real Prometheus and Alertmanager.
package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// binary is the sglang-watchdog command built for this run.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sglang-watchdog-e2e")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "sglang-watchdog")
	if out, err := exec.Command("go", "build", "-o", binary, "..").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// repoRoot is where the tests find the repository's files.
const repoRoot = ".."

// simServer starts the simulator on loopback with its scheduler loops
// running in real time on clk.
func simServer(t *testing.T, opts sglangsim.Options) (*sglangsim.Sim, string, []string) {
	t.Helper()
	sim, ctx := startSim(t, opts)
	metricsURL, pluginURLs, err := sim.Listen(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return sim, metricsURL, pluginURLs
}

// startSim starts the simulator's scheduler loops; they and whatever listens
// on the returned context stop when the test ends.
func startSim(t *testing.T, opts sglangsim.Options) (*sglangsim.Sim, context.Context) {
	t.Helper()
	sim, err := sglangsim.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	sim.Start(ctx)
	return sim, ctx
}

// inProcessWatchdog builds the watchdog from its packages with the run
// command's default flags (docs/configuration.md, "Flags"), for the tests that need a
// fake clock and so cannot run the binary.
func inProcessWatchdog(t *testing.T, clk clock.Clock, metricsURL string, pluginURLs []string, mode watchdog.Mode, maxPerMinute int) *watchdog.Watchdog {
	t.Helper()
	cfg := watchdog.Config{
		Clock: clk, Logger: nopLogger{}, Interval: time.Second, MetricsInterval: 15 * time.Second,
		Deadline: 60 * time.Second, StallWindow: 30 * time.Second, PinWindow: 2 * time.Minute, MaxRooms: 100000,
		Mode: mode, MaxPerMinute: maxPerMinute, ConfirmTimeout: 60 * time.Second,
		Metrics: collector.NewMetricsScraper(metricsURL, 5*time.Second),
	}
	for _, u := range pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: 800 * time.Millisecond, AdminTimeout: 7 * time.Second}))
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return wd
}

type nopLogger struct{}

func (nopLogger) Log(...interface{}) error { return nil }

func pluginArgs(urls []string) []string {
	var args []string
	for _, u := range urls {
		args = append(args, "--plugin.url="+u)
	}
	return args
}

// step advances simulated time by one interval in tenths, letting the
// scheduler loops take passes along the way (so that requests enter the
// inflight queue at distinct times, as they do on a real server), and runs
// one watch cycle.
func step(clk *clock.Fake, wd *watchdog.Watchdog, second int) {
	for i := 0; i < 10; i++ {
		clk.Advance(100 * time.Millisecond)
		time.Sleep(2 * time.Millisecond)
	}
	if second%15 == 0 {
		wd.ScrapeMetrics(context.Background())
	}
	wd.RunCycle(context.Background())
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func waitFor(t *testing.T, what string, timeout time.Duration, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if ok() {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("timed out after %s waiting for %s", timeout, what)
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func tokenFile(t *testing.T, token string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(token+"\n"), 0o400); err != nil {
		t.Fatal(err)
	}
	return p
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// syncBuffer collects a process's output for concurrent readers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// runBinary runs one command of the binary to its end.
func runBinary(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return exit.ExitCode(), stdout.String(), stderr.String()
	case err != nil:
		t.Fatal(err)
	}
	return 0, stdout.String(), stderr.String()
}

// watchdogProc is the binary's run command, started for one test.
type watchdogProc struct {
	base string
	port int
	logs *syncBuffer
	cmd  *exec.Cmd
}

// startWatchdog runs the binary on a free loopback port with args, waits
// until it serves /-/healthy, and stops it (SIGTERM, by its PID) when the
// test ends.
func startWatchdog(t *testing.T, args ...string) *watchdogProc {
	t.Helper()
	return startWatchdogAt(t, "127.0.0.1", freePort(t), args...)
}

// startWatchdogAt is startWatchdog on host:port, as the sidecars of the
// nodes of one instance each listen on their own node's address.
func startWatchdogAt(t *testing.T, host string, port int, args ...string) *watchdogProc {
	t.Helper()
	p := &watchdogProc{port: port, logs: &syncBuffer{}}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	p.base = "http://" + addr
	p.cmd = exec.Command(binary, append([]string{"--web.listen-address=" + addr}, args...)...)
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("watchdog log (last 3000 bytes):\n%s", tail([]byte(p.logs.String()), 3000))
		}
	})
	waitHealthy(t, p.base)
	return p
}

// waitHealthy waits until the watchdog at base serves /-/healthy.
func waitHealthy(t *testing.T, base string) {
	t.Helper()
	waitFor(t, "the watchdog serving /-/healthy at "+base, 20*time.Second, func() bool {
		resp, err := http.Get(base + "/-/healthy")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

func (p *watchdogProc) stop() {
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// metrics returns the binary's /metrics exposition.
func (p *watchdogProc) metrics(t *testing.T) string {
	t.Helper()
	resp, err := http.Get(p.base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// has reports whether the exposition holds the sample line exactly.
func (p *watchdogProc) has(t *testing.T, line string) bool {
	return strings.Contains("\n"+p.metrics(t), "\n"+line+"\n")
}

// TestEndToEndReleasesEveryPinAndNoProgressingRequest runs the watchdog's
// packages with the run command's defaults against the simulator over
// loopback HTTP, on a fake clock (so it cannot drive the binary): every pin mechanism is released within deadline + 3 intervals,
// and no progressing request is ever force-failed over thousands of healthy
// requests with a heavy tail, nor one slow healthy transfer (120 s, twice
// the deadline, on a transfer queue of its own) whose listed progress
// stands still, as on SGLang: the watchdog judges it by its transfer
// worker.
func TestEndToEndReleasesEveryPinAndNoProgressingRequest(t *testing.T) {
	for _, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			clk := clock.NewFake(time.Now())
			sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{
				Clock: clk, DPSize: 2, Era: sglangsim.EraV05, Backend: backend, Seed: 7,
				ArrivalRate: 20, TransferMedian: 50 * time.Millisecond,
				HealthCheckEvery: 10 * time.Second,
				// Queues 0-2 for the traffic and the pins; queue 3 for the slow transfer.
				DecodePorts: []int{17000, 17001, 17002},
			})
			wd := inProcessWatchdog(t, clk, metricsURL, pluginURLs, watchdog.ModeAuto, 30)
			sim.Submit(sglangsim.RequestSpec{Rank: 1, Behavior: sglangsim.BehaviorStuckHealthCheck})
			slow, _ := sim.Submit(sglangsim.RequestSpec{Rank: 1, Behavior: sglangsim.BehaviorSlow, Transfer: 120 * time.Second, DecodePort: 17003})

			const seconds = 240
			for s := 1; s <= seconds; s++ {
				switch s {
				case 10:
					sim.Inject(0, sglangsim.PinResurrection)
				case 40:
					sim.Inject(1, sglangsim.PinAbortBeforeRegister)
				case 70:
					sim.Inject(0, sglangsim.PinStuckHandle)
				}
				step(clk, wd, s)
			}

			deadline := 60*time.Second + 3*time.Second
			var healthy, pins int
			for _, r := range sim.Records() {
				switch r.Kind {
				case sglangsim.KindPinResurrection, sglangsim.KindPinAbortBeforeRegister, sglangsim.KindPinStuckHandle:
					pins++
					if r.Outcome != sglangsim.OutcomeFailedForced {
						t.Errorf("%s pin %s not released: outcome %s", r.Kind, r.RID, r.Outcome)
						continue
					}
					if took := r.Left.Sub(r.EnteredInflight); took > deadline {
						t.Errorf("%s pin %s released after %s, want <= %s", r.Kind, r.RID, took, deadline)
					}
				case sglangsim.KindHealthy, sglangsim.KindSlow:
					if r.Outcome == sglangsim.OutcomeSuccess {
						healthy++
					}
				case sglangsim.KindHealthCheck:
					if !r.ForcedAt.IsZero() {
						t.Errorf("health check %s was force-failed", r.RID)
					}
				}
				if r.ProgressingWhenForced || (r.RID == slow && !r.ForcedAt.IsZero()) {
					t.Errorf("force-failed a progressing request: %+v", r)
				}
			}
			if pins != 3 {
				t.Fatalf("%d pins recorded, want 3", pins)
			}
			if healthy < 2000 {
				t.Fatalf("only %d healthy requests completed; the test needs at least 2000", healthy)
			}
			s := wd.Snapshot()
			// The stuck handle's pin is released by its queue's wedge order.
			released := s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}] + s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerFailFast}]
			if released < 3 {
				t.Errorf("watchdog confirmed %d releases, want at least 3", released)
			}
			t.Logf("%d healthy requests completed, %d force-fails confirmed", healthy, released)
		})
	}
}

// TestInflightAndForceFailCommands drives the operator commands of the
// binary against the simulator's parity scenario.
func TestInflightAndForceFailCommands(t *testing.T) {
	clk := clock.NewFake(time.Now())
	_, _, pluginURLs := simServer(t, sglangsim.Options{Clock: clk, Scenario: sglangsim.ScenarioParity})
	time.Sleep(10 * time.Millisecond)

	code, out, errb := runBinary(t, "inflight", "--plugin.url="+pluginURLs[0])
	if code != 0 {
		t.Fatalf("inflight exit %d: %s", code, errb)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 7 || !strings.Contains(lines[0], "KIND") || !strings.Contains(lines[1], "pinned-0001") || !strings.Contains(lines[2], "healthy-0002") ||
		!strings.Contains(lines[3], "HEALTH_CHECK_") || !strings.Contains(lines[4], sglangsim.ParityWarmupRID+" ") ||
		!strings.Contains(lines[4], "HEALTH_CHECK ") || !strings.Contains(lines[6], "never force-failed") {
		t.Fatalf("inflight table not sorted oldest first with the health check last and marked:\n%s", out)
	}
	if code, out, _ := runBinary(t, "inflight", "--plugin.url="+pluginURLs[0], "--output=json"); code != 0 || !strings.Contains(out, "18446744073709551557") {
		t.Fatalf("inflight json exit %d lost the 64-bit room:\n%s", code, out)
	}

	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--rid=pinned-0001", "--room=9223372036854775001", "--dry-run"}, 0, "result=would_flip"},
		{[]string{"--rid=pinned-0001", "--room=1"}, 1, "result=room_mismatch"},
		{[]string{"--rid=nobody"}, 1, "result=not_found"},
		{[]string{"--rid=pinned-0001", "--room=9223372036854775001"}, 0, "result=flipped"},
	} {
		code, out, errb := runBinary(t, append([]string{"force-fail", "--plugin.url=" + pluginURLs[0]}, tc.args...)...)
		if code != tc.code || !strings.Contains(out, tc.want) {
			t.Errorf("%v: exit %d, output %q %q; want exit %d and %q", tc.args, code, out, errb, tc.code, tc.want)
		}
	}
	if code, _, errb := runBinary(t, "force-fail", "--rid=x", "--plugin.url=http://10.1.2.3:28100"); code != 2 || !strings.Contains(errb, "not a loopback") {
		t.Errorf("a remote plugin URL was accepted: exit %d %s", code, errb)
	}
}
