// Package liveness tells whether the watch loop still cycles, for
// /-/healthy.
package liveness

import (
	"fmt"
	"sync/atomic"
	"time"
)

// Cycler is the watch loop: *watchdog.Watchdog.
type Cycler interface {
	// LastCycleEnd is when the last cycle ended, zero before the first.
	LastCycleEnd() time.Time
}

// Liveness judges the loop. A cycle ends within about an interval (no admin
// call starts once it is spent, and one call lasts at most the admin
// timeout), so a loop that has not finished a cycle for three intervals
// plus an admin timeout has stopped.
type Liveness struct {
	loop    Cycler
	limit   time.Duration
	started atomic.Pointer[time.Time] // when the loop was started; nil before
	now     func() time.Time
}

// New judges loop, which cycles every interval; now is the clock
// (time.Now outside tests).
func New(loop Cycler, interval, adminTimeout time.Duration, now func() time.Time) *Liveness {
	return &Liveness{loop: loop, limit: 3*interval + adminTimeout, now: now}
}

// LoopStarted records that the loop was started: until then it is live.
func (l *Liveness) LoopStarted() {
	t := l.now()
	l.started.Store(&t)
}

// Check returns why the loop is not live, or "".
func (l *Liveness) Check() string {
	started := l.started.Load()
	if started == nil {
		return ""
	}
	last := l.loop.LastCycleEnd()
	if last.IsZero() {
		last = *started
	}
	if idle := l.now().Sub(last); idle > l.limit {
		return fmt.Sprintf("the watch loop has not finished a cycle for %s (limit %s)", idle.Round(time.Second), l.limit)
	}
	return ""
}
