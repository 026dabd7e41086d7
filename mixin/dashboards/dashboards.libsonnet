// The dashboard. Its panels, queries and variables are built by the Go
// generator in the repository's dashboards/ package (grafana-foundation-sdk),
// which writes sglang-watchdog.json here with the default _config; never edit
// that file by hand, run `go generate ./mixin/`. This file applies _config to
// it, as kube-prometheus mixins do with imported dashboards:
//   - uid, title and tags;
//   - the watchdog job selector in the variable queries;
//   - the cluster label in every query, and the cluster variable shown only
//     with showMultiCluster.
local base = import 'sglang-watchdog.json';
local defaults = (import '../config.libsonnet')._config;

// mapStrings applies f to every string inside v.
local mapStrings(f, v) =
  if std.isString(v) then f(v)
  else if std.isArray(v) then [mapStrings(f, x) for x in v]
  else if std.isObject(v) then { [k]: mapStrings(f, v[k]) for k in std.objectFields(v) }
  else v;

{
  grafanaDashboards+:: {
    local cfg = $._config,
    local retarget(s) =
      std.strReplace(
        std.strReplace(s, defaults.watchdogSelector, cfg.watchdogSelector),
        defaults.clusterLabel + '=~"$cluster"',
        cfg.clusterLabel + '=~"$cluster"',
      ),
    local dashboard = mapStrings(retarget, base),

    'sglang-watchdog.json': dashboard {
      uid: cfg.dashboardUID,
      title: cfg.dashboardTitle,
      tags: cfg.dashboardTags,
      templating+: {
        list: [
          if v.name == 'cluster' then
            local q = std.strReplace(v.query, ', %s)' % defaults.clusterLabel, ', %s)' % cfg.clusterLabel);
            v { query: q, hide: if cfg.showMultiCluster then 0 else 2 }
          else v
          for v in super.list
        ],
      },
    },
  },
}
