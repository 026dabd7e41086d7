// The mixin's settings. Override any of them the kube-prometheus way:
//   (import 'mixin.libsonnet') + { _config+:: { scrapeInterval: '30s' } }
{
  _config+:: {
    // Label matchers of the scrape job(s) of sglang-watchdog. Used where a rule
    // or the dashboard must name the job: up{...} in SGLangWatchdogDown and
    // SGLangWatchdogAbsent, and the dashboard's job variable. Every other
    // watchdog rule selects sglang_watchdog_* names, which nothing else exports.
    watchdogSelector: 'job=~"sglang-watchdog.*"',

    // Extra label matchers for SGLang's own series in the sglang-raw rules
    // (for example 'job="sglang-prefill"'); empty selects every job.
    sglangSelector: '',

    // The label that tells clusters apart when several report to one
    // Prometheus (Thanos, Mimir). Rules match and aggregate on it together with
    // instance, and the dashboard filters by it.
    clusterLabel: 'cluster',
    // Show the dashboard's cluster variable. Off for a single cluster.
    showMultiCluster: false,

    // How often Prometheus scrapes SGLang and the watchdog. Every range window
    // of the rules is derived from it (see lib/windows.libsonnet).
    scrapeInterval: '15s',

    // Where each alert's runbook_url points; %s is the alert name in lower case.
    runbookURLPattern: 'https://github.com/sglang-watchdog/sglang-watchdog/blob/v0.1.0/docs/runbook.md#%s',

    // The dashboard's uid, title and tags.
    dashboardUID: 'sglang-watchdog',
    dashboardTitle: 'SGLang PD watchdog',
    dashboardTags: ['sglang', 'sglang-watchdog', 'pd-disaggregation', 'generated'],
  },
}
