package watchdog

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
)

// writeMode replaces the mode file the way the kubelet updates a mounted
// ConfigMap: the new content is written aside and a symlink is swapped
// over the path, so the path's own inode never changes content in place.
func writeMode(t *testing.T, path, content string) {
	t.Helper()
	dir := filepath.Dir(path)
	data, err := os.MkdirTemp(dir, "..data-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(data, "mode"), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	tmp := path + ".tmp"
	if err := os.Symlink(filepath.Join(data, "mode"), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func modeFileHarness(t *testing.T, logs *syncBuffer, mutate func(*Config)) (*harness, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "mode")
	h := newHarness(t, func(c *Config) {
		c.Mode, c.ModeFile, c.Logger = ModeDryRun, path, log.NewLogfmtLogger(logs)
		if mutate != nil {
			mutate(c)
		}
	})
	return h, path
}

// A stuck request is dry-run while the file says dry-run, force-failed on
// the cycle after the file says auto, and a request stuck after the file
// went back to dry-run is only dry-run again: no restart of anything.
func TestModeFileSwitchesOnTheNextCycle(t *testing.T) {
	var logs syncBuffer
	h, path := modeFileHarness(t, &logs, func(c *Config) { c.Mode = ModeAuto })
	writeMode(t, path, "dry-run\n")
	h.plugin.set(room("r1", 1, 0))
	h.tick(95)
	if h.plugin.callCount() != 1 || !h.plugin.calls[0].DryRun || h.wd.Mode() != ModeDryRun {
		t.Fatalf("calls %+v, mode %s: want one dry run under the file's dry-run, over the flag's auto", h.plugin.calls, h.wd.Mode())
	}
	writeMode(t, path, "  auto \n")
	h.tick(1)
	if h.plugin.callCount() != 2 || h.plugin.calls[1].DryRun {
		t.Fatalf("calls %+v: want a real call on the cycle after the switch", h.plugin.calls)
	}
	writeMode(t, path, "dry-run")
	h.plugin.set(room("r2", 2, 0))
	h.tick(95)
	if h.plugin.callCount() != 3 || !h.plugin.calls[2].DryRun {
		t.Fatalf("calls %+v: want the second request dry-run only", h.plugin.calls)
	}
	s := h.wd.Snapshot()
	if s.Mode != ModeDryRun || s.ModeChanges != 3 || s.ModeFileErrors != 0 {
		t.Fatalf("mode %s, changes %d, errors %d; want dry-run, 3, 0", s.Mode, s.ModeChanges, s.ModeFileErrors)
	}
	if n := logs.count(`msg="mode changed" source=file`); n != 3 {
		t.Fatalf("%d change lines, want 3:\n%s", n, logs.b.String())
	}
	if logs.count(`force_fail_from=dry-run force_fail_to=auto`) != 1 {
		t.Fatalf("the switch to auto is not logged with old and new mode:\n%s", logs.b.String())
	}
}

// Content that is not a mode keeps the mode of the moment, is logged once
// per distinct content and counted on every read; a missing file gives
// the flag's mode back, logged once.
func TestModeFileInvalidAndMissing(t *testing.T) {
	var logs syncBuffer
	h, path := modeFileHarness(t, &logs, nil)
	h.tick(3)
	if h.wd.Mode() != ModeDryRun || logs.count(`msg="mode file absent: the flags' modes apply"`) != 1 {
		t.Fatalf("mode %s; logs:\n%s", h.wd.Mode(), logs.b.String())
	}
	writeMode(t, path, "auto")
	h.tick(1)
	writeMode(t, path, "Auto")
	h.tick(5)
	writeMode(t, path, "dryrun")
	h.tick(5)
	if h.wd.Mode() != ModeAuto {
		t.Fatalf("mode %s after invalid content, want auto kept", h.wd.Mode())
	}
	if n := logs.count(`msg="mode file unusable; keeping the current modes"`); n != 2 {
		t.Fatalf("%d error lines for 2 distinct bad contents, want 2:\n%s", n, logs.b.String())
	}
	if logs.count(`unknown force-fail mode \"Auto\"`) != 1 || logs.count("file="+path) < 2 {
		t.Fatalf("the error does not name the file and the content:\n%s", logs.b.String())
	}
	if got := h.wd.Snapshot().ModeFileErrors; got != 10 {
		t.Fatalf("mode file errors %d, want one per read (10)", got)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	h.tick(3)
	if h.wd.Mode() != ModeDryRun || logs.count(`msg="mode changed" source=flag`) != 1 || logs.count(`msg="mode file absent`) != 2 {
		t.Fatalf("mode %s after the file went away, want the flag's dry-run; logs:\n%s", h.wd.Mode(), logs.b.String())
	}
}

func TestModeFileReadAtStart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mode")
	if err := os.WriteFile(path, []byte("off\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig()
	cfg.Clock, cfg.ModeFile = clock.NewFake(time.Now()), path
	wd := newWatchdog(t, cfg, nil)
	if wd.Mode() != ModeOff || wd.Snapshot().ModeChanges != 1 {
		t.Fatalf("mode %s, changes %d; want the file's off before the first cycle", wd.Mode(), wd.Snapshot().ModeChanges)
	}
}

// The restart escalation runs at most in the file's mode, never above its
// own flag; a dry run for a process leaves room for one real restart of it
// once the file says auto.
func TestModeFileCapsRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mode")
	writeMode(t, path, "dry-run")
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	h := newMulti(t, []*fakePlugin{p}, func(c *Config) {
		c.Mode, c.ModeFile = ModeAuto, path
		c.RestartMode, c.RestartMinInterval = ModeAuto, time.Minute
	})
	if s := h.wd.Snapshot(); s.RestartMode != ModeDryRun {
		t.Fatalf("restart mode %s under a dry-run file, want dry-run", s.RestartMode)
	}
	h.tick(120)
	if p.restartCount() != 1 || !p.restarts[0].DryRun {
		t.Fatalf("restarts %+v, want one dry run", p.restarts)
	}
	writeMode(t, path, "auto")
	h.tick(2)
	if p.restartCount() != 2 || p.restarts[1].DryRun || p.restarts[1].PID != 7 {
		t.Fatalf("restarts %+v, want a real restart after the switch to auto", p.restarts)
	}

	// A file in auto does not raise a restart flag of dry-run.
	q := wedgedRank("http://127.0.0.1:28100", 0, 9)
	h = newMulti(t, []*fakePlugin{q}, func(c *Config) {
		c.Mode, c.ModeFile = ModeDryRun, path
		c.RestartMode, c.RestartMinInterval = ModeDryRun, time.Minute
	})
	h.tick(120)
	if s := h.wd.Snapshot(); s.Mode != ModeAuto || s.RestartMode != ModeDryRun || q.restartCount() != 1 || !q.restarts[0].DryRun {
		t.Fatalf("modes %s/%s, restarts %+v; want auto, dry-run and one dry run", s.Mode, s.RestartMode, q.restarts)
	}
}

func TestReadModeFile(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		content string
		want    Mode
		err     string
	}{
		{"auto", ModeAuto, ""},
		{"\n\toff \r\n", ModeOff, ""},
		{"dry-run\n", ModeDryRun, ""},
		{"", "", `unknown force-fail mode ""`},
		{"auto\nauto", "", `unknown force-fail mode "auto\nauto"`},
		{string(make([]byte, 200)), "", "more than 64 bytes"},
	} {
		path := filepath.Join(dir, "mode")
		if err := os.WriteFile(path, []byte(tc.content), 0o644); err != nil {
			t.Fatal(err)
		}
		m, exists, err := ReadModeFile(path)
		if !exists || m != tc.want || (err == nil) != (tc.err == "") || (err != nil && (!strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), path))) {
			t.Errorf("%q: %q, %v, %v; want %q, error %q naming the file", tc.content, m, exists, err, tc.want, tc.err)
		}
	}
	if m, exists, err := ReadModeFile(filepath.Join(dir, "none")); exists || m != "" || err != nil {
		t.Errorf("missing file: %q, %v, %v; want no file and no error", m, exists, err)
	}
}
