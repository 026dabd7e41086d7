package collector

import (
	"maps"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

const namespace = "sglang_watchdog"

// SnapshotFunc returns the state to export; *watchdog.Watchdog.Snapshot
// fits.
type SnapshotFunc func() watchdog.Snapshot

// Exporter is a prometheus.Collector that builds every watchdog metric at
// scrape time from one snapshot. It never sets a metric from the loop.
type Exporter struct {
	snapshot SnapshotFunc

	scrapeSuccess, scrapeDuration, scrapeFailures                 *prometheus.Desc
	queueRequests, inflightRequests, oldestAge, ageHist, stuck    *prometheus.Desc
	gaugePinned, gaugeUnchanged, sinceProgress, loopStall, wedged *prometheus.Desc
	forceFails, skips, mode, tracked, limitHits, lastCycle        *prometheus.Desc
	webhook                                                       *prometheus.Desc
	transferWedged, transferWedges, restarts, rankTargets         *prometheus.Desc
	unactionable, verdictLookups, ledgerRooms, wedgeOrders        *prometheus.Desc
	kvThreadsDead                                                 *prometheus.Desc
	restartMode, modeChanges, modeFileErrors                      *prometheus.Desc
}

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, labels, nil)
}

// NewExporter returns an exporter over snapshot.
func NewExporter(snapshot SnapshotFunc) *Exporter {
	// role tells prefill ranks from decode ranks: one watchdog may read
	// both (tests, the demo), and their dp_rank and pp_rank overlap.
	rank := []string{"dp_rank", "pp_rank", "role"}
	return &Exporter{
		snapshot:       snapshot,
		scrapeSuccess:  desc("scrape_success", "1 if the last read of this source (SGLang /metrics or a plugin listing) succeeded, 0 if it failed.", "source", "target"),
		scrapeDuration: desc("scrape_duration_seconds", "Duration of the last read of this source.", "source", "target"),
		scrapeFailures: desc("scrape_failures_total", "Reads of this source that failed: HTTP error, timeout, oversized or malformed body.", "source", "target"),
		queueRequests: desc("queue_requests", "Requests in a prefill/decode disaggregation queue of one scheduler rank, as last read from SGLang /metrics or the plugin listing.",
			"source", "queue", "dp_rank", "pp_rank", "tp_rank"),
		inflightRequests: desc("inflight_requests", "Requests waiting on a KV cache transfer by the plugin's last observed KVPoll state: the prefill inflight queue (role prefill), the decode prealloc and transfer queues (role decode).", append(rank, "poll")...),
		oldestAge:        desc("inflight_oldest_age_seconds", "Age of the oldest request waiting on a KV cache transfer (prefill inflight queue, or decode prealloc and transfer queues); 0 when there is none.", rank...),
		ageHist:          desc("inflight_age_seconds", "Time requests spent waiting on a KV cache transfer (prefill inflight queue, or decode prealloc and transfer queues), observed when each one left the plugin listing.", rank...),
		stuck: desc("stuck_requests", "Requests judged stuck: older than their role's deadline and, on a prefill rank with transfer_progress, holding a chunk in flight far past what its size needs at the link's measured speed, or with nothing in flight nor queued (or queued on a transfer worker that died) and no change for the stall window; elsewhere with no change of poll state and progress (and, on decode, queue) for the stall window while the scheduler loop kept running.",
			rank...),
		gaugePinned: desc("queue_pinned", "1 if this SGLang queue gauge has been non-zero and unchanged for the pin window while no SGLang progress counter moved.",
			"queue", "dp_rank", "pp_rank", "tp_rank"),
		gaugeUnchanged: desc("queue_unchanged_seconds", "Seconds since this SGLang queue gauge last changed value or was first seen.", "queue", "dp_rank", "pp_rank", "tp_rank"),
		sinceProgress:  desc("seconds_since_progress", "Seconds since any SGLang progress counter (transfer failures, completed KV transfers, prompt tokens, requests, realtime tokens) last moved."),
		loopStall:      desc("scheduler_loop_stall_seconds", "Seconds since the scheduler loop counter reported by the plugin last advanced. Normal while the inflight queue is empty.", rank...),
		wedged:         desc("scheduler_wedged", "1 if the inflight queue holds requests and the scheduler loop has not advanced for the stall window; nothing is force-failed on such a rank.", rank...),
		forceFails: desc("force_fails_total", "Force-fail attempts by outcome (released, unconfirmed, would_flip, not_found, rejected, error, unsupported, group_unwatched: a refusal retried later), by what triggered them (auto, alert, fail_fast: a room failed by a wedge order) and by the role of the request (prefill, decode).",
			"result", "trigger", "role"),
		skips: desc("force_fail_skips_total", "Stuck requests that were not force-failed, by reason (mode_off, rate_limited, progressed, gone, source_down, unsupported, transfer_live) and role; each request counts once per reason.",
			"reason", "role"),
		mode:      desc("force_fail_mode", "1 for the force-fail mode in force (off, dry-run, auto), 0 for the others: --force-fail.mode, or the mode in --force-fail.mode-file while that file holds one.", "mode"),
		tracked:   desc("tracked_rooms", "Requests the watchdog currently remembers: prefill inflight rooms and decode requests."),
		limitHits: desc("room_limit_hits_total", "Listings that held more rooms than the room limit; the excess was not tracked and is never acted on."),
		lastCycle: desc("last_cycle_duration_seconds", "Duration of the last watch cycle: listing reads, decisions and admin calls."),
		webhook:   desc("alert_webhook_requests_total", "Alertmanager webhook deliveries by result (accepted, ignored, bad_request, disabled).", "result"),
		transferWedged: desc("transfer_wedged", "1 while a KV transfer worker queue of this rank is wedged: a transfer that never completes blocks every room queued behind it (diagnosed from a chunk held far past what its size needs at the link's measured speed, or, with a plugin without transfer_progress, from its round-2 transfer fields or suspected from two or more stuck Transferring rooms; those are alerted on, never acted on). Only a restart clears it.",
			rank...),
		kvThreadsDead: desc("kv_threads_dead", "Threads of this rank's SGLang KV manager that have died, by thread role: bootstrap (prefill: every later request waits in the bootstrap queue), transfer_worker (prefill: its transfer queue is never drained again), decode_listener (decode: requests never learn their KV arrived), heartbeat (decode: a dead prefill peer goes unnoticed), other. SGLang never restarts them; only a restart of the server does. No series while the plugin does not report its threads.",
			append(rank, "thread")...),
		transferWedges: desc("transfer_wedges_total", "Transfer queue wedges diagnosed or suspected on this rank.", rank...),
		restarts: desc("restarts_total", "Restart escalations of a diagnosed transfer wedge or of a dead KV manager thread, by result (restarted, would_restart, disabled, unsupported, rejected, too_soon, error).",
			"result"),
		rankTargets: desc("rank_targets", "Plugin URLs whose last listing reported this dp_rank and pp_rank. Above 1 is a collision (a misconfigured --plugin.url or port mapping); the series of this rank then sum or take the worst of those targets.",
			rank...),
		unactionable: desc("stuck_unactionable_requests", "Stuck requests the watchdog cannot force-fail, by reason: source_down (the listing re-read before the call, on some PP stage, failed: the source flaps), unsupported (no lever works on this SGLang) or transfer_live (decode: the transfer started and the prefill peer is not known to have stopped sending; held for SGLang's own timeout).",
			append(rank, "reason")...),
		verdictLookups: desc("prefill_verdict_lookups_total", "Lookups of the prefill side's verdict on the room of a stuck decode request whose transfer started, by answer (stopped, live, in_queue, unknown, error). Only stopped lets the request be released early.",
			"verdict"),
		ledgerRooms: desc("prefill_released_rooms", "Rooms this watchdog released on prefill and still remembers, to answer decode-side verdict lookups."),
		wedgeOrders: desc("wedge_orders_total", "Calls for standing wedge orders on diagnosed transfer wedges (one order fails every room queued behind its wedge), by result (ordered: a new order stands, renewed, would_order: dry run, wedge_cleared: the chunk left the worker first, rate_limited: held back by the fail-fast budget, unsupported, rejected, error). The rooms an order failed count in force_fails_total with trigger fail_fast.",
			"result"),
		restartMode: desc("restart_mode", "1 for the restart escalation mode in force (off, dry-run, auto), 0 for the others: --restart.mode, capped at the mode in --force-fail.mode-file while that file holds one.",
			"mode"),
		modeChanges:    desc("mode_changes_total", "Changes of the force-fail or restart mode since the watchdog started: the mode file changed, appeared or went away."),
		modeFileErrors: desc("mode_file_errors_total", "Reads of --force-fail.mode-file (one a watch cycle) that found no valid mode: content other than off, dry-run or auto, or a file that exists but cannot be read. The modes stay as they were."),
	}
}

// Describe implements prometheus.Collector.
func (e *Exporter) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		e.scrapeSuccess, e.scrapeDuration, e.scrapeFailures, e.queueRequests, e.inflightRequests, e.oldestAge,
		e.ageHist, e.stuck, e.gaugePinned, e.gaugeUnchanged, e.sinceProgress, e.loopStall, e.wedged,
		e.forceFails, e.skips, e.mode, e.tracked, e.limitHits, e.lastCycle, e.webhook,
		e.transferWedged, e.transferWedges, e.restarts, e.rankTargets, e.unactionable, e.verdictLookups, e.ledgerRooms, e.wedgeOrders,
		e.kvThreadsDead, e.restartMode, e.modeChanges, e.modeFileErrors,
	} {
		ch <- d
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Collect implements prometheus.Collector.
func (e *Exporter) Collect(ch chan<- prometheus.Metric) {
	s := e.snapshot()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}

	for _, src := range s.Sources {
		gauge(e.scrapeSuccess, boolValue(src.Up), src.Source, src.Target)
		gauge(e.scrapeDuration, src.Duration.Seconds(), src.Source, src.Target)
		counter(e.scrapeFailures, float64(src.Failures), src.Source, src.Target)
	}

	buckets := watchdog.AgeBuckets()
	ranks, targets := mergeRanks(s.Ranks)
	for i, r := range ranks {
		dp, pp, tp, role := strconv.Itoa(r.DPRank), strconv.Itoa(r.PPRank), strconv.Itoa(r.TPRank), r.Role
		if role == watchdog.RoleDecode {
			gauge(e.queueRequests, float64(r.Queues.Prealloc), "plugin", watchdog.QueueDecodePrealloc, dp, pp, tp)
			gauge(e.queueRequests, float64(r.Queues.Transfer), "plugin", watchdog.QueueDecodeTransfer, dp, pp, tp)
		} else {
			gauge(e.queueRequests, float64(r.Queues.Inflight), "plugin", watchdog.QueuePrefillInflight, dp, pp, tp)
			gauge(e.queueRequests, float64(r.Queues.Bootstrap), "plugin", watchdog.QueuePrefillBootstrap, dp, pp, tp)
			gauge(e.queueRequests, float64(r.Queues.Waiting), "plugin", watchdog.QueuePrefillWaiting, dp, pp, tp)
		}
		for _, p := range pluginapi.PollStates {
			gauge(e.inflightRequests, float64(r.ByPoll[p]), dp, pp, role, p)
		}
		gauge(e.oldestAge, r.OldestAge, dp, pp, role)
		gauge(e.stuck, float64(r.Stuck), dp, pp, role)
		gauge(e.loopStall, r.LoopStall.Seconds(), dp, pp, role)
		gauge(e.wedged, boolValue(r.Wedged), dp, pp, role)
		gauge(e.transferWedged, boolValue(r.TransferWedged), dp, pp, role)
		counter(e.transferWedges, float64(r.TransferWedges), dp, pp, role)
		gauge(e.rankTargets, float64(targets[i]), dp, pp, role)
		for _, reason := range watchdog.UnactionableReasons {
			gauge(e.unactionable, float64(r.Unactionable[reason]), dp, pp, role, reason)
		}
		if r.DeadThreads != nil {
			for _, th := range pluginapi.ThreadRoles {
				gauge(e.kvThreadsDead, float64(r.DeadThreads[th]), dp, pp, role, th)
			}
		}
		cum := make(map[float64]uint64, len(buckets))
		for i, b := range buckets {
			cum[b] = r.AgeBuckets[i]
		}
		ch <- prometheus.MustNewConstHistogram(e.ageHist, r.AgeCount, r.AgeSum, cum, dp, pp, role)
	}

	if s.MetricsSampled {
		gauge(e.sinceProgress, s.SinceProgress.Seconds())
	}
	for _, g := range s.Gauges {
		k := g.Key
		gauge(e.queueRequests, g.Value, "metrics", k.Queue, k.DP, k.PP, k.TP)
		gauge(e.gaugePinned, boolValue(g.Pinned), k.Queue, k.DP, k.PP, k.TP)
		gauge(e.gaugeUnchanged, g.Unchanged.Seconds(), k.Queue, k.DP, k.PP, k.TP)
	}

	for _, role := range s.Roles {
		for _, res := range watchdog.Results {
			for _, tr := range watchdog.Triggers {
				counter(e.forceFails, float64(s.RoleForceFails[[3]string{res, tr, role}]), res, tr, role)
			}
		}
		for _, r := range watchdog.SkipReasons {
			counter(e.skips, float64(s.RoleSkips[[2]string{r, role}]), r, role)
		}
	}
	for _, v := range watchdog.VerdictAnswers {
		counter(e.verdictLookups, float64(s.VerdictLookups[v]), v)
	}
	gauge(e.ledgerRooms, float64(s.LedgerRooms))
	for _, m := range watchdog.Modes {
		gauge(e.mode, boolValue(m == s.Mode), string(m))
		gauge(e.restartMode, boolValue(m == s.RestartMode), string(m))
	}
	counter(e.modeChanges, float64(s.ModeChanges))
	counter(e.modeFileErrors, float64(s.ModeFileErrors))
	gauge(e.tracked, float64(s.TrackedRooms))
	counter(e.limitHits, float64(s.RoomLimitHits))
	gauge(e.lastCycle, s.LastCycle.Seconds())
	for _, r := range watchdog.WebhookResults {
		counter(e.webhook, float64(s.Webhook[r]), r)
	}
	for _, r := range watchdog.RestartResults {
		counter(e.restarts, float64(s.Restarts[r]), r)
	}
	for _, r := range watchdog.OrderResults {
		counter(e.wedgeOrders, float64(s.WedgeOrders[r]), r)
	}
}

// mergeRanks folds ranks that report the same dp_rank and pp_rank (two
// URLs reaching one rank, or a wrong port mapping) into one, so that their
// series never clash and nothing is dropped: counts add up, ages, stalls
// and verdicts take the worst. It also returns how many targets each
// merged rank has.
func mergeRanks(in []watchdog.RankSnapshot) ([]watchdog.RankSnapshot, []int) {
	var out []watchdog.RankSnapshot
	var targets []int
	type rankKey struct {
		role   string
		dp, pp int
	}
	at := map[rankKey]int{}
	for _, r := range in {
		k := rankKey{r.Role, r.DPRank, r.PPRank}
		i, ok := at[k]
		if !ok {
			at[k] = len(out)
			r.ByPoll = maps.Clone(r.ByPoll)
			r.Unactionable = maps.Clone(r.Unactionable)
			r.DeadThreads = maps.Clone(r.DeadThreads)
			r.AgeBuckets = slices.Clone(r.AgeBuckets)
			out = append(out, r)
			targets = append(targets, 1)
			continue
		}
		m := &out[i]
		targets[i]++
		m.Queues.Inflight += r.Queues.Inflight
		m.Queues.Bootstrap += r.Queues.Bootstrap
		m.Queues.Waiting += r.Queues.Waiting
		m.Queues.Prealloc += r.Queues.Prealloc
		m.Queues.Transfer += r.Queues.Transfer
		for p, n := range r.ByPoll {
			m.ByPoll[p] += n
		}
		for reason, n := range r.Unactionable {
			m.Unactionable[reason] += n
		}
		if r.DeadThreads != nil && m.DeadThreads == nil {
			m.DeadThreads = map[string]int{}
		}
		for th, n := range r.DeadThreads {
			m.DeadThreads[th] += n
		}
		m.OldestAge = max(m.OldestAge, r.OldestAge)
		m.Stuck += r.Stuck
		m.LoopStall = max(m.LoopStall, r.LoopStall)
		m.Wedged = m.Wedged || r.Wedged
		m.TransferWedged = m.TransferWedged || r.TransferWedged
		m.TransferWedges += r.TransferWedges
		for j := range m.AgeBuckets {
			m.AgeBuckets[j] += r.AgeBuckets[j]
		}
		m.AgeCount += r.AgeCount
		m.AgeSum += r.AgeSum
	}
	return out, targets
}
