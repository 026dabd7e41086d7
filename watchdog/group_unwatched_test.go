package watchdog

import (
	"net/http"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// groupUnwatched answers as an attention TP leader whose peer file on
// tp1 is stale: nothing changed, the ranks named.
func groupUnwatched(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
	return http.StatusConflict, &pluginapi.ForceFailResponse{Result: pluginapi.ResultGroupUnwatched, RID: req.RID,
		BootstrapRoom: req.BootstrapRoom, Ranks: []string{"tp1-cp0"}}, nil
}

// Issue 25, point 3: one group_unwatched refusal (a peer file stale for a
// moment) abandoned the stuck room for good; it is retried after the
// backoff, and the retry that finds the peer file fresh sets the lever.
func TestGroupUnwatchedIsRetriedAfterTheBackoff(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxAttempts = 3; c.RetryBackoff = 10 * time.Second })
	h.plugin.answer = groupUnwatched
	h.plugin.set(room("r", 1, 0))
	h.tick(60)
	if h.plugin.callCount() != 1 || h.count(ResultGroupUnwatched, TriggerAuto) != 1 || h.count(ResultRejected, TriggerAuto) != 0 {
		t.Fatalf("calls = %d, group_unwatched = %d, rejected = %d; want 1, 1, 0", h.plugin.callCount(),
			h.count(ResultGroupUnwatched, TriggerAuto), h.count(ResultRejected, TriggerAuto))
	}
	h.plugin.answer = nil // the peer file is fresh again: the leader sets its lever
	h.tick(9)
	if h.plugin.callCount() != 1 {
		t.Fatal("retried before the 10 s backoff")
	}
	h.tick(1)
	if h.plugin.callCount() != 2 {
		t.Fatalf("calls = %d 10 s after the refusal, want 2: the room was abandoned", h.plugin.callCount())
	}
	h.tick(60)
	if h.plugin.callCount() != 2 {
		t.Fatalf("calls = %d after the lever was set, want 2", h.plugin.callCount())
	}
}

// The retries are bounded by MaxAttempts calls spaced 10 s then 20 s; the
// last refusal is final and counts as rejected, as one did before.
func TestGroupUnwatchedRetriesAreBounded(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxAttempts = 3; c.RetryBackoff = 10 * time.Second })
	h.plugin.answer = groupUnwatched
	h.plugin.set(room("r", 1, 0))
	h.tick(60)
	h.tick(10)
	if h.plugin.callCount() != 2 {
		t.Fatalf("calls = %d after 10 s, want 2", h.plugin.callCount())
	}
	h.tick(19)
	if h.plugin.callCount() != 2 {
		t.Fatal("second retry before its 20 s backoff")
	}
	h.tick(1)
	h.tick(600)
	if h.plugin.callCount() != 3 || h.count(ResultGroupUnwatched, TriggerAuto) != 2 || h.count(ResultRejected, TriggerAuto) != 1 {
		t.Fatalf("calls = %d, group_unwatched = %d, rejected = %d; want 3, 2, 1", h.plugin.callCount(),
			h.count(ResultGroupUnwatched, TriggerAuto), h.count(ResultRejected, TriggerAuto))
	}
}
