package watchdog

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
)

func autoRestart(state string) func(*Config) {
	return func(c *Config) {
		c.Mode = ModeOff
		c.RestartMode, c.RestartMinInterval, c.RestartStateFile = ModeAuto, 30*time.Minute, state
	}
}

// wantRestartAfter checks that p is restarted once after about wait, not
// a minute before it.
func wantRestartAfter(t *testing.T, h *multi, p *fakePlugin, wait time.Duration) {
	t.Helper()
	h.tick(int((wait - time.Minute).Seconds()))
	if n := p.restartCount(); n != 0 {
		t.Fatalf("restarted %d times a minute before the interval ends", n)
	}
	h.tick(120)
	if n := p.restartCount(); n != 1 {
		t.Fatalf("restarts %d a minute after the interval ends, want 1", n)
	}
}

// A watchdog that crash-loops must not restart SGLang again before the
// interval is over: the second watchdog reads the first one's restart
// from the state file. Without the file it would restart at once.
func TestRestartIntervalSurvivesAWatchdogRestart(t *testing.T) {
	state := filepath.Join(t.TempDir(), "restart-state.json")
	first := wedgedRank("http://127.0.0.1:28100", 0, 7)
	h := newMulti(t, []*fakePlugin{first}, autoRestart(state))
	h.tick(62)
	if first.restartCount() != 1 {
		t.Fatalf("restarts %d, want 1", first.restartCount())
	}
	var s restartState
	if b, err := os.ReadFile(state); err != nil || json.Unmarshal(b, &s) != nil || s.LastRestart == nil || s.PID != 7 {
		t.Fatalf("state file %+v, %v; want the restart of pid 7", s, err)
	}

	// The new server wedges again; the watchdog restarted meanwhile.
	again := wedgedRank("http://127.0.0.1:28100", 0, 8)
	wantRestartAfter(t, newMulti(t, []*fakePlugin{again}, autoRestart(state)), again, 30*time.Minute)

	control := wedgedRank("http://127.0.0.1:28100", 0, 9)
	h3 := newMulti(t, []*fakePlugin{control}, autoRestart(""))
	h3.tick(62)
	if control.restartCount() != 1 {
		t.Fatalf("without a state file: restarts %d, want 1 (the behaviour the file prevents)", control.restartCount())
	}
}

// The interval counts from the recorded time, not from the watchdog's
// start.
func TestRestartStateFileCountsFromTheRecordedTime(t *testing.T) {
	state := filepath.Join(t.TempDir(), "restart-state.json")
	at := time.Now().Add(-25 * time.Minute).UTC()
	if err := os.WriteFile(state, []byte(`{"last_restart":"`+at.Format(time.RFC3339Nano)+`","pid":3}`), 0o600); err != nil {
		t.Fatal(err)
	}
	p := wedgedRank("http://127.0.0.1:28100", 0, 7)
	wantRestartAfter(t, newMulti(t, []*fakePlugin{p}, autoRestart(state)), p, 5*time.Minute)
}

// A damaged state file delays a restart by a full interval; it never
// allows one early. A path that cannot be written fails at start.
func TestRestartStateFileFailsClosed(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{"garbage": "not json", "future": `{"last_restart":"2999-01-01T00:00:00Z"}`} {
		t.Run(name, func(t *testing.T) {
			state := filepath.Join(dir, name)
			if err := os.WriteFile(state, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
			p := wedgedRank("http://127.0.0.1:28100", 0, 7)
			wantRestartAfter(t, newMulti(t, []*fakePlugin{p}, autoRestart(state)), p, 30*time.Minute)
		})
	}
	t.Run("unwritable", func(t *testing.T) {
		cfg := testConfig()
		cfg.Clock = clock.NewFake(time.Now())
		autoRestart(filepath.Join(dir, "missing", "state"))(&cfg)
		if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "restart state file") {
			t.Fatalf("New: %v, want a restart state file error", err)
		}
	})
}
