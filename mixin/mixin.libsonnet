// The sglang-watchdog monitoring mixin: prometheusAlerts, grafanaDashboards
// and _config (config.libsonnet), the way kube-prometheus consumes mixins.
(import 'config.libsonnet') +
(import 'alerts/alerts.libsonnet') +
(import 'dashboards/dashboards.libsonnet')
