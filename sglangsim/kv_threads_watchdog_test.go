package sglangsim_test

import (
	"context"
	"testing"
	"time"

	"github.com/go-kit/log"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sglang-watchdog/sglang-watchdog/bench/simplugin"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// TestWatchdogFailsTheRoomsOfADeadTransferWorker runs the real watchdog in
// auto mode over a prefill rank whose transfer worker of queue 1 died
// (issue 24): the two rooms queued there are never sent, so it fails them
// once past the deadline, and exports the dead thread. On queue 2 of the
// same rank a slow transfer moves a chunk every 5 s for 150 s with a
// healthy room queued behind it: both complete, untouched.
func TestWatchdogFailsTheRoomsOfADeadTransferWorker(t *testing.T) {
	c := clock.NewFake(time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC))
	sim, err := sglangsim.New(sglangsim.Options{Clock: c, Era: sglangsim.EraNewest, Backend: sglangsim.BackendMooncake, HookRunsWhenEmpty: true})
	if err != nil {
		t.Fatal(err)
	}
	cfg := watchdog.Config{Clock: c, Logger: log.NewNopLogger(), Interval: time.Second, MetricsInterval: 15 * time.Second,
		Deadline: 60 * time.Second, DecodeDeadline: watchdog.DefaultDecodeDeadline, StallWindow: 30 * time.Second,
		PinWindow: 2 * time.Minute, MaxRooms: 100000, Mode: watchdog.ModeAuto, MaxPerMinute: 6, ConfirmTimeout: time.Minute,
		FailFast: true, FailFastPerMinute: 180, LinkMargin: watchdog.DefaultLinkMargin}
	for _, p := range simplugin.New(sim, true) {
		p.Live = true
		cfg.Plugins = append(cfg.Plugins, p)
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := sim.KillTransferWorker(0, 1); err != nil {
		t.Fatal(err)
	}
	// Decode ports 17001 and 17005 take queue 1, 17002 and 17006 queue 2.
	stranded := map[string]bool{}
	for _, port := range []int{17001, 17005} {
		rid, _ := sim.Submit(sglangsim.RequestSpec{DecodePort: port, PromptTokens: 2048, Transfer: time.Second})
		stranded[rid] = true
	}
	slow, _ := sim.Submit(sglangsim.RequestSpec{Behavior: sglangsim.BehaviorSlow, DecodePort: 17002, PromptTokens: 30 * 1024,
		Transfer: 150 * time.Second, ChunkEvery: 5 * time.Second})
	behind, _ := sim.Submit(sglangsim.RequestSpec{DecodePort: 17006, PromptTokens: 2048, Transfer: time.Second})
	ctx := context.Background()
	for step := 1; step <= 2000; step++ {
		c.Advance(100 * time.Millisecond)
		sim.Step()
		if step%10 == 0 {
			wd.RunCycle(ctx)
		}
		if step == 550 {
			for _, r := range sim.Records() {
				if !r.ForcedAt.IsZero() {
					t.Fatalf("%s force-failed at %s, before the 60 s deadline", r.RID, r.ForcedAt)
				}
			}
		}
	}
	seen := 0
	for _, r := range sim.Records() {
		switch {
		case stranded[r.RID]:
			seen++
			if r.Outcome != sglangsim.OutcomeFailedForced || r.ProgressingWhenForced {
				t.Errorf("stranded room %s: %+v, want force-failed", r.RID, r)
			}
		case r.RID == slow || r.RID == behind:
			seen++
			if r.Outcome != sglangsim.OutcomeSuccess || !r.ForcedAt.IsZero() {
				t.Errorf("room %s on the live queue: %+v, want it to complete untouched", r.RID, r)
			}
		}
	}
	if seen != 4 {
		t.Fatalf("%d of the 4 rooms recorded", seen)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(collector.NewExporter(wd.Snapshot))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	dead := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "sglang_watchdog_kv_threads_dead" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "thread" {
					dead[lp.GetValue()] += m.GetGauge().GetValue()
				}
			}
		}
	}
	if len(dead) != 5 || dead["transfer_worker"] != 1 || dead["bootstrap"] != 0 {
		t.Fatalf("sglang_watchdog_kv_threads_dead by thread %v, want transfer_worker 1 and the rest 0", dead)
	}
}
