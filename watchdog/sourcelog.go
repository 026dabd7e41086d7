package watchdog

import (
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
)

// downLogEvery is the most often a failing source is logged. A plugin
// rank is unreachable for the whole model load (minutes), and SGLang's
// /metrics with it: one line a cycle per rank drowned the log.
const downLogEvery = time.Minute

// sourceLog is what the log remembers of a source's failures.
type sourceLog struct {
	since time.Time // first failure of the current outage; zero while up
	total int       // failures of the current outage
	told  bool      // the current outage has a line
	last  time.Time // last line about this source
	// unlogged counts the failures since the last line, across outages,
	// so that a flapping source's next line says how often it failed.
	unlogged int
}

// fail records a failed read. The first failure is logged, then at most
// one line every downLogEvery, with the failures since the last line and
// the last error. Caller holds w.mu.
func (s *sourceState) fail(logger log.Logger, now time.Time, err error, msg, source string) {
	s.up = false
	s.failures++
	s.lastErr = err.Error()
	l := &s.log
	l.unlogged++
	l.total++
	if l.since.IsZero() {
		l.since, l.told = now, false
	}
	if !l.last.IsZero() && now.Sub(l.last) < downLogEvery {
		return
	}
	level.Error(logger).Log("msg", msg, "source", source, "target", s.target, "err", err,
		"failures", l.unlogged, "down_for", now.Sub(l.since).Round(time.Second))
	l.last, l.unlogged, l.told = now, 0, true
}

// answered records a successful read, and logs the end of an outage that
// was logged, with how long it lasted. Caller holds w.mu.
func (s *sourceState) answered(logger log.Logger, now time.Time, msg, source string) {
	s.up = true
	s.lastErr = ""
	l := &s.log
	if l.since.IsZero() {
		return
	}
	if l.told {
		level.Info(logger).Log("msg", msg, "source", source, "target", s.target,
			"down_for", now.Sub(l.since).Round(time.Second), "failures", l.total)
		l.last, l.unlogged = now, 0
	}
	l.since, l.total, l.told = time.Time{}, 0, false
}
