// Every alert group of the mixin. To add an alert, add a rule to the group's
// file (or a new file here for a new group, with `header::` and `file::`), then
// `go generate ./mixin/` and add promtool cases (README.md, "Use the mixin").
// runbook_url is added below, from _config.runbookURLPattern, to every alert,
// and every {{ $labels.instance }} of a description becomes promql.where
// (namespace/pod under Kubernetes, else the instance), so that the rules
// read naturally and name the pod wherever there is one.
local promql = import '../lib/promql.libsonnet';
local groups = (import 'watchdog.libsonnet') + (import 'sglang-raw.libsonnet');

groups + {
  prometheusAlerts+:: {
    local cfg = $._config,
    groups: [
      g {
        rules: [
          if std.objectHas(r, 'alert') then
            r {
              annotations+: {
                description: std.strReplace(super.description, '{{ $labels.instance }}', promql.where),
                runbook_url: cfg.runbookURLPattern % std.asciiLower(r.alert),
              },
            }
          else r
          for r in super.rules
        ],
      }
      for g in super.groups
    ],
  },
}
