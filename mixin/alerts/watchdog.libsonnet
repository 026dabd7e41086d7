// Alerts on the metrics of sglang-watchdog itself (docs/metrics.md), group
// sglang-watchdog, rendered to alerts/watchdog.rules.yml.
//
// Severity: critical pages (a request or a scheduler is stuck now and needs a
// human or the force-fail lever); warning goes to the ticket queue (the watchdog
// is blind, or its remedy is not working, or a softer signal needs a look).
//
// Labels: rules keep the labels of the series they select. A stuck-request
// alert therefore carries dp_rank, pp_rank plus the target labels Prometheus
// adds (instance, job, and namespace/pod under Kubernetes); the watchdog's
// Alertmanager webhook (--alertmanager.webhook) uses dp_rank and pp_rank to find
// the rank to act on.
//
// runbook_url is added to every alert by alerts.libsonnet.
local promql = import '../lib/promql.libsonnet';
local windows = import '../lib/windows.libsonnet';

{
  prometheusAlerts+:: {
    local cfg = $._config,
    local range(w) = windows.range(w, cfg.scrapeInterval),
    local on(labels) = std.join(', ', [cfg.clusterLabel] + labels),
    local up = promql.selector('up', [cfg.watchdogSelector]),
    // Every rule selects the watchdog's job too: other jobs may export
    // sglang_watchdog_* (a federation, a second install under another job).
    local sel(metric, matchers=[]) = promql.selector(metric, [cfg.watchdogSelector] + matchers),
    local inc(metric, matchers, window) = 'increase(%s[%s]) > 0' % [sel(metric, matchers), range(window)],
    // inMode keeps the series of expr whose watchdog's force-fail mode
    // matches modeMatcher, with that mode as their mode label.
    local inMode(expr, modeMatcher) = '(%s) * on (%s) group_left (mode) (%s == 1)' % [
      expr,
      on(['instance']),
      sel('sglang_watchdog_force_fail_mode', [modeMatcher]),
    ],

    groups+: [{
      name: 'sglang-watchdog',
      // The rule file under alerts/ that holds this group.
      file:: 'watchdog.rules.yml',
      // Rendered as the file's header comment.
      header:: |||
        Alerts on the metrics of sglang-watchdog itself (docs/metrics.md).
        Load this file when the watchdog runs beside SGLang; load alerts/sglang-raw.rules.yml
        instead (or as well) when Prometheus only scrapes SGLang's own /metrics.

        Severity: critical pages (a request or a scheduler is stuck now and needs a human or
        the force-fail lever), warning goes to the ticket queue (the watchdog is blind, or
        its remedy is not working, or a softer signal that needs a look).

        Job selector: SGLangWatchdogDown and SGLangWatchdogAbsent select %(up)s.
        Every other rule selects the watchdog's own metric names (sglang_watchdog_*), which
        nothing else exports. To retarget, render the mixin with your own watchdogSelector
        (README.md, "Use the mixin") rather than editing this file.

        Windows are derived from a %(scrapeInterval)s scrape (scrapeInterval in the mixin's _config).
      ||| % { up: up, scrapeInterval: cfg.scrapeInterval },
      rules: [
        // A stuck request pages only where the watchdog is in auto mode and
        // still finds it stuck after it should have released it: the
        // watchdog acts on the cycle a request becomes stuck, so one still
        // there a minute later was rate-limited, refused, unconfirmed or
        // could not be acted on. In dry-run and off (the recommended soak,
        // or an SRE's stand-down through --force-fail.mode-file) nothing
        // will release it and nobody asked the watchdog to: the same alert
        // is a warning that says what auto mode would do. The mode comes
        // from sglang_watchdog_force_fail_mode, so a runtime switch changes
        // the severity too; the alert carries it as its mode label. Both
        // keep the name the Alertmanager webhook acts on
        // (--alertmanager.webhook), which in dry-run mode is the warning.
        //
        // The watchdog already waits --watchdog.deadline (60s) and
        // --watchdog.stall-window (30s) before it counts a request as stuck;
        // `for` only rides out one cycle in which auto mode or the webhook
        // releases it. Decode requests have their own alert below.
        {
          alert: 'SGLangWatchdogRequestStuck',
          expr: inMode(sel('sglang_watchdog_stuck_requests', ['role!="decode"']) + ' > 0', 'mode="auto"'),
          'for': '1m',
          labels: { severity: 'critical' },
          annotations: {
            summary: 'A request is stuck in the SGLang prefill inflight queue and the watchdog in auto mode has not released it.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} request(s) on dp_rank {{ $labels.dp_rank }} pp_rank
              {{ $labels.pp_rank }} of {{ $labels.instance }} have been in the prefill
              inflight queue longer than the watchdog deadline with no KV transfer progress
              while the scheduler loop keeps running, and the watchdog, in auto mode, has not
              released them for a minute: its force-fail was rate-limited, refused,
              unconfirmed or not possible (sglang_watchdog_force_fail_skips_total,
              sglang_watchdog_force_fails_total). Each one holds KV pages and a client
              connection until it is released.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogRequestStuck',
          expr: inMode(sel('sglang_watchdog_stuck_requests', ['role!="decode"']) + ' > 0', 'mode!="auto"'),
          'for': '1m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A request is stuck in the SGLang prefill inflight queue; the watchdog is not in auto mode and leaves it.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} request(s) on dp_rank {{ $labels.dp_rank }} pp_rank
              {{ $labels.pp_rank }} of {{ $labels.instance }} have been in the prefill
              inflight queue longer than the watchdog deadline with no KV transfer progress
              while the scheduler loop keeps running. The watchdog runs in {{ $labels.mode }}
              mode and does not release them: in auto mode it would force-fail each one
              through the plugin, within --force-fail.max-per-minute (dry-run counts those
              calls as result="would_flip"). Each one holds KV pages and a client connection
              until it is force-failed by hand or the mode is switched to auto.
            |||),
          },
        },
        // A decode request counts as stuck after --watchdog.decode-deadline
        // (180s) and the stall window. In auto mode the watchdog releases it
        // unless its transfer may still be written (transfer_live); SGLang's
        // own waiting timeout (300s) fails most of the rest. `for: 5m`
        // leaves both their time and pages only for what outlives them: a
        // request SGLang never times out (Mooncake Transferring) holds its
        // slot and KV pages for ever. Severity by mode as above.
        {
          alert: 'SGLangWatchdogDecodeRequestStuck',
          expr: inMode(sel('sglang_watchdog_stuck_requests', ['role="decode"']) + ' > 0', 'mode="auto"'),
          'for': '5m',
          labels: { severity: 'critical' },
          annotations: {
            summary: 'A request is stuck in the SGLang decode prealloc or transfer queue and the watchdog in auto mode has not released it.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} decode request(s) on dp_rank {{ $labels.dp_rank }}
              pp_rank {{ $labels.pp_rank }} of {{ $labels.instance }} have waited for their
              KV cache longer than the decode deadline with no progress for over 5 minutes,
              and neither the watchdog in auto mode nor SGLang's own timeout released them.
              Each one holds a decode slot, KV pages and a client connection.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogDecodeRequestStuck',
          expr: inMode(sel('sglang_watchdog_stuck_requests', ['role="decode"']) + ' > 0', 'mode!="auto"'),
          'for': '5m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A request is stuck in the SGLang decode prealloc or transfer queue; the watchdog is not in auto mode and leaves it.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} decode request(s) on dp_rank {{ $labels.dp_rank }}
              pp_rank {{ $labels.pp_rank }} of {{ $labels.instance }} have waited for their
              KV cache longer than the decode deadline with no progress for over 5 minutes.
              The watchdog runs in {{ $labels.mode }} mode and does not release them: in auto
              mode it would force-fail each one whose transfer is known to have stopped,
              within --decode.max-per-minute. Each one holds a decode slot, KV pages and a
              client connection.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogSchedulerWedged',
          expr: sel('sglang_watchdog_scheduler_wedged') + ' == 1',
          'for': '1m',
          labels: { severity: 'critical' },
          annotations: {
            summary: 'An SGLang prefill scheduler loop has stopped while requests are queued.',
            description: promql.oneLine(|||
              The scheduler loop of dp_rank {{ $labels.dp_rank }} pp_rank {{ $labels.pp_rank }}
              on {{ $labels.instance }} has not advanced for the stall window while its
              inflight queue holds requests. Force-fail cannot work on a wedged rank;
              the server needs a restart.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogTransferWedged',
          // transfer_wedged is 1 from the cycle a wedge is diagnosed (a stuck
          // room with a transfer in flight, or an orphaned transfer on a queue
          // that does not move) or suspected (older plugin). `for` rides out a
          // restart escalation (--restart.mode).
          expr: sel('sglang_watchdog_transfer_wedged') + ' == 1',
          'for': '1m',
          labels: { severity: 'critical' },
          annotations: {
            summary: 'An SGLang KV transfer worker is wedged; every request queued behind it hangs.',
            description: promql.oneLine(|||
              A KV transfer queue of dp_rank {{ $labels.dp_rank }} pp_rank {{ $labels.pp_rank }}
              on {{ $labels.instance }} is wedged on a transfer that never completes. Requests
              bound for the same decode endpoints queue behind it and never finish; force-fail
              answers their clients but cannot free the worker. Only a restart of the prefill
              server clears it.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogKVThreadDead',
          // A dead thread that serves requests stops the rank: a dead
          // bootstrap thread leaves every later request in the bootstrap
          // queue, a dead transfer worker never drains its queue, a dead
          // decode_thread (Mooncake) never tells a decode request its KV
          // arrived. SGLang never restarts them. `for` rides out a restart
          // escalation (--restart.mode), which acts after the stall window.
          expr: sel('sglang_watchdog_kv_threads_dead', ['thread=~"bootstrap|transfer_worker|decode_listener"']) + ' > 0',
          'for': '1m',
          labels: { severity: 'critical' },
          annotations: {
            summary: 'A thread of an SGLang KV manager that serves requests has died; the rank stops serving.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} {{ $labels.thread }} thread(s) of the KV manager of
              {{ $labels.role }} dp_rank {{ $labels.dp_rank }} pp_rank {{ $labels.pp_rank }} on
              {{ $labels.instance }} have died. SGLang does not notice nor restart them: the
              requests that need them hang (a dead transfer worker's queued requests are
              force-failed past the deadline in auto mode). Only a restart of the SGLang server
              brings the thread back.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogKVHelperThreadDead',
          // A dead heartbeat checker only stops noticing dead prefill peers
          // (SGLang's waiting timeout still frees their requests); what an
          // "other" thread did is unknown. A ticket, not a page; never
          // escalated to a restart.
          expr: sel('sglang_watchdog_kv_threads_dead', ['thread=~"heartbeat|other"']) + ' > 0',
          'for': '5m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A helper thread of an SGLang KV manager has died.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} {{ $labels.thread }} thread(s) of the KV manager of
              {{ $labels.role }} dp_rank {{ $labels.dp_rank }} pp_rank {{ $labels.pp_rank }} on
              {{ $labels.instance }} have died. Requests are still served, but what the thread
              watched (heartbeat: the prefill peers' liveness) goes unwatched until the SGLang
              server restarts.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogRestartEscalated',
          // Every restart escalation is alerted on, whatever its result:
          // restarted (the plugin ended the server), or refused/failed (the
          // wedge is still there).
          expr: inc('sglang_watchdog_restarts_total', ['result!="would_restart"'], '30m'),
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The watchdog asked the SGLang plugin to restart a server with a wedged transfer worker or a dead KV thread.',
            description: promql.oneLine(|||
              {{ $labels.instance }} escalated a transfer wedge or a dead KV manager thread to
              a restart in the last 30 minutes with result {{ $labels.result }}
              ({{ printf "%.0f" $value }} time(s)). "restarted" means the plugin ended the
              scheduler so that the orchestrator restarts the server; any other result means
              the wedge or the dead thread was left in place.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogRankCollision',
          expr: sel('sglang_watchdog_rank_targets') + ' > 1',
          'for': '5m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Several watchdog plugin URLs report the same SGLang rank.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} plugin URLs of {{ $labels.instance }} report dp_rank
              {{ $labels.dp_rank }} pp_rank {{ $labels.pp_rank }}. The rank's series add up
              those targets; another rank is probably not watched at all. Fix --plugin.url
              or the plugin's port mapping.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogStuckUnactionable',
          expr: sel('sglang_watchdog_stuck_unactionable_requests') + ' > 0',
          'for': '10m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Stuck SGLang requests cannot be force-failed by the watchdog.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} stuck request(s) on dp_rank {{ $labels.dp_rank }} pp_rank
              {{ $labels.pp_rank }} of {{ $labels.instance }} cannot be force-failed: reason
              {{ $labels.reason }} (source_down: the plugin listing fails intermittently and the
              re-read before each call fails; unsupported: no lever works on this SGLang;
              transfer_live: a decode request whose KV transfer may still be written, held
              until its prefill peer says it stopped or SGLang times it out).
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogQueueGaugePinned',
          // queue_pinned already means "non-zero, unchanged for
          // --watchdog.pin-window (2m), no progress counter moved". Ranks where
          // the plugin already reports a stuck request or a wedged loop are left
          // to those (critical) alerts.
          expr: |||
            %(pinned)s == 1
            unless on (%(on)s) (%(stuck)s > 0)
            unless on (%(on)s) (%(wedged)s == 1)
          ||| % {
            on: on(['instance', 'dp_rank', 'pp_rank']),
            pinned: sel('sglang_watchdog_queue_pinned'),
            stuck: sel('sglang_watchdog_stuck_requests'),
            wedged: sel('sglang_watchdog_scheduler_wedged'),
          },
          'for': '5m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'An SGLang PD queue gauge is pinned at a non-zero value with no progress.',
            description: promql.oneLine(|||
              SGLang's {{ $labels.queue }} queue gauge on dp_rank {{ $labels.dp_rank }} pp_rank
              {{ $labels.pp_rank }} tp_rank {{ $labels.tp_rank }} of {{ $labels.instance }}
              has stayed non-zero and unchanged while no progress counter moved.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogPrefillVerdictUnavailable',
          // A decode-side watchdog asks the prefill peer's watchdog whether it
          // stopped sending before it releases a decode request whose transfer
          // started. Failed lookups (no --decode.prefill-watchdog-url, a host
          // outside --decode.prefill-networks, the peer unreachable or refusing)
          // leave every such request to SGLang's own timeout.
          expr: inc('sglang_watchdog_prefill_verdict_lookups_total', ['verdict="error"'], '15m'),
          'for': '15m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The watchdog cannot ask the prefill side whether decode transfers stopped.',
            description: promql.oneLine(|||
              Lookups of the prefill watchdog's per-room verdict from {{ $labels.instance }}
              have been failing for 15 minutes: stuck decode requests whose KV transfer
              started are held until SGLang's own timeout, never released early.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogForceFailFailing',
          expr: inc('sglang_watchdog_force_fails_total', ['result=~"error|rejected|not_found"'], '10m'),
          labels: { severity: 'warning' },
          annotations: {
            summary: "The watchdog's force-fail calls to the SGLang plugin are failing.",
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} force-fail call(s) ({{ $labels.trigger }} trigger)
              from {{ $labels.instance }} ended with result {{ $labels.result }} in the
              last 10 minutes; the stuck requests they targeted may still be held.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogForceFailUnconfirmed',
          expr: inc('sglang_watchdog_force_fails_total', ['result="unconfirmed"'], '15m'),
          labels: { severity: 'warning' },
          annotations: {
            summary: 'A force-failed SGLang request was not seen to be released.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} force-fail(s) ({{ $labels.trigger }} trigger) from
              {{ $labels.instance }} set the lever but the room did not leave the inflight
              queue, or sglang:num_transfer_failed_reqs_total did not rise, within the
              confirm timeout in the last 15 minutes.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogForceFailRateLimited',
          expr: inc('sglang_watchdog_force_fail_skips_total', ['reason="rate_limited"'], '15m'),
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Stuck SGLang requests were left in place by the force-fail rate limit.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} {{ $labels.role }} request(s) seen by {{ $labels.instance }}
              were not force-failed in the last 15 minutes because their budget was spent
              (--force-fail.max-per-minute, --force-fail.fail-fast-max-per-minute behind a
              wedge, or --decode.max-per-minute); many rooms are stuck at once.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogModeFileInvalid',
          // The file is read every cycle, and every read of bad content
          // counts: the counter rises for as long as the file stays bad. An
          // SRE who meant to stand the watchdog down (off, dry-run) during an
          // incident must learn within minutes that the old mode still holds.
          expr: inc('sglang_watchdog_mode_file_errors_total', [], '2m'),
          'for': '1m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The watchdog cannot use its mode file; the previous mode still holds.',
            description: promql.oneLine(|||
              {{ $labels.instance }} read its --force-fail.mode-file {{ printf "%.0f" $value }}
              time(s) in the last 2 minutes without finding off, dry-run or auto in it: the
              force-fail and restart modes stay what they were before the file changed
              (sglang_watchdog_force_fail_mode). Fix the ConfigMap; the watchdog log names the
              file and its content.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogRoomLimitHit',
          expr: inc('sglang_watchdog_room_limit_hits_total', [], '15m'),
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The watchdog saw more inflight rooms than it may track.',
            description: promql.oneLine(|||
              {{ $labels.instance }} read {{ printf "%.0f" $value }} listing(s) in the last
              15 minutes that held more rooms than --watchdog.max-rooms; the excess rooms
              are not watched.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogSGLangScrapeFailing',
          // 10m rides out an SGLang restart (model load) without a ticket.
          expr: sel('sglang_watchdog_scrape_success', ['source="metrics"']) + ' == 0',
          'for': '10m',
          labels: { severity: 'warning' },
          annotations: {
            summary: "The watchdog cannot read SGLang's /metrics.",
            description: promql.oneLine(|||
              {{ $labels.instance }} has failed to read SGLang's metrics at {{ $labels.target }}
              for 10 minutes; pinned queue gauges cannot be detected.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogPluginScrapeFailing',
          expr: sel('sglang_watchdog_scrape_success', ['source="plugin"']) + ' == 0',
          'for': '10m',
          labels: { severity: 'warning' },
          annotations: {
            summary: "The watchdog cannot read the SGLang plugin's inflight listing.",
            description: promql.oneLine(|||
              {{ $labels.instance }} has failed to read the plugin listing at
              {{ $labels.target }} for 10 minutes; stuck requests and wedged schedulers on
              that rank cannot be detected or released. A scheduler log line "plugin cannot
              listen on ... port" means another process holds the plugin's port
              (docs/deployment.md, Ports).
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogDown',
          expr: '%s == 0' % up,
          'for': '5m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'Prometheus cannot scrape an sglang-watchdog.',
            description: promql.oneLine(|||
              The watchdog target {{ $labels.instance }} of job {{ $labels.job }} has been
              down for 5 minutes; stuck requests on its SGLang server are not being watched.
            |||),
          },
        },
        {
          alert: 'SGLangWatchdogAbsent',
          // Fires when no watchdog target is up at all, including when service
          // discovery finds none (then SGLangWatchdogDown has nothing to fire on).
          expr: 'absent(%s == 1)' % up,
          'for': '10m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'No sglang-watchdog is being scraped successfully.',
            description: promql.oneLine(|||
              No target selected by %s has been up for 10 minutes{{ with $labels.job }}
              (job {{ . }}){{ end }}; stuck SGLang requests are not being watched anywhere.
            ||| % up),
          },
        },
      ],
    }],
  },
}
