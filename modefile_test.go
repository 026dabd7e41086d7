package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// setModeFile rewrites a mode file as the kubelet rewrites a mounted
// ConfigMap key: new content in a new directory, then a symlink swapped
// over the path.
func setModeFile(t *testing.T, path, mode string) {
	t.Helper()
	data, err := os.MkdirTemp(filepath.Dir(path), "..data-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(data, "mode"), []byte(mode+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(data, "mode"), path+".swap"); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".swap", path); err != nil {
		t.Fatal(err)
	}
}

func forcedAt(sim *sglangsim.Sim, rid string) time.Time {
	for _, r := range sim.Records() {
		if r.RID == rid {
			return r.ForcedAt
		}
	}
	return time.Time{}
}

// TestModeFileSwitchesWithoutRestart: the run command's watchdog, flags
// and all, against the simulator. A stuck request is left alone (dry run
// only) while the mode file says dry-run, whatever --force-fail.mode says;
// after the file is rewritten to auto, the same process force-fails it;
// back at dry-run, the next stuck request is left alone again.
func TestModeFileSwitchesWithoutRestart(t *testing.T) {
	clk := clock.NewFake(time.Now())
	sim, _, pluginURLs := simServer(t, sglangsim.Options{Clock: clk})
	path := filepath.Join(t.TempDir(), "mode")
	setModeFile(t, path, "dry-run")
	wd, _ := watchdogAndOptions(t, clk, append([]string{"--sglang.metrics-url=off", "--force-fail.mode=auto",
		"--force-fail.mode-file=" + path}, pluginArgs(pluginURLs)...)...)

	first, _ := sim.Inject(0, sglangsim.PinResurrection)
	for s := 0; s < 100; s++ {
		step(clk, wd)
	}
	snap := wd.Snapshot()
	if !forcedAt(sim, first).IsZero() || snap.Mode != watchdog.ModeDryRun || snap.ForceFails[[2]string{watchdog.ResultWouldFlip, watchdog.TriggerAuto}] != 1 {
		t.Fatalf("dry-run file: forced at %v, mode %s, force-fails %v; want a dry run only", forcedAt(sim, first), snap.Mode, snap.ForceFails)
	}

	setModeFile(t, path, "auto")
	step(clk, wd)
	if forcedAt(sim, first).IsZero() {
		t.Fatal("the request was not force-failed on the cycle after the file said auto")
	}

	setModeFile(t, path, "dry-run")
	step(clk, wd)
	second, _ := sim.Inject(0, sglangsim.PinResurrection)
	for s := 0; s < 100; s++ {
		step(clk, wd)
	}
	snap = wd.Snapshot()
	if !forcedAt(sim, second).IsZero() || snap.ForceFails[[2]string{watchdog.ResultWouldFlip, watchdog.TriggerAuto}] != 2 {
		t.Fatalf("back at dry-run: forced at %v, force-fails %v; want the second request dry-run only", forcedAt(sim, second), snap.ForceFails)
	}
	if snap.Mode != watchdog.ModeDryRun || snap.ModeChanges != 3 {
		t.Fatalf("mode %s, changes %d; want dry-run after 3 changes (auto flag to dry-run file, auto, dry-run)", snap.Mode, snap.ModeChanges)
	}
}
