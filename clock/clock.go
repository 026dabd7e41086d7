// Package clock lets the watchdog and the SGLang simulator share one notion
// of time, so that tests and benchmarks can replay hours of traffic in
// seconds. Durations are always taken from Now() differences, which carry
// Go's monotonic reading, so a wall-clock jump never shortens or stretches
// a deadline.
package clock

import (
	"sync"
	"time"
)

// Clock is the only source of time for code that makes time-based decisions.
type Clock interface {
	Now() time.Time
	// After delivers once d has elapsed on this clock.
	After(d time.Duration) <-chan time.Time
}

// Real is the process clock.
type Real struct{}

// Now returns time.Now(), monotonic reading included.
func (Real) Now() time.Time { return time.Now() }

// After is time.After.
func (Real) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Fake is a manually advanced clock for tests and trace replay.
type Fake struct {
	mu      sync.Mutex
	now     time.Time
	waiters []waiter
}

type waiter struct {
	at time.Time
	ch chan time.Time
}

// NewFake returns a fake clock set to start. A start taken from time.Now()
// keeps its monotonic reading, so Sub stays monotonic as the clock advances.
func NewFake(start time.Time) *Fake { return &Fake{now: start} }

// Now returns the fake time.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// After delivers when Advance moves the clock to or past now+d.
func (f *Fake) After(d time.Duration) <-chan time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	ch := make(chan time.Time, 1)
	at := f.now.Add(d)
	if d <= 0 {
		ch <- f.now
		return ch
	}
	f.waiters = append(f.waiters, waiter{at: at, ch: ch})
	return ch
}

// Advance moves the clock forward by d and fires every waiter that is due.
func (f *Fake) Advance(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	kept := f.waiters[:0]
	for _, w := range f.waiters {
		if w.at.After(f.now) {
			kept = append(kept, w)
			continue
		}
		w.ch <- f.now
	}
	f.waiters = kept
}
