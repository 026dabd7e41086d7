package watchdog

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"

	"github.com/go-kit/log/level"
)

// The mode file switches the force-fail mode at run time, so that an SRE
// goes from auto back to dry-run (or off) during an incident without a
// change of the pod template, which would restart SGLang's pods and reload
// the model. It is read on every cycle and compared by content: Kubernetes
// updates a mounted ConfigMap by swapping a symlink, so neither the inode
// nor the path's mtime tells a change reliably.
//
// While the file holds a valid mode, it overrides the --force-fail.mode
// flag, and the restart escalation runs at most in that mode: a restart in
// auto while force-fail went back to dry-run would surprise whoever just
// stood the watchdog down. The file never raises the restart mode above
// its own flag. A missing file gives both flags' modes back; a file whose
// content is not a mode keeps the modes of the moment.

// Where a mode change came from, in the log.
const (
	ModeSourceFile = "file"
	ModeSourceFlag = "flag"
	// ModeSourceAPI: SetMode.
	ModeSourceAPI = "api"
)

// modeFileMax bounds a mode file's read: a mode is a few bytes, and a file
// that grew by mistake must not cost a large read on every cycle.
const modeFileMax = 64

// ReadModeFile reads a mode file: its mode, or exists false when there is
// no file. Content that is not a mode (whitespace trimmed) is an error
// naming it.
func ReadModeFile(path string) (m Mode, exists bool, err error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", false, nil
	}
	if err != nil {
		return "", true, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, modeFileMax+1))
	if err != nil {
		return "", true, err
	}
	if len(b) > modeFileMax {
		return "", true, fmt.Errorf("%s holds more than %d bytes; want one of off, dry-run or auto", path, modeFileMax)
	}
	content := strings.TrimSpace(string(b))
	m, err = ParseMode(content)
	if err != nil {
		return "", true, fmt.Errorf("%s: %w", path, err)
	}
	return m, true, nil
}

// modeFileState is what the watchdog remembers of its mode file, to log
// each distinct problem once.
type modeFileState struct {
	// absentLogged: the file's absence was logged, until it appears.
	absentLogged bool
	// lastErr is the last problem logged, "" after a valid read.
	lastErr string
	// errors counts the reads that found no valid mode (a file that
	// exists), for sglang_watchdog_mode_file_errors_total.
	errors uint64
}

// refreshMode reads the mode file, if configured, and applies it. Runs at
// the start of each cycle, so that a change takes effect on that cycle's
// decisions, through the same rails.
func (w *Watchdog) refreshMode() {
	path := w.cfg.ModeFile
	if path == "" {
		return
	}
	m, exists, err := ReadModeFile(path)
	w.mu.Lock()
	defer w.mu.Unlock()
	st := &w.modeFile
	switch {
	case err != nil:
		st.errors++
		if msg := err.Error(); msg != st.lastErr {
			st.lastErr = msg
			level.Error(w.logger).Log("msg", "mode file unusable; keeping the current modes", "file", path, "err", err,
				"force_fail_mode", w.mode, "restart_mode", w.restartMode)
		}
	case !exists:
		st.lastErr = ""
		if !st.absentLogged {
			st.absentLogged = true
			level.Info(w.logger).Log("msg", "mode file absent: the flags' modes apply", "file", path,
				"force_fail_mode", w.cfg.Mode, "restart_mode", w.cfg.RestartMode)
		}
		w.applyModes(w.cfg.Mode, w.cfg.RestartMode, ModeSourceFlag)
	default:
		st.lastErr = ""
		st.absentLogged = false
		w.applyModes(m, capMode(w.cfg.RestartMode, m), ModeSourceFile)
	}
}

// capMode is m, lowered to limit when limit is more cautious.
func capMode(m, limit Mode) Mode {
	if modeRank(limit) < modeRank(m) {
		return limit
	}
	return m
}

// modeRank orders the modes by how much they do.
func modeRank(m Mode) int {
	switch m {
	case ModeAuto:
		return 2
	case ModeDryRun:
		return 1
	}
	return 0
}

// applyModes sets the force-fail and restart modes, logging and counting
// a change. Caller holds w.mu.
func (w *Watchdog) applyModes(ff, restart Mode, source string) {
	if ff == w.mode && restart == w.restartMode {
		return
	}
	level.Warn(w.logger).Log("msg", "mode changed", "source", source, "file", w.cfg.ModeFile,
		"force_fail_from", w.mode, "force_fail_to", ff, "restart_from", w.restartMode, "restart_to", restart)
	w.mode, w.restartMode = ff, restart
	w.modeChanges++
}
