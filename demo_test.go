package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// The demo's exit status must fail when a decode force-fail freed pages
// that prefill still writes into: run a stuck handle's decode request
// through the simulator, release it with and without a (false)
// prefill_stopped, and read the demo's decode summary.
func TestDemoDecodeSummaryFailsOnUnsafeFree(t *testing.T) {
	for _, tc := range []struct {
		name        string
		assertStop  bool
		wantUnsafe  bool
		wantSummary string
	}{
		{"held", false, false, "still held"},
		{"freed under a live transfer", true, true, "pages freed under a live transfer by a force-fail: 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := clock.NewFake(time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC))
			sim, err := sglangsim.New(sglangsim.Options{Clock: c, Era: sglangsim.EraNewest, Backend: sglangsim.BackendNIXL, Token: demoToken})
			if err != nil {
				t.Fatal(err)
			}
			rid, room := sim.Inject(0, sglangsim.PinStuckHandle)
			step := func(d time.Duration) {
				for end := c.Now().Add(d); c.Now().Before(end); {
					c.Advance(100 * time.Millisecond)
					sim.Step()
				}
			}
			step(5 * time.Second)
			st, resp := sim.DecodeForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid, BootstrapRoom: &room, PrefillStopped: tc.assertStop}, "Bearer "+demoToken)
			if tc.assertStop != (st == 200) {
				t.Fatalf("decode force-fail: %d %+v", st, resp)
			}
			// New requests take the freed slot, so that a late write lands.
			for i := 0; i < 10; i++ {
				step(5 * time.Second)
				sim.Submit(sglangsim.RequestSpec{Transfer: time.Second})
			}
			dwd, err := watchdog.New(watchdog.Config{Clock: c, Interval: time.Second, Deadline: demoDeadline, DecodeDeadline: demoDecodeDeadline,
				StallWindow: demoStallWindow, PinWindow: demoPinWindow, MaxRooms: 100, Mode: watchdog.ModeOff, ConfirmTimeout: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			n := &narrator{out: &out, start: time.Now(), sim: sim, pins: map[string]string{rid: "stuck handle"}, pinRooms: map[uint64]bool{room: true},
				verdicts: map[uint64]pluginapi.RoomVerdict{}}
			bad := decodeSummary(sim, dwd, n, c.Now())
			if (bad > 0) != tc.wantUnsafe || !strings.Contains(out.String(), tc.wantSummary) {
				t.Errorf("decodeSummary = %d, want unsafe %v; summary:\n%s", bad, tc.wantUnsafe, out.String())
			}
		})
	}
}

// The terminal shows the narration alone: every line of stdout is a
// narrated line, and the watchdogs' log lines go to the file whose path
// the demo prints. --demo.logs=- puts them back on stderr.
func TestDemoNarrationAloneOnTheTerminal(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "demo.log")
	var out, errb bytes.Buffer
	run([]string{"demo", "--demo.duration=4s", "--demo.logs=" + logFile}, &out, &errb)
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	for _, l := range lines {
		if !strings.HasPrefix(l, "[") || strings.Contains(l, "level=") {
			t.Errorf("stdout line not narrated: %q", l)
		}
	}
	if !strings.Contains(out.String(), "logs:      the watchdogs' own log lines go to "+logFile) {
		t.Errorf("the demo does not print where its logs go:\n%s", out.String())
	}
	if strings.Contains(errb.String(), "level=") {
		t.Errorf("log lines on stderr:\n%s", errb.String())
	}
	b, err := os.ReadFile(logFile)
	if err != nil || !strings.Contains(string(b), "level=") {
		t.Errorf("log file %v:\n%s", err, b)
	}

	out.Reset()
	errb.Reset()
	run([]string{"demo", "--demo.duration=3s", "--demo.logs=-"}, &out, &errb)
	if !strings.Contains(errb.String(), "level=") || strings.Contains(out.String(), "level=") || strings.Contains(out.String(), "logs: ") {
		t.Errorf("--demo.logs=-: want the log lines on stderr only; stdout:\n%s\nstderr:\n%.500s", out.String(), errb.String())
	}
}
