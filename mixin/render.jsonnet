// Every file the mixin renders, by path relative to the output directory
// (the repository root for `go generate ./mixin/`). config is merged into
// _config; mixin/render passes the file given with -config.
function(config={})
  local mixin = (import 'mixin.libsonnet') + { _config+:: config };
  local comment(text) = std.join('', [
    (if l == '' then '#' else '# ' + l) + '\n'
    for l in std.split(std.rstripChars(text, '\n'), '\n')
  ]);
  local generated = |||
    Rendered from the sglang-watchdog mixin (mixin/, README.md "Use the mixin"); do not edit.
    Change mixin/ or its _config and render again.

  |||;
  {
    ['alerts/' + g.file]:
      comment(generated + g.header)
      + std.manifestYamlDoc({ groups: [g] }, indent_array_in_object=true, quote_keys=false)
      + '\n'
    for g in mixin.prometheusAlerts.groups
  } + {
    ['dashboards/' + name]: std.manifestJsonEx(mixin.grafanaDashboards[name], '  ') + '\n'
    for name in std.objectFields(mixin.grafanaDashboards)
  }
