// Alerts on SGLang's own /metrics for users who run only Prometheus (no
// watchdog), group sglang-raw, rendered to alerts/sglang-raw.rules.yml.
//
// Matching. SGLang's families carry different labels (tokenizer counters:
// model_name only; scheduler gauges and counters: engine_type, model_name,
// tp_rank, pp_rank, [dp_rank, moe_ep_rank, priority, pid] depending on the
// version), so a plain `and` or `unless` between them never matches. Progress is
// summed per scrape target and matched with `on (cluster, instance)`: every
// family comes from the same /metrics endpoint.
//
// Queue gauges are selected with {priority=""}: with priority scheduling the
// newest SGLang exports the total under priority="" (no label) and a breakdown
// under priority="<n>"; older versions have no priority label, which
// {priority=""} matches.
//
// Progress is "anything left the queue": a counter that the server does not
// have (older versions, lazily created series) simply contributes nothing to
// the `unless` side, so a missing counter never silences or breaks a rule.
local promql = import '../lib/promql.libsonnet';
local windows = import '../lib/windows.libsonnet';

{
  prometheusAlerts+:: {
    local cfg = $._config,
    // W: the window of every "pinned" rule; with `for: 5m` an alert needs
    // about 10 minutes of no progress.
    local w = '5m',
    local range(x) = windows.range(x, cfg.scrapeInterval),
    local sel(metric, matchers=[]) = promql.selector(metric, matchers + [cfg.sglangSelector]),
    local gauge(metric) = sel(metric, ['priority=""']),
    local by = std.join(', ', [cfg.clusterLabel, 'instance']),

    // The gauge has been non-zero for the whole window, and changed (op '>')
    // or did not change (op '==') in it. The full-window guard keeps a series
    // that has just appeared (SGLang or Prometheus restart, new pod) from firing
    // on a partial window.
    local held(metric, op) =
      local g = gauge(metric), r = range(w);
      std.join('\n', [
        '  min_over_time(%s[%s]) > 0' % [g, r],
        'and',
        '  changes(%s[%s]) %s 0' % [g, r, op],
        'and',
        '  count_over_time(%s[%s]) >= %d' % [g, r, windows.minSamples(w, cfg.scrapeInterval)],
      ]),

    // Anything left the queue on the scrape target: one line per counter.
    local progress(counters) = std.join('\nor\n', [
      '  sum by (%s) (increase(%s[%s])) > 0' % [by, sel(c[0], c[1]), range(w)]
      for c in counters
    ]),
    local indent(text, n) =
      local pad = std.repeat(' ', n);
      std.join('\n', [if l == '' then l else pad + l for l in std.split(std.rstripChars(text, '\n'), '\n')]),

    local prefillProgress = progress([
      ['sglang:num_transfer_failed_reqs_total', []],
      ['sglang:per_stage_req_latency_seconds_count', ['stage="prefill_transfer_kv_cache"']],
      ['sglang:prompt_tokens_total', []],
      ['sglang:num_requests_total', []],
    ]),
    local decodeProgress = progress([
      ['sglang:num_transfer_failed_reqs_total', []],
      ['sglang:num_bootstrap_failed_reqs_total', []],
      ['sglang:per_stage_req_latency_seconds_count', ['stage="decode_transferred"']],
      ['sglang:generation_tokens_total', []],
      ['sglang:num_requests_total', []],
    ]),
    local unlessProgress(left, counters) = |||
      (
      %(left)s
      )
      unless on (%(by)s)
      (
      %(progress)s
      )
    ||| % { left: indent(left, 2), by: by, progress: indent(counters, 2) },
    local decodeQueue(metric, queue) = |||
      label_replace(
        (
      %(held)s
        ),
        "queue", "%(queue)s", "", "")
    ||| % { held: indent(held(metric, '=='), 2), queue: queue },

    groups+: [{
      name: 'sglang-raw',
      // The rule file under alerts/ that holds this group.
      file:: 'sglang-raw.rules.yml',
      header:: |||
        Alerts on SGLang's own /metrics, for users who run only Prometheus (no watchdog).
        With the watchdog deployed, alerts/watchdog.rules.yml is more precise (it sees each
        request); the two files use different alert names and can be loaded together.

        What raw metrics can and cannot see (docs/runbook.md): the PD queue gauges are
        rewritten only when a batch is logged, and the prefill loop skips its 30s idle
        refresh while the inflight queue is non-empty. A stuck request therefore freezes
        sglang:num_prefill_inflight_queue_reqs at a non-zero value; an idle healthy server
        shows 0. Under steady traffic the gauge keeps being rewritten, so a single stuck
        request is only visible to the watchdog; a wedge of the whole transfer path
        (nothing completes while new batches arrive) is SGLangPrefillKVTransferStalled.

        Windows: every "pinned" rule looks at %(w)s of a %(scrape)s scrape, with `for: 5m`, so an
        alert needs about 10 minutes of no progress. Each range is %(w)s plus half a scrape
        interval ([%(r)s]) so that Prometheus 2 (closed window) and 3 (left-open) select
        the same samples; count_over_time(...) >= %(n)d (90%% of the scrapes in %(w)s) keeps a
        series that has just appeared from firing on a partial window. Render the mixin
        with your scrapeInterval (README.md, "Use the mixin") instead of editing this file.
      ||| % { w: w, scrape: cfg.scrapeInterval, r: range(w), n: windows.minSamples(w, cfg.scrapeInterval) },
      rules: [
        {
          alert: 'SGLangPrefillInflightQueuePinned',
          expr: unlessProgress(held('sglang:num_prefill_inflight_queue_reqs', '=='), prefillProgress),
          'for': '5m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'The SGLang prefill inflight queue gauge is pinned with no request completing.',
            description: promql.oneLine(|||
              sglang:num_prefill_inflight_queue_reqs on {{ $labels.instance }}{{ with $labels.dp_rank }} dp_rank={{ . }}{{ end }}{{ with $labels.pp_rank }} pp_rank={{ . }}{{ end }}{{ with $labels.tp_rank }} tp_rank={{ . }}{{ end }}
              has stayed at {{ printf "%.0f" $value }} for at least 10 minutes while no KV
              transfer finished or failed and no request completed. Likely stuck request(s)
              holding KV pages.
            |||),
          },
        },
        {
          alert: 'SGLangPrefillKVTransferStalled',
          // The complement of the rule above: the gauge keeps changing (new
          // prefill batches arrive), yet nothing has left the inflight queue
          // for the whole window.
          expr: unlessProgress(held('sglang:num_prefill_inflight_queue_reqs', '>'), prefillProgress),
          'for': '5m',
          labels: { severity: 'critical' },
          annotations: {
            summary: 'SGLang prefill requests enter the inflight queue but none leave it.',
            description: promql.oneLine(|||
              The prefill inflight queue on {{ $labels.instance }}{{ with $labels.dp_rank }} dp_rank={{ . }}{{ end }}{{ with $labels.pp_rank }} pp_rank={{ . }}{{ end }}{{ with $labels.tp_rank }} tp_rank={{ . }}{{ end }}
              has held at least {{ printf "%.0f" $value }} request(s) and kept changing for
              at least 10 minutes, but no KV transfer finished or failed and no request
              completed. The KV transfer path is wedged.
            |||),
          },
        },
        {
          alert: 'SGLangDecodeTransferQueuePinned',
          // `queue` names the gauge: decode_transfer
          // (sglang:num_decode_transfer_queue_reqs) or decode_prealloc
          // (sglang:num_decode_prealloc_queue_reqs), as in the watchdog.
          expr: unlessProgress(
            decodeQueue('sglang:num_decode_transfer_queue_reqs', 'decode_transfer')
            + 'or\n'
            + decodeQueue('sglang:num_decode_prealloc_queue_reqs', 'decode_prealloc'),
            decodeProgress,
          ),
          'for': '5m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'An SGLang decode PD queue gauge is pinned with no request completing.',
            description: promql.oneLine(|||
              The {{ $labels.queue }} queue gauge on {{ $labels.instance }}{{ with $labels.dp_rank }} dp_rank={{ . }}{{ end }}{{ with $labels.pp_rank }} pp_rank={{ . }}{{ end }}{{ with $labels.tp_rank }} tp_rank={{ . }}{{ end }}
              has stayed at {{ printf "%.0f" $value }} for at least 10 minutes while no KV
              transfer finished or failed and no request completed.
            |||),
          },
        },
        {
          alert: 'SGLangKVTransferFailures',
          // Client aborts during a transfer and every force-fail also count
          // here, so a single failure is normal: the rule wants failures in
          // every 10m window for 15 minutes (a lone failure leaves the window
          // after 10m and never fires).
          expr: 'increase(%s[%s]) > 0' % [sel('sglang:num_transfer_failed_reqs_total'), range('10m')],
          'for': '15m',
          labels: { severity: 'warning' },
          annotations: {
            summary: 'SGLang KV cache transfers keep failing.',
            description: promql.oneLine(|||
              {{ printf "%.0f" $value }} KV transfer(s) failed on {{ $labels.instance }}{{ with $labels.engine_type }} engine_type={{ . }}{{ end }}{{ with $labels.dp_rank }} dp_rank={{ . }}{{ end }}{{ with $labels.pp_rank }} pp_rank={{ . }}{{ end }}{{ with $labels.tp_rank }} tp_rank={{ . }}{{ end }}
              in the last 10 minutes, and failures have kept occurring for at least 15
              minutes.
            |||),
          },
        },
      ],
    }],
  },
}
