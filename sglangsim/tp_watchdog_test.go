package sglangsim_test

import (
	"context"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/bench/simplugin"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// TestTPNonLeaderWriteHoldsDecode runs the real watchdog over prefill and
// decode of a TP2 deployment where room B waits on the leader behind a
// handle hung there while the other rank hangs on B's own chunk. The
// watchdog diagnoses the leader's wedge and fails B through the leader
// (nothing of B in flight there), so SGLang releases B on both ranks and
// the other rank's chunk keeps writing. With round 5 the listing shows
// that chunk, the verdict is never "stopped" and decode frees no page
// under it; the leader-only view (what the watchdog read through round 4)
// gets "stopped" and a late write corrupts the next request: the
// regression the test guards against.
func TestTPNonLeaderWriteHoldsDecode(t *testing.T) {
	for _, leaderOnly := range []bool{false, true} {
		name := map[bool]string{false: "round 5", true: "leader-only view"}[leaderOnly]
		t.Run(name, func(t *testing.T) {
			c := clock.NewFake(time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC))
			sim, err := sglangsim.New(sglangsim.Options{Clock: c, Era: sglangsim.EraNewest, Backend: sglangsim.BackendNIXL,
				HookRunsWhenEmpty: true, AttnTP: 2, LeaderOnlyView: leaderOnly})
			if err != nil {
				t.Fatal(err)
			}
			cfg := watchdog.Config{Clock: c, Logger: log.NewNopLogger(), Interval: time.Second, MetricsInterval: 15 * time.Second,
				Deadline: 60 * time.Second, DecodeDeadline: watchdog.DefaultDecodeDeadline, StallWindow: 30 * time.Second,
				PinWindow: 2 * time.Minute, MaxRooms: 100000, Mode: watchdog.ModeAuto, MaxPerMinute: 6, ConfirmTimeout: time.Minute,
				FailFast: true, FailFastPerMinute: 180,
				// The hung link showed one chunk (171 pages in 2 s): at
				// the shipped margin its allowance, 400 s, would let
				// decode's own 300 s timeout end the scene before the
				// prefill release this test is about.
				LinkMargin: 20}
			for _, p := range simplugin.New(sim, true) {
				p.Live = true
				cfg.Plugins = append(cfg.Plugins, p)
			}
			for _, d := range simplugin.NewDecode(sim) {
				cfg.Plugins = append(cfg.Plugins, d)
			}
			cfg.OnEvent = func(e watchdog.Event) {
				t.Logf("%s %s %s %s %s room %d age %.0f poll %s", e.Kind, e.Trigger, e.Result, e.Reason, e.RID, e.Room, e.Age, e.Poll)
			}
			wd, err := watchdog.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			sim.Submit(sglangsim.RequestSpec{Behavior: sglangsim.BehaviorPinStuckHandle, PinTPRanks: []int{0}, DecodePort: 17001,
				Transfer: 2 * time.Second})
			var b string
			var room uint64
			ctx := context.Background()
			for step := 1; step <= 4000; step++ {
				c.Advance(100 * time.Millisecond)
				if step == 20 {
					b, room = sim.Submit(sglangsim.RequestSpec{Behavior: sglangsim.BehaviorPinStuckHandle, PinTPRanks: []int{1},
						DecodePort: 17001, Transfer: 2 * time.Second})
				}
				if step%50 == 0 {
					// Healthy requests keep taking decode pages, so a page
					// freed under a live write is handed on.
					sim.Submit(sglangsim.RequestSpec{DecodePort: 17003, Transfer: time.Second})
				}
				sim.Step()
				if step%10 == 0 {
					wd.RunCycle(ctx)
				}
			}
			var rec sglangsim.Record
			for _, r := range sim.Records() {
				if r.RID == b {
					rec = r
				}
			}
			if rec.Outcome != sglangsim.OutcomeFailedForced {
				t.Fatalf("B was not failed through the leader: %+v", rec)
			}
			byFF := 0
			for _, cr := range sim.Corruptions() {
				if cr.Cause == sglangsim.DecodeForceFail {
					byFF++
				}
			}
			v := wd.PrefillVerdict(pluginapi.VerdictQuery{Room: room, RID: b, AgeSeconds: 400})
			if leaderOnly {
				if rec.UnsafeFree != sglangsim.DecodeForceFail || byFF == 0 {
					t.Fatalf("the leader-only view did not show its hazard: record %+v, corruptions %+v", rec, sim.Corruptions())
				}
				return
			}
			if v.Verdict == pluginapi.VerdictStopped {
				t.Errorf("verdict %+v on a room the other rank still writes", v)
			}
			if rec.UnsafeFree == sglangsim.DecodeForceFail || byFF != 0 {
				t.Errorf("a decode force-fail freed pages the other rank still writes: record %+v, corruptions %+v", rec, sim.Corruptions())
			}
		})
	}
}
