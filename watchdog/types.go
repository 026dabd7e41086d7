// Package watchdog turns observations of SGLang (its /metrics and the
// plugin's inflight listings) into state, decides which requests are stuck,
// which queue gauges are pinned and which scheduler loops are wedged, and
// force-fails stuck requests through the plugin's admin call behind safety
// rails. The actuator (actuator.go) is the only code here that changes
// anything outside this process.
package watchdog

import (
	"context"
	"fmt"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Queue names used in GaugeKey and exported metrics.
const (
	QueuePrefillInflight  = "prefill_inflight"
	QueuePrefillBootstrap = "prefill_bootstrap"
	QueuePrefillWaiting   = "prefill_waiting"
	QueueDecodePrealloc   = "decode_prealloc"
	QueueDecodeTransfer   = "decode_transfer"
)

// TransferFailedFamily is the counter that SGLang's Failed branch
// increments; a release is confirmed when it rises.
const TransferFailedFamily = "sglang:num_transfer_failed_reqs_total"

// BootstrapFailedFamily is the counter that decode's prealloc queue
// increments for a request that fails there; a decode release from the
// prealloc queue is confirmed when it rises.
const BootstrapFailedFamily = "sglang:num_bootstrap_failed_reqs_total"

// Roles of a plugin rank, the `role` label of per-rank series.
const (
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// Roles lists every role.
var Roles = []string{RolePrefill, RoleDecode}

// GaugeKey names one PD queue gauge of one scheduler rank, as read from
// SGLang's /metrics. Ranks are label values; absent ones are "0".
type GaugeKey struct {
	Queue, DP, PP, TP string
}

// MetricsSample is what one read of SGLang's /metrics yields.
type MetricsSample struct {
	// Gauges holds the watched PD queue gauges.
	Gauges map[GaugeKey]float64
	// Progress holds the total of each progress counter family the server
	// exposes, summed over its series.
	Progress map[string]float64
}

// MetricsSource reads SGLang's /metrics.
type MetricsSource interface {
	Target() string
	Scrape(ctx context.Context) (*MetricsSample, error)
}

// PluginSource is one rank's plugin API. *pluginapi.Client implements it.
type PluginSource interface {
	Target() string
	Inflight(ctx context.Context) (*pluginapi.Listing, error)
	ForceFail(ctx context.Context, order pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error)
}

// Restarter is a PluginSource that can also end its scheduler process
// (POST /admin/restart). *pluginapi.Client implements it; a source
// without it counts every restart as unsupported.
type Restarter interface {
	Restart(ctx context.Context, order pluginapi.RestartRequest) (int, *pluginapi.RestartResponse, error)
}

// WedgeOrderer is a PluginSource that takes standing orders for wedged
// transfer queues (POST /admin/wedge_order). *pluginapi.Client
// implements it; a source without it counts every order as unsupported.
type WedgeOrderer interface {
	PostWedgeOrder(ctx context.Context, order pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error)
}

// Mode says what the actuator may do.
type Mode string

// Modes of the actuator.
const (
	ModeOff    Mode = "off"
	ModeDryRun Mode = "dry-run"
	ModeAuto   Mode = "auto"
)

// Modes lists every mode, for flags and metrics.
var Modes = []Mode{ModeOff, ModeDryRun, ModeAuto}

// ParseMode validates a mode name.
func ParseMode(s string) (Mode, error) {
	for _, m := range Modes {
		if string(m) == s {
			return m, nil
		}
	}
	return "", fmt.Errorf("unknown force-fail mode %q (want off, dry-run or auto)", s)
}

// Force-fail outcomes, the `result` label of sglang_watchdog_force_fails_total.
const (
	ResultReleased    = "released"
	ResultUnconfirmed = "unconfirmed"
	ResultWouldFlip   = "would_flip"
	ResultNotFound    = "not_found"
	ResultRejected    = "rejected"
	ResultError       = "error"
	// ResultUnsupported: the plugin answered 501, no lever works on this
	// SGLang version and backend. Never retried.
	ResultUnsupported = "unsupported"
	// ResultGroupUnwatched: the attention TP/CP leader answered 409
	// group_unwatched (it cannot see whether another rank of its group
	// still sends the room: a stale peer file). Nothing was changed and it
	// may clear, so the call is retried like an error; the refusal that
	// uses up MaxAttempts counts as rejected.
	ResultGroupUnwatched = "group_unwatched"
)

// Results lists every outcome.
var Results = []string{ResultReleased, ResultUnconfirmed, ResultWouldFlip, ResultNotFound, ResultRejected, ResultError, ResultUnsupported, ResultGroupUnwatched}

// Triggers of a force-fail.
const (
	TriggerAuto  = "auto"
	TriggerAlert = "alert"
	// TriggerFailFast: a room failed by a wedge order, with every room
	// queued behind the same diagnosed transfer wedge
	// (--force-fail.fail-fast).
	TriggerFailFast = "fail_fast"
)

// Triggers lists every trigger.
var Triggers = []string{TriggerAuto, TriggerAlert, TriggerFailFast}

// Reasons a stuck request was not force-failed.
const (
	SkipModeOff     = "mode_off"
	SkipRateLimited = "rate_limited"
	SkipProgressed  = "progressed"
	SkipGone        = "gone"
	SkipSourceDown  = "source_down"
	// SkipUnsupported: the rank's listing says no lever works here
	// (server.levers is empty), so no call is made.
	SkipUnsupported = "unsupported"
	// SkipTransferLive: a decode request whose transfer started is held
	// because its prefill peer is not known to have stopped sending
	// ("held: transfer may be live"); SGLang's own timeout releases it.
	SkipTransferLive = "transfer_live"
)

// SkipReasons lists every skip reason.
var SkipReasons = []string{SkipModeOff, SkipRateLimited, SkipProgressed, SkipGone, SkipSourceDown, SkipUnsupported, SkipTransferLive}

// UnactionableReasons are the skip reasons that leave a stuck request
// stuck for as long as they last (sglang_watchdog_stuck_unactionable_requests).
var UnactionableReasons = []string{SkipSourceDown, SkipUnsupported, SkipTransferLive}

// Results of a restart escalation (sglang_watchdog_restarts_total).
const (
	RestartRestarted    = "restarted"     // the plugin answered 202 restarting
	RestartWouldRestart = "would_restart" // --restart.mode=dry-run
	RestartDisabled     = "disabled"      // 403: the plugin does not allow restarts
	RestartUnsupported  = "unsupported"   // 404: an older plugin; 501: no way to end SGLang's server on this node
	RestartRejected     = "rejected"      // 400, 401, 409 pid_mismatch
	RestartTooSoon      = "too_soon"      // 429: within the plugin's own minimum interval
	RestartError        = "error"         // no usable answer
)

// RestartResults lists every restart result.
var RestartResults = []string{RestartRestarted, RestartWouldRestart, RestartDisabled, RestartUnsupported, RestartRejected, RestartTooSoon, RestartError}

// EventKind classifies what the watchdog reports to an observer.
type EventKind string

// Event kinds.
const (
	EventStuck       EventKind = "stuck"
	EventForceFail   EventKind = "force_fail"
	EventSkipped     EventKind = "skipped"
	EventReleased    EventKind = "released"
	EventUnconfirmed EventKind = "unconfirmed"
	EventPinned      EventKind = "gauge_pinned"
	EventWedged      EventKind = "scheduler_wedged"
	// EventTransferWedged: a transfer queue was diagnosed (or, with an
	// older plugin, suspected) wedged; Reason says which rule.
	EventTransferWedged EventKind = "transfer_wedged"
	// EventWedgeOrder: a wedge order was placed, renewed, dry-run or
	// refused; Result says which (OrderResults).
	EventWedgeOrder EventKind = "wedge_order"
	EventRestart    EventKind = "restart"
	// EventKVThreadDead: a thread of a rank's KV manager was first seen
	// dead; Reason is its role, Queue its transfer queue (-1 when none).
	EventKVThreadDead  EventKind = "kv_thread_dead"
	EventRankCollision EventKind = "rank_collision"
)

// Event is one decision or action, for the demo's narration and for tests.
type Event struct {
	Kind     EventKind
	Role     string
	Target   string
	DPRank   int
	PPRank   int
	RID      string
	Room     uint64
	Age      float64
	Poll     string
	Progress int64
	Result   string
	Trigger  string
	Reason   string
	Gauge    GaugeKey
	// Queue is the transfer queue of a transfer wedge, -1 when unknown.
	Queue int
	// Stages holds the per-stage answers of a force-fail on a PP request.
	Stages string
}

// Results of an Alertmanager webhook delivery.
const (
	WebhookAccepted   = "accepted"
	WebhookIgnored    = "ignored"
	WebhookBadRequest = "bad_request"
	WebhookDisabled   = "disabled"
	WebhookBusy       = "busy"
)

// WebhookResults lists every webhook result.
var WebhookResults = []string{WebhookAccepted, WebhookIgnored, WebhookBadRequest, WebhookDisabled, WebhookBusy}
