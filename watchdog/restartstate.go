package watchdog

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/go-kit/log/level"
)

// The restart interval is for the pod, but the watchdog is a sidecar that
// may itself crash-loop: kept in memory only, a watchdog restarted 2.5
// minutes after it restarted SGLang would find the wedge again (the new
// server wedged on the same peer) and restart SGLang again. With
// RestartStateFile, the time of the last restart request lives in a file on
// a volume that outlives the container (an emptyDir outlives container
// restarts, not the pod).

// restartState is the content of the state file.
type restartState struct {
	// LastRestart is when this pod's watchdog last asked a plugin to end
	// its server (auto mode), written before the call; null: never.
	LastRestart *time.Time `json:"last_restart"`
	PID         int        `json:"pid,omitempty"`
}

// loadRestartState reads the time of the last restart from path. A missing
// file is no restart. A file that cannot be parsed, or a time in the future
// (a clock that jumped back), counts as a restart now: a damaged state file
// must delay a restart, never allow one early.
func (w *Watchdog) loadRestartState(path string) error {
	now := w.clock.Now()
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("restart state file: %w", err)
	}
	var s restartState
	if err := json.Unmarshal(b, &s); err != nil {
		level.Error(w.logger).Log("msg", "restart state file unreadable; counting a restart now, so the next one waits a full interval", "file", path, "err", err)
		w.lastRestart = now
		return nil
	}
	if s.LastRestart == nil {
		return nil
	}
	w.lastRestart = *s.LastRestart
	if w.lastRestart.After(now) {
		w.lastRestart = now
	}
	if now.Sub(w.lastRestart) < w.cfg.RestartMinInterval {
		level.Info(w.logger).Log("msg", "restart interval carried over from the state file", "file", path, "last_restart", *s.LastRestart, "pid", s.PID,
			"next_restart_allowed", w.lastRestart.Add(w.cfg.RestartMinInterval))
	}
	return nil
}

// stateOf is the state file's content for a last restart at t (zero:
// never).
func stateOf(t time.Time, pid int) restartState {
	if t.IsZero() {
		return restartState{}
	}
	return restartState{LastRestart: &t, PID: pid}
}

// saveRestartState records a restart request before it is made: written
// to a temporary file in the same directory, synced and renamed over the
// old one, so that a crash leaves either the old state or the new one.
func saveRestartState(path string, s restartState) error {
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("restart state file: %w", err)
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("restart state file: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("restart state file: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("restart state file: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("restart state file: %w", err)
	}
	return nil
}
