// Package alerts holds the Prometheus alerting rules of sglang-watchdog, mixin
// style, together with their promtool unit tests.
//
// Two rule files are shipped:
//
//   - watchdog.rules.yml (group sglang-watchdog) alerts on the watchdog's own
//     metrics (docs/metrics.md): stuck requests, wedged schedulers, pinned queue
//     gauges, force-fail outcomes and the watchdog's health.
//   - sglang-raw.rules.yml (group sglang-raw) alerts on SGLang's raw /metrics for
//     users who run only Prometheus.
//
// Both files are rendered from the monitoring mixin (../mixin, jsonnet) with its
// default _config by `go generate ./mixin/`; never edit them by hand. Their
// promtool unit tests (*_test.yml) run on promtool 2.x and 3.x.
//
// Every alert links to its section of docs/runbook.md. The files are embedded in
// FS; RuleFiles returns their paths in the source tree for tools that need files
// on disk (the Kubernetes PrometheusRule generator, end-to-end tests).
package alerts
