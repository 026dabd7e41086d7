package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// simServer starts the simulator on loopback with its scheduler loops
// running in real time on clk.
func simServer(t *testing.T, opts sglangsim.Options) (*sglangsim.Sim, string, []string) {
	t.Helper()
	sim, err := sglangsim.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	sim.Start(ctx)
	metricsURL, pluginURLs, err := sim.Listen(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return sim, metricsURL, pluginURLs
}

// watchdogFromArgs builds the watchdog exactly as the run command does,
// from command-line arguments, then puts it on clk.
func watchdogFromArgs(t *testing.T, clk clock.Clock, args ...string) *watchdog.Watchdog {
	wd, _ := watchdogAndOptions(t, clk, args...)
	return wd
}

func watchdogAndOptions(t *testing.T, clk clock.Clock, args ...string) (*watchdog.Watchdog, *options) {
	t.Helper()
	var o options
	if _, err := newApp(&o).Parse(append([]string{"run"}, args...)); err != nil {
		t.Fatal(err)
	}
	cfg, err := watchdogConfig(&o, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	cfg.Clock = clk
	wd, err := watchdog.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return wd, &o
}

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

// TestEndToEndReleasesEveryPinAndNoProgressingRequest runs the run
// command's wiring against the simulator over loopback HTTP, on a fake
// clock: every pin mechanism is released within deadline + 3 intervals,
// and no progressing request is ever force-failed over thousands of healthy
// requests with a heavy tail and slow-but-progressing transfers.
func TestEndToEndReleasesEveryPinAndNoProgressingRequest(t *testing.T) {
	for _, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			clk := clock.NewFake(time.Now())
			sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{
				Clock: clk, DPSize: 2, Era: sglangsim.EraV05, Backend: backend, Seed: 7,
				ArrivalRate: 20, TransferMedian: 400 * time.Millisecond, SlowFraction: 0.02,
				HealthCheckEvery: 10 * time.Second,
			})
			wd := watchdogFromArgs(t, clk, append(pluginArgs(pluginURLs),
				"--sglang.metrics-url="+metricsURL, "--force-fail.mode=auto", "--force-fail.max-per-minute=30")...)
			sim.Submit(sglangsim.RequestSpec{Rank: 1, Behavior: sglangsim.BehaviorStuckHealthCheck})

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
				if r.ProgressingWhenForced {
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
			if got := s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}]; got < 3 {
				t.Errorf("watchdog confirmed %d releases, want at least 3", got)
			}
			t.Logf("%d healthy requests completed, %d force-fails confirmed", healthy, s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}])
		})
	}
}

// TestInflightAndForceFailCommands drives the operator commands against the
// simulator's parity scenario.
func TestInflightAndForceFailCommands(t *testing.T) {
	clk := clock.NewFake(time.Now())
	_, _, pluginURLs := simServer(t, sglangsim.Options{Clock: clk, Scenario: sglangsim.ScenarioParity})
	time.Sleep(10 * time.Millisecond)

	var out, errb bytes.Buffer
	if code := run([]string{"inflight", "--plugin.url=" + pluginURLs[0]}, &out, &errb); code != 0 {
		t.Fatalf("inflight exit %d: %s", code, errb.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 5 || !strings.Contains(lines[1], "HEALTH_CHECK") || !strings.Contains(lines[2], "pinned-0001") || !strings.Contains(lines[3], "healthy-0002") {
		t.Fatalf("inflight table not sorted oldest first:\n%s", out.String())
	}
	out.Reset()
	if code := run([]string{"inflight", "--plugin.url=" + pluginURLs[0], "--output=json"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "18446744073709551557") {
		t.Fatalf("inflight json exit %d lost the 64-bit room:\n%s", code, out.String())
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
		out.Reset()
		errb.Reset()
		args := append([]string{"force-fail", "--plugin.url=" + pluginURLs[0]}, tc.args...)
		if code := run(args, &out, &errb); code != tc.code || !strings.Contains(out.String(), tc.want) {
			t.Errorf("%v: exit %d, output %q %q; want exit %d and %q", tc.args, code, out.String(), errb.String(), tc.code, tc.want)
		}
	}

	errb.Reset()
	if code := run([]string{"force-fail", "--rid=x", "--plugin.url=http://10.1.2.3:30100"}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "not a loopback") {
		t.Errorf("a remote plugin URL was accepted: exit %d %s", code, errb.String())
	}
}

func TestConfigErrorsAreClear(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--plugin.timeout=2s"}, "--plugin.timeout (2s) must be shorter than --watchdog.interval (1s)"},
		{[]string{"--sglang.timeout=20s"}, "--sglang.timeout (20s) must be shorter"},
		{[]string{"--plugin.url=http://192.0.2.1:30100"}, "not a loopback address"},
		{[]string{"--plugin.token-file=/nonexistent/token"}, "reading token file"},
	} {
		var o options
		if _, err := newApp(&o).Parse(append([]string{"run"}, tc.args...)); err != nil {
			t.Fatal(err)
		}
		_, err := watchdogConfig(&o, log.NewNopLogger())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: err = %v, want %q", tc.args, err, tc.want)
		}
	}
}

func TestVersionFlag(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--version"}, &out, &out); code != 0 || !strings.HasPrefix(out.String(), appName+", version") {
		t.Fatalf("--version: exit %d, %q", code, out.String())
	}
}
