package main

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// The tests of package main check the command and its wiring in process:
// flags, configuration errors, the HTTP handlers. The end-to-end tests,
// which build the binary and talk to it over HTTP, are in e2e/.

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

// parseRun parses the run command's arguments.
func parseRun(t *testing.T, args ...string) *options {
	t.Helper()
	var o options
	if _, err := newApp(&o).Parse(append([]string{"run"}, args...)); err != nil {
		t.Fatal(err)
	}
	return &o
}

// watchdogAndOptions builds the watchdog exactly as the run command does,
// from command-line arguments, then puts it on clk.
func watchdogAndOptions(t *testing.T, clk clock.Clock, args ...string) (*watchdog.Watchdog, *options) {
	t.Helper()
	o := parseRun(t, args...)
	cfg, err := watchdogConfig(o, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	cfg.Clock = clk
	wd, err := watchdog.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return wd, o
}

func pluginArgs(urls []string) []string {
	var args []string
	for _, u := range urls {
		args = append(args, "--plugin.url="+u)
	}
	return args
}

// step advances simulated time by one second in tenths, letting the
// scheduler loops take passes along the way, and runs one watch cycle.
func step(clk *clock.Fake, wd *watchdog.Watchdog) {
	for i := 0; i < 10; i++ {
		clk.Advance(100 * time.Millisecond)
		time.Sleep(2 * time.Millisecond)
	}
	wd.RunCycle(context.Background())
}

func tokenFile(t *testing.T, token string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(token+"\n"), 0o400); err != nil {
		t.Fatal(err)
	}
	return p
}
