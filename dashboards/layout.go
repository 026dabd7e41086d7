package dashboards

import (
	"fmt"
	"strings"
)

// Matchers shared by every query. They are the only places the query
// variables appear, so the tests can check them mechanically.
const (
	// allValue is what "All" expands to for every query variable. ".*" (not
	// ".+") so that series lacking the label (older SGLang label eras, non-DP
	// servers without dp_rank) still match.
	allValue = ".*"

	// matchInstance selects the host picked in $instance on any port: the
	// variable lists hosts with the port stripped, so that SGLang
	// (host:30000) and its watchdog sidecar (host:<watchdog port>) are
	// selected together.
	matchInstance = `instance=~"$instance(:[0-9]+)?"`
	// matchCluster and matchNamespace narrow every query to the picked
	// cluster and Kubernetes namespace; series without the label (a single
	// cluster, no Kubernetes) match the All value ".*". The mixin renames
	// the cluster label (_config.clusterLabel) in every query.
	matchCluster   = `cluster=~"$cluster"`
	matchNamespace = `namespace=~"$namespace"`
	// matchTarget is what every query selects by: cluster, namespace, host.
	matchTarget = matchCluster + ", " + matchNamespace + ", " + matchInstance
	// matchJob filters the watchdog's own series by its scrape job. SGLang's
	// series come from another job (its own /metrics), so they are tied to
	// the watchdog by host instead (matchInstance).
	matchJob = `job=~"$job"`
	// matchRank filters watchdog series, which always carry dp_rank (the
	// watchdog exports a missing SGLang rank as "0").
	matchRank = `dp_rank=~"$dp_rank"`
	// matchRawRank filters SGLang's own series. A server without data
	// parallelism (and older label eras) emits no dp_rank label at all; the
	// empty alternative keeps those series, which are rank 0.
	matchRawRank = `dp_rank=~"$dp_rank|"`
	// matchModel and matchModelOld filter SGLang's own series by model. The
	// ~v0.3.5 label era called the label "name"; raw queries select each
	// metric once per label and join the two with "or" (see rawSels).
	matchModel    = `model_name=~"$model_name"`
	matchModelOld = `name=~"$model_name"`
	// matchQueueTotal keeps the total of a newest-era QueueCount gauge (the
	// per-priority breakdown carries priority="<n>"); older eras have no
	// priority label, which also matches.
	matchQueueTotal = `priority=""`
)

// wd selects a watchdog metric that carries no rank label.
func wd(metric string) string { return metric + "{" + matchTarget + ", " + matchJob + "}" }

// wdRank selects a watchdog metric that carries dp_rank.
func wdRank(metric string) string {
	return metric + "{" + matchTarget + ", " + matchJob + ", " + matchRank + "}"
}

// rawSels returns the two selectors of one of SGLang's own metrics: by
// model_name, and by the old "name" label. With $model_name set to All both
// select every series, and "or" drops the duplicates (it matches on all
// labels but the metric name); with a model picked, each selects the servers
// of its era.
func rawSels(metric string, extra ...string) [2]string {
	var out [2]string
	for i, model := range []string{matchModel, matchModelOld} {
		m := append([]string{matchTarget, model, matchRawRank}, extra...)
		out[i] = metric + "{" + strings.Join(m, ", ") + "}"
	}
	return out
}

// raw selects one of SGLang's own metrics, in either model label era.
func raw(metric string, extra ...string) string {
	s := rawSels(metric, extra...)
	return "(" + s[0] + " or " + s[1] + ")"
}

// rawQueue selects one of SGLang's queue gauges (total, not per priority).
func rawQueue(metric string) string { return raw(metric, matchQueueTotal) }

// rawRate is the per-second rate of one of SGLang's counters or buckets, in
// either model label era.
func rawRate(metric string, extra ...string) string {
	s := rawSels(metric, extra...)
	return "(" + rate(s[0]) + " or " + rate(s[1]) + ")"
}

func rate(sel string) string     { return "rate(" + sel + "[$__rate_interval])" }
func increase(sel string) string { return "increase(" + sel + "[$__rate_interval])" }

// quantile is histogram_quantile over the rate of buckets (an expression
// that yields per-second bucket rates with an le label).
func quantile(q float64, by, bucketRate string) string {
	return fmt.Sprintf("histogram_quantile(%g, sum by (%s) (%s))", q, by, bucketRate)
}

type panelKind int

const (
	kindTimeseries panelKind = iota
	kindStat
	kindHeatmap
)

type target struct {
	expr   string
	legend string
	needs  Needs
}

type panelSpec struct {
	kind        panelKind
	title       string
	description string
	unit        string
	width       uint32
	height      uint32
	stacked     bool
	// alertAt, if non-zero, colours values at or above it red (stat panels)
	// or draws it as a threshold line (time series).
	alertAt float64
	// showName makes a stat panel show the series name (legend) instead of
	// the value: used for the force-fail mode and the build.
	showName bool
	targets  []target
}

type rowSpec struct {
	title  string
	panels []panelSpec
}

// layout is the whole dashboard: rows in order, panels in order.
func layout() []rowSpec {
	return []rowSpec{
		{title: "Overview", panels: []panelSpec{
			{
				kind: kindStat, title: "Stuck requests", width: 4, height: 4, alertAt: 1, unit: "short",
				description: "Prefill inflight requests older than --watchdog.deadline whose progress and poll state have not changed for --watchdog.stall-window while the scheduler loop kept running. Needs the plugin.",
				targets: []target{{
					expr: "sum(" + wdRank("sglang_watchdog_stuck_requests") + ")", legend: "stuck", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindStat, title: "Pinned queue gauges", width: 4, height: 4, alertAt: 1, unit: "short",
				description: "SGLang PD queue gauges that have been non-zero and unchanged for --watchdog.pin-window while no progress counter moved. Works without the plugin.",
				targets: []target{{
					expr: "sum(" + wdRank("sglang_watchdog_queue_pinned") + ")", legend: "pinned",
				}},
			},
			{
				kind: kindStat, title: "Wedged scheduler ranks", width: 4, height: 4, alertAt: 1, unit: "short",
				description: "Ranks whose inflight queue holds requests while the scheduler loop has not advanced for --watchdog.stall-window. The watchdog never force-fails on a wedged rank.",
				targets: []target{{
					expr: "sum(" + wdRank("sglang_watchdog_scheduler_wedged") + ")", legend: "wedged", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindStat, title: "Oldest inflight request", width: 4, height: 4, unit: "s",
				description: "Age of the oldest request in the prefill inflight queue, over the selected ranks; 0 when the queue is empty.",
				targets: []target{{
					expr: "max(" + wdRank("sglang_watchdog_inflight_oldest_age_seconds") + ")", legend: "oldest", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindStat, title: "Force-fail mode", width: 4, height: 4, showName: true, unit: "none",
				description: "The force-fail mode in force: off, dry-run or auto (--force-fail.mode, or --force-fail.mode-file while it holds a mode).",
				targets: []target{{
					expr: wd("sglang_watchdog_force_fail_mode") + " == 1", legend: "{{mode}}",
				}},
			},
			{
				kind: kindStat, title: "Since SGLang progress", width: 4, height: 4, unit: "s",
				description: "Seconds since any of SGLang's progress counters moved (transfer failures, prefill_transfer_kv_cache observations, prompt tokens, requests, realtime tokens). Large values with a non-empty queue mean nothing is moving.",
				targets: []target{{
					expr: "max(" + wd("sglang_watchdog_seconds_since_progress") + ")", legend: "since progress",
				}},
			},
		}},
		{title: "PD queues", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "PD queue depth per rank (watchdog view)", width: 12, height: 8, unit: "short",
				description: "sglang_watchdog_queue_requests: each PD queue per rank as last seen by the watchdog, from SGLang's /metrics (source=metrics) and from the plugin listing (source=plugin). The two sources should agree; a metrics value pinned above the plugin value is the stale-gauge symptom.",
				targets: []target{{
					expr:   "max by (source, queue, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_queue_requests") + ")",
					legend: "{{queue}} dp{{dp_rank}} pp{{pp_rank}} ({{source}})",
				}},
			},
			{
				kind: kindTimeseries, title: "PD queue gauges (SGLang /metrics)", width: 12, height: 8, unit: "short",
				description: "SGLang's own PD queue gauges. They are only rewritten when a prefill batch is formed (or by the idle refresh when the inflight queue is empty), so with one stuck request and no traffic they stay pinned. The bootstrap queue is named num_prefill_bootstrap_queue_reqs on newest SGLang and num_prefill_prealloc_queue_reqs on v0.5-era servers.",
				targets: []target{
					{
						expr:   rawQueue("sglang:num_prefill_inflight_queue_reqs"),
						legend: "prefill inflight {{instance}} dp{{dp_rank}} tp{{tp_rank}}", needs: NeedsSGLangScrape,
					},
					{
						expr:   rawQueue("sglang:num_prefill_bootstrap_queue_reqs") + " or " + rawQueue("sglang:num_prefill_prealloc_queue_reqs"),
						legend: "prefill bootstrap {{instance}} dp{{dp_rank}} tp{{tp_rank}}", needs: NeedsSGLangScrape,
					},
					{
						expr:   rawQueue("sglang:num_decode_prealloc_queue_reqs"),
						legend: "decode prealloc {{instance}} dp{{dp_rank}} tp{{tp_rank}}", needs: NeedsSGLangScrape | NeedsDecodeRole,
					},
					{
						expr:   rawQueue("sglang:num_decode_transfer_queue_reqs"),
						legend: "decode transfer {{instance}} dp{{dp_rank}} tp{{tp_rank}}", needs: NeedsSGLangScrape | NeedsDecodeRole,
					},
				},
			},
		}},
		{title: "Prefill inflight queue (plugin)", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "Inflight requests by poll state", width: 8, height: 8, stacked: true, unit: "short",
				description: "Requests waiting on a KV transfer by the plugin's last observed KVPoll state: the prefill inflight queue (role prefill), the decode prealloc and transfer queues (role decode). Requests that sit in Transferring or WaitingForInput without leaving are the stuck-request symptom.",
				targets: []target{{
					expr:   "sum by (role, dp_rank, poll) (" + wdRank("sglang_watchdog_inflight_requests") + ")",
					legend: "{{role}} dp{{dp_rank}} {{poll}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Oldest inflight request age", width: 8, height: 8, unit: "s",
				description: "Age of the oldest request waiting on a KV transfer per rank and role (prefill inflight queue; decode prealloc and transfer queues); 0 when there is none. A line that climbs without dropping back is a request that never leaves.",
				targets: []target{{
					expr:   "max by (role, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_inflight_oldest_age_seconds") + ")",
					legend: "{{role}} dp{{dp_rank}} pp{{pp_rank}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindHeatmap, title: "Time in inflight queue", width: 8, height: 8, unit: "s",
				description: "How long requests stayed in the prefill inflight queue, observed when each left the plugin listing (sglang_watchdog_inflight_age_seconds).",
				targets: []target{{
					expr:   "sum by (le) (" + rate(wdRank("sglang_watchdog_inflight_age_seconds_bucket")) + ")",
					legend: "{{le}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Time in inflight queue quantiles", width: 24, height: 7, unit: "s",
				description: "p50 and p99 of the time requests stayed in the prefill inflight queue, per rank.",
				targets: []target{
					{
						expr:   quantile(0.5, "le, dp_rank", rate(wdRank("sglang_watchdog_inflight_age_seconds_bucket"))),
						legend: "p50 dp{{dp_rank}}", needs: NeedsPlugin | NeedsInflightTraffic,
					},
					{
						expr:   quantile(0.99, "le, dp_rank", rate(wdRank("sglang_watchdog_inflight_age_seconds_bucket"))),
						legend: "p99 dp{{dp_rank}}", needs: NeedsPlugin | NeedsInflightTraffic,
					},
				},
			},
		}},
		{title: "Stuck detection", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "Stuck requests per rank", width: 8, height: 8, alertAt: 1, unit: "short",
				description: "Requests the watchdog judges stuck, by role: older than the deadline (decode: the decode deadline), no progress or poll change for the stall window, scheduler loop still running.",
				targets: []target{{
					expr:   "sum by (role, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_stuck_requests") + ")",
					legend: "{{role}} dp{{dp_rank}} pp{{pp_rank}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Pinned SGLang queue gauges", width: 8, height: 8, alertAt: 1, unit: "bool_yes_no",
				description: "1 while an SGLang PD queue gauge has been non-zero and unchanged for --watchdog.pin-window with no progress signal moving. Works without the plugin.",
				targets: []target{{
					expr:   "max by (queue, dp_rank, pp_rank, tp_rank) (" + wdRank("sglang_watchdog_queue_pinned") + ")",
					legend: "{{queue}} dp{{dp_rank}} pp{{pp_rank}} tp{{tp_rank}}",
				}},
			},
			{
				kind: kindTimeseries, title: "SGLang queue gauge unchanged for", width: 8, height: 8, unit: "s",
				description: "Seconds since each SGLang PD queue gauge last changed value (or was first seen).",
				targets: []target{{
					expr:   "max by (queue, dp_rank, pp_rank, tp_rank) (" + wdRank("sglang_watchdog_queue_unchanged_seconds") + ")",
					legend: "{{queue}} dp{{dp_rank}} pp{{pp_rank}} tp{{tp_rank}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Scheduler loop stall", width: 8, height: 8, unit: "s",
				description: "Seconds since the plugin's scheduler-loop counter last advanced. A still counter with an empty queue is normal.",
				targets: []target{{
					expr:   "max by (role, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_scheduler_loop_stall_seconds") + ")",
					legend: "{{role}} dp{{dp_rank}} pp{{pp_rank}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Wedged scheduler loop", width: 8, height: 8, alertAt: 1, unit: "bool_yes_no",
				description: "1 while the inflight queue holds requests and the scheduler loop has not advanced for --watchdog.stall-window. No request is force-failed on a wedged rank: restart the server instead.",
				targets: []target{{
					expr:   "max by (role, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_scheduler_wedged") + ")",
					legend: "{{role}} dp{{dp_rank}} pp{{pp_rank}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Seconds since SGLang progress", width: 8, height: 8, unit: "s",
				description: "Seconds since any of SGLang's progress counters moved, per watchdog.",
				targets: []target{{
					expr:   wd("sglang_watchdog_seconds_since_progress"),
					legend: "{{instance}}",
				}},
			},
		}},
		{title: "Force-fail", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "Force-fail attempts by result and trigger", width: 8, height: 8, stacked: true, unit: "short",
				description: "Force-fail attempts per interval. released: the room left the listing and SGLang counted a transfer failure; unconfirmed: lever set, release not seen in time; would_flip: dry run; not_found, rejected, error: the admin call failed; unsupported: no lever works on this SGLang. trigger is auto (the watchdog's own decision), alert (Alertmanager webhook) or fail_fast (a room failed by a wedge order, with every room queued behind the same diagnosed transfer wedge).",
				targets: []target{{
					expr:   "sum by (result, trigger, role) (" + increase(wd("sglang_watchdog_force_fails_total")) + ")",
					legend: "{{result}} ({{trigger}}, {{role}})",
				}},
			},
			{
				kind: kindTimeseries, title: "Stuck requests not force-failed", width: 8, height: 8, stacked: true, unit: "short",
				description: "Stuck requests the watchdog did not force-fail, by reason and role: mode_off, rate_limited, progressed, gone, source_down, unsupported, transfer_live (decode: the transfer may still be written; held for SGLang's own timeout).",
				targets: []target{{
					expr:   "sum by (reason, role) (" + increase(wd("sglang_watchdog_force_fail_skips_total")) + ")",
					legend: "{{reason}} ({{role}})",
				}},
			},
			{
				kind: kindTimeseries, title: "Alert webhook deliveries", width: 8, height: 8, stacked: true, unit: "short",
				description: "Authenticated Alertmanager webhook deliveries per interval: accepted, ignored (no firing stuck-request alert about this watchdog), bad_request, busy (trigger queue full, answered 503), disabled. Refusals (with the webhook on): unauthorized deliveries (no or wrong bearer token) and foreign_target alerts whose labels name another watchdog.",
				targets: []target{
					{
						expr:   "sum by (result) (" + increase(wd("sglang_watchdog_alert_webhook_requests_total")) + ")",
						legend: "{{result}}",
					},
					{
						expr:   "sum by (reason) (" + increase(wd("sglang_watchdog_alert_webhook_refusals_total")) + ")",
						legend: "refused: {{reason}}", needs: NeedsWebhook,
					},
				},
			},
			{
				kind: kindTimeseries, title: "Modes in force and their switches", width: 24, height: 6, unit: "short",
				description: "The force-fail and restart modes in force (1 on the mode's line), which --force-fail.mode-file switches at run time without a restart, and per interval the switches and the reads of a mode file whose content is not off, dry-run or auto (the modes then stay as they were).",
				targets: []target{
					{expr: "max by (instance, mode) (" + wd("sglang_watchdog_force_fail_mode") + ")", legend: "force-fail {{mode}} {{instance}}"},
					{expr: "max by (instance, mode) (" + wd("sglang_watchdog_restart_mode") + ")", legend: "restart {{mode}} {{instance}}"},
					{expr: "sum by (instance) (" + increase(wd("sglang_watchdog_mode_changes_total")) + ")", legend: "switches {{instance}}"},
					{expr: "sum by (instance) (" + increase(wd("sglang_watchdog_mode_file_errors_total")) + ")", legend: "mode file errors {{instance}}"},
				},
			},
		}},
		{title: "Transfer wedges and restarts", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "Wedged KV transfer queues", width: 8, height: 8, alertAt: 1, unit: "bool_yes_no",
				description: "1 while a KV transfer queue of the rank is wedged: its worker holds a chunk far past what its size needs at the link's measured speed (plugins with transfer_progress), or, with older plugins, a stuck room with a transfer in flight, an orphaned transfer on a queue whose rooms wait unchanged, or two or more stuck Transferring rooms (suspected); those are alerted on, never acted on. Every room queued behind it hangs; with transfer_progress, auto mode places a wedge order that fails them at once (trigger fail_fast), and only a restart frees the worker.",
				targets: []target{{
					expr:   "max by (instance, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_transfer_wedged") + ")",
					legend: "{{instance}} dp{{dp_rank}} pp{{pp_rank}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Transfer wedges diagnosed", width: 8, height: 8, stacked: true, unit: "short",
				description: "Transfer queue wedges diagnosed or suspected per interval, each counted once.",
				targets: []target{{
					expr:   "sum by (instance, dp_rank, pp_rank) (" + increase(wdRank("sglang_watchdog_transfer_wedges_total")) + ")",
					legend: "{{instance}} dp{{dp_rank}} pp{{pp_rank}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Dead KV manager threads", width: 8, height: 8, alertAt: 1, unit: "short",
				description: "Threads of SGLang's KV manager that died, by thread role (from the plugin's kv_threads): bootstrap (every later request waits in the bootstrap queue), transfer_worker (its transfer queue is never drained again; its queued rooms are force-failed past the deadline), decode_listener (decode requests never learn their KV arrived), heartbeat (a dead prefill peer goes unnoticed), other. SGLang never restarts them; only a restart of the server does (restart escalation does it when enabled). No line where the plugin does not report its threads.",
				targets: []target{{
					expr:   "max by (instance, role, dp_rank, pp_rank, thread) (" + wdRank("sglang_watchdog_kv_threads_dead") + ")",
					legend: "{{instance}} {{role}} dp{{dp_rank}} pp{{pp_rank}} {{thread}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Restart escalations", width: 8, height: 8, stacked: true, unit: "short",
				description: "Restart escalations of a diagnosed wedge or of a KV manager thread dead for the stall window, per interval (--restart.mode): restarted (the plugin ended the scheduler), would_restart (dry run), disabled, unsupported, rejected, too_soon (the plugin's own minimum interval), error (the wedge was left in place).",
				targets: []target{{
					expr:   "sum by (result) (" + increase(wd("sglang_watchdog_restarts_total")) + ")",
					legend: "{{result}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Wedge orders", width: 8, height: 8, stacked: true, unit: "short",
				description: "Calls for standing wedge orders per interval (one order per diagnosed wedge fails every room queued behind it; --force-fail.fail-fast): ordered (a new order), renewed (each cycle while the wedge holds), would_order (dry run), wedge_cleared (the chunk left the worker; also the closing call), rate_limited (a new order held back by --force-fail.fail-fast-max-per-minute), unsupported, rejected, error. The rooms they failed show under force-fail attempts, trigger fail_fast.",
				targets: []target{{
					expr:   "sum by (result) (" + increase(wd("sglang_watchdog_wedge_orders_total")) + ")",
					legend: "{{result}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Stuck requests that cannot be force-failed", width: 8, height: 8, alertAt: 1, unit: "short",
				description: "Stuck requests the last attempt could not act on, by reason: source_down (the listing re-read before the call failed: a flapping source blocks every release), unsupported (no lever works on this SGLang) or transfer_live (decode: the transfer may still be written and the prefill side has not said it stopped).",
				targets: []target{{
					expr:   "sum by (role, dp_rank, pp_rank, reason) (" + wdRank("sglang_watchdog_stuck_unactionable_requests") + ")",
					legend: "{{role}} dp{{dp_rank}} pp{{pp_rank}} {{reason}}", needs: NeedsPlugin,
				}},
			},
			{
				kind: kindTimeseries, title: "Plugin URLs per rank", width: 8, height: 8, alertAt: 2, unit: "short",
				description: "Plugin URLs whose last listing reported each rank. Above 1 is a collision (a wrong --plugin.url or port mapping): the rank's series add up those targets, and another rank is probably not watched.",
				targets: []target{{
					expr:   "max by (instance, dp_rank, pp_rank) (" + wdRank("sglang_watchdog_rank_targets") + ")",
					legend: "{{instance}} dp{{dp_rank}} pp{{pp_rank}}", needs: NeedsPlugin,
				}},
			},
		}},
		{title: "Decode safety", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "Prefill verdict lookups", width: 12, height: 8, stacked: true, unit: "short",
				description: "Lookups of the prefill side's verdict on the room of a stuck decode request whose KV transfer started, per interval: stopped (the only answer that lets it be released early), live, in_queue, unknown, error (peer unreachable, host outside --decode.prefill-networks, no --decode.prefill-watchdog-url). Anything but stopped holds the request for SGLang's own timeout.",
				targets: []target{{
					expr:   "sum by (instance, verdict) (" + increase(wd("sglang_watchdog_prefill_verdict_lookups_total")) + ")",
					legend: "{{verdict}} {{instance}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Rooms released on prefill, remembered for decode", width: 12, height: 8, unit: "short",
				description: "Rooms a prefill-side watchdog released and remembers (15 minutes, at most 10,000) to answer decode-side verdict lookups on GET /api/v1/rooms/<room>.",
				targets: []target{{
					expr:   "max by (instance) (" + wd("sglang_watchdog_prefill_released_rooms") + ")",
					legend: "{{instance}}",
				}},
			},
		}},
		{title: "KV transfer (SGLang /metrics)", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "KV transfer and bootstrap failures", width: 8, height: 8, unit: "reqps",
				description: "SGLang's failure counters. A force-fail that releases a stuck request shows up here as a transfer failure.",
				targets: []target{
					{
						expr:   "sum by (instance, dp_rank) (" + rawRate("sglang:num_transfer_failed_reqs_total") + ")",
						legend: "transfer failed {{instance}} dp{{dp_rank}}", needs: NeedsSGLangScrape | NeedsTransferFailure,
					},
					{
						expr:   "sum by (instance, dp_rank) (" + rawRate("sglang:num_bootstrap_failed_reqs_total") + ")",
						legend: "bootstrap failed {{instance}} dp{{dp_rank}}", needs: NeedsSGLangScrape | NeedsTransferFailure,
					},
				},
			},
			{
				kind: kindTimeseries, title: "KV transfer latency", width: 8, height: 8, unit: "ms",
				description: "Newest SGLang exports sglang:kv_transfer_latency_ms as a histogram (p50/p99 here); v0.5-era servers export it as a gauge holding the last transfer's latency. Whichever the server has is shown.",
				targets: []target{
					{
						expr:   quantile(0.5, "le, instance", rawRate("sglang:kv_transfer_latency_ms_bucket")),
						legend: "p50 {{instance}}", needs: NeedsSGLangScrape | NeedsHistogramEra | NeedsKVTransfer,
					},
					{
						expr:   quantile(0.99, "le, instance", rawRate("sglang:kv_transfer_latency_ms_bucket")),
						legend: "p99 {{instance}}", needs: NeedsSGLangScrape | NeedsHistogramEra | NeedsKVTransfer,
					},
					{
						expr:   raw("sglang:kv_transfer_latency_ms"),
						legend: "last {{instance}} dp{{dp_rank}} tp{{tp_rank}}", needs: NeedsSGLangScrape | NeedsGaugeEra | NeedsKVTransfer,
					},
				},
			},
			{
				kind: kindTimeseries, title: "Prefill KV-transfer stage latency", width: 8, height: 8, unit: "s",
				description: "sglang:per_stage_req_latency_seconds{stage=\"prefill_transfer_kv_cache\"}: time from the end of the prefill forward pass to transfer Success. Observed only on Success, so stuck requests never appear here; a gap while the queue is non-empty is the symptom.",
				targets: []target{
					{
						expr:   quantile(0.5, "le, instance", rawRate("sglang:per_stage_req_latency_seconds_bucket", `stage="prefill_transfer_kv_cache"`)),
						legend: "p50 {{instance}}", needs: NeedsSGLangScrape | NeedsKVTransfer,
					},
					{
						expr:   quantile(0.99, "le, instance", rawRate("sglang:per_stage_req_latency_seconds_bucket", `stage="prefill_transfer_kv_cache"`)),
						legend: "p99 {{instance}}", needs: NeedsSGLangScrape | NeedsKVTransfer,
					},
				},
			},
		}},
		{title: "Watchdog health", panels: []panelSpec{
			{
				kind: kindTimeseries, title: "Source read success", width: 8, height: 8, unit: "bool_yes_no",
				description: "1 if the watchdog's last read of each source succeeded. A failed source never reads as zero rooms.",
				targets: []target{{
					expr:   wd("sglang_watchdog_scrape_success"),
					legend: "{{source}} {{target}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Source read duration", width: 8, height: 8, unit: "s",
				description: "How long the last read of each source took. Every /metrics read costs SGLang tens of milliseconds on its API event loop.",
				targets: []target{{
					expr:   wd("sglang_watchdog_scrape_duration_seconds"),
					legend: "{{source}} {{target}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Source read failures", width: 8, height: 8, stacked: true, unit: "short",
				description: "Failed reads per interval (HTTP error, timeout, oversized or malformed body).",
				targets: []target{{
					expr:   "sum by (source, target) (" + increase(wd("sglang_watchdog_scrape_failures_total")) + ")",
					legend: "{{source}} {{target}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Prometheus targets up", width: 8, height: 8, unit: "bool_yes_no",
				description: "Prometheus's up series for every target on the selected hosts: SGLang's /metrics and the watchdog.",
				targets: []target{{
					expr:   "up{" + matchTarget + "}",
					legend: "{{job}} {{instance}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Watch cycle duration", width: 8, height: 8, unit: "s",
				description: "How long the watchdog's last watch cycle took.",
				targets: []target{{
					expr:   wd("sglang_watchdog_last_cycle_duration_seconds"),
					legend: "{{instance}}",
				}},
			},
			{
				kind: kindTimeseries, title: "Tracked rooms", width: 8, height: 8, unit: "short",
				description: "Inflight rooms the watchdog remembers, and listings per interval that held more rooms than --watchdog.max-rooms (the excess is not tracked).",
				targets: []target{
					{
						expr:   wd("sglang_watchdog_tracked_rooms"),
						legend: "tracked {{instance}}",
					},
					{
						expr:   increase(wd("sglang_watchdog_room_limit_hits_total")),
						legend: "room limit hits {{instance}}",
					},
				},
			},
			{
				kind: kindStat, title: "Watchdog build", width: 24, height: 4, showName: true, unit: "none",
				description: "Version of each watchdog (sglang_watchdog_build_info).",
				targets: []target{{
					expr:   wd("sglang_watchdog_build_info"),
					legend: "{{instance}}: {{version}} ({{revision}}, {{goversion}})",
				}},
			},
		}},
	}
}

type placedPanel struct {
	row  string
	id   uint32
	spec panelSpec
}

// assignIDs numbers rows and panels with one sequence, in layout order, and
// returns the row ids and the panels with their ids.
func assignIDs(rows []rowSpec) ([]uint32, []placedPanel) {
	var rowIDs []uint32
	var panels []placedPanel
	id := uint32(0)
	for _, r := range rows {
		id++
		rowIDs = append(rowIDs, id)
		for _, p := range r.panels {
			id++
			panels = append(panels, placedPanel{row: r.title, id: id, spec: p})
		}
	}
	return rowIDs, panels
}
