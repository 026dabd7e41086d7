// Small helpers for writing rules.
{
  // selector renders metric{matchers...}, leaving out empty matchers; with no
  // matcher left it is the bare metric name.
  selector(metric, matchers)::
    local ms = std.filter(function(m) m != '', matchers);
    if ms == [] then metric else metric + '{' + std.join(', ', ms) + '}',

  // oneLine folds a text block into one line, like YAML's >- style: the
  // lines are joined with a space and the trailing newline goes.
  oneLine(text)::
    std.rstripChars(std.strReplace(text, '\n', ' '), ' '),
}
