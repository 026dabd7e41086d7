package watchdog

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/go-kit/log"
)

// A rank unreachable for a model load logs its first failure, then one
// line a minute with the failures since the last line, and one line when
// it answers again with how long it was down.
func TestUnreachableRankLogIsRateLimited(t *testing.T) {
	var logs syncBuffer
	h := newHarness(t, func(c *Config) { c.Logger = log.NewLogfmtLogger(&logs) })
	h.plugin.listErr = errors.New("connection refused")
	h.tick(150)
	const failed = `msg="reading plugin listing failed" source=plugin target=http://127.0.0.1:28100 err="connection refused"`
	if n := logs.count(failed); n != 3 {
		t.Fatalf("%d lines for 150 failed reads, want 3 (first, +60s, +120s):\n%s", n, logs.b.String())
	}
	for _, want := range []string{failed + " failures=1 down_for=0s", failed + " failures=60 down_for=1m0s", failed + " failures=60 down_for=2m0s"} {
		if logs.count(want) != 1 {
			t.Fatalf("no line %q:\n%s", want, logs.b.String())
		}
	}
	if got := h.wd.Snapshot().Sources[0].Failures; got != 150 {
		t.Fatalf("failures counted %d, want every one (150)", got)
	}
	h.plugin.listErr = nil
	h.tick(5)
	if n := logs.count(`msg="plugin listing read again" source=plugin target=http://127.0.0.1:28100 down_for=2m30s failures=150`); n != 1 {
		t.Fatalf("%d recovery lines, want 1 with the outage's length and failures:\n%s", n, logs.b.String())
	}
	// A new outage a minute after the last line is logged at once.
	h.tick(60)
	h.plugin.listErr = errors.New("timeout")
	h.tick(1)
	if logs.count(`err=timeout failures=1 down_for=0s`) != 1 {
		t.Fatalf("a new outage's first failure is not logged:\n%s", logs.b.String())
	}
}

// A source that fails every other read is logged about once a minute
// (a failure and the recovery that follows it), each failure line
// counting the failures since the line before.
func TestFlappingRankLogIsRateLimited(t *testing.T) {
	var logs syncBuffer
	h := newHarness(t, func(c *Config) { c.Logger = log.NewLogfmtLogger(&logs) })
	for i := 0; i < 120; i++ {
		h.plugin.listErr = nil
		if i%2 == 0 {
			h.plugin.listErr = errors.New("HTTP 502")
		}
		h.tick(1)
	}
	failed, back := logs.count(`msg="reading plugin listing failed"`), logs.count(`msg="plugin listing read again"`)
	if failed != 2 || back != 2 || logs.count(`failures=1 down_for=0s`) != 1 {
		t.Fatalf("%d failure and %d recovery lines over 2 minutes of flapping, want 2 of each:\n%s", failed, back, logs.b.String())
	}
	if logs.count(`err="HTTP 502" failures=31 down_for=0s`) != 1 {
		t.Fatalf("the second failure line does not count the 31 failures since the recovery line:\n%s", logs.b.String())
	}
}

func TestSGLangMetricsOutageLogIsRateLimited(t *testing.T) {
	var logs syncBuffer
	m := &fakeMetrics{err: errors.New("503")}
	h := newHarness(t, func(c *Config) { c.Metrics, c.Logger = m, log.NewLogfmtLogger(&logs) })
	for i := 0; i < 10; i++ {
		h.wd.ScrapeMetrics(context.Background())
		h.clk.Advance(15 * time.Second)
	}
	if n := logs.count(`msg="reading SGLang metrics failed"`); n != 3 {
		t.Fatalf("%d lines for 10 failed reads 15s apart, want 3 (0s, 60s, 120s):\n%s", n, logs.b.String())
	}
	m.err = nil
	h.wd.ScrapeMetrics(context.Background())
	if logs.count(`msg="SGLang metrics read again" source=metrics target=http://127.0.0.1:30000/metrics down_for=2m30s failures=10`) != 1 {
		t.Fatalf("no recovery line:\n%s", logs.b.String())
	}
}
