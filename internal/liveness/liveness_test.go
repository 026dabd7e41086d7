package liveness

import (
	"strings"
	"testing"
	"time"
)

type loop struct{ last time.Time }

func (l *loop) LastCycleEnd() time.Time { return l.last }

func TestCheck(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	lp := &loop{}
	l := New(lp, time.Second, 7*time.Second, func() time.Time { return now })
	now = now.Add(time.Hour)
	if why := l.Check(); why != "" {
		t.Fatalf("before the loop started: %q", why)
	}
	l.LoopStarted()
	now = now.Add(10 * time.Second)
	if why := l.Check(); why != "" {
		t.Fatalf("10s after the start, limit 3×1s+7s: %q", why)
	}
	now = now.Add(2 * time.Second)
	if why := l.Check(); !strings.Contains(why, "limit 10s") {
		t.Fatalf("12s without a cycle: %q", why)
	}
	lp.last = now
	if why := l.Check(); why != "" {
		t.Fatalf("after a cycle: %q", why)
	}
}
