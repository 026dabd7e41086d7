// Small helpers for writing rules.
{
  // selector renders metric{matchers...}, leaving out empty matchers; with no
  // matcher left it is the bare metric name.
  selector(metric, matchers)::
    local ms = std.filter(function(m) m != '', matchers);
    if ms == [] then metric else metric + '{' + std.join(', ', ms) + '}',

  // oneLine folds a text block into one line, like YAML's >- style: the
  // lines are joined with a space and the trailing newline goes.
  // where names the target of an alert in its description: namespace/pod
  // under Kubernetes (the PodMonitor's target labels), where an instance
  // (the pod IP) tells a reader little, and the instance elsewhere.
  where:: '{{ with $labels.pod }}{{ $labels.namespace }}/{{ . }}{{ else }}{{ $labels.instance }}{{ end }}',

  oneLine(text)::
    std.rstripChars(std.strReplace(text, '\n', ' '), ' '),
}
