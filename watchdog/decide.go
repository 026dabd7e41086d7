package watchdog

import "time"

// Decisions are pure functions of state, configuration and the clock, so
// that they can be tested on a fake clock without HTTP.

// roomStuck tells whether a request is stuck: old enough, with neither poll
// nor progress changing for the stall window, while the scheduler loop kept
// running (otherwise every room looks frozen and the observations are
// stale), and not one of SGLang's own health checks.
func roomStuck(r *roomState, rk *rankState, now time.Time, cfg *Config) bool {
	if r.health {
		return false
	}
	if r.age < cfg.Deadline.Seconds() {
		return false
	}
	if now.Sub(r.lastChange) < cfg.StallWindow {
		return false
	}
	return rk.loopAdvancing && rk.iterations > r.iterAtChange
}

// rankWedged tells whether the scheduler loop stopped while requests wait.
// A still counter on an empty queue is normal: older SGLang only calls the
// hooked pass while the queue is non-empty.
func rankWedged(rk *rankState, now time.Time, cfg *Config) bool {
	return len(rk.rooms) > 0 && now.Sub(rk.loopAdvancedAt) >= cfg.StallWindow
}

// gaugePinned tells whether a queue gauge is pinned: non-zero, unchanged for
// the pin window, and no progress signal moved in that window. An idle
// server's gauge is 0; a busy healthy one moves its progress counters.
func gaugePinned(g *gaugeState, m *metricsState, now time.Time, cfg *Config) bool {
	if !m.status.up || g.value == 0 {
		return false
	}
	return now.Sub(g.lastChange) >= cfg.PinWindow && now.Sub(m.lastProgress) >= cfg.PinWindow
}
