// Range windows and full-window guards derived from the scrape interval.
//
// Prometheus 2 selects a range [t-W, t] (closed); Prometheus 3 selects (t-W, t]
// (left-open). When samples fall exactly on the window's start, as they do in
// promtool unit tests and whenever scrape and evaluation are aligned, the two
// versions see a different number of samples, and a rule fires one evaluation
// apart. Every rule therefore selects W + scrape_interval/2: the start then
// falls between two scrapes, both versions select the same samples (those of
// the last W, start included), and a window always holds W/scrape_interval or
// W/scrape_interval + 1 samples.
local duration = import 'duration.libsonnet';

{
  // range is the selector window for a nominal window w.
  range(w, scrapeInterval)::
    duration.format(duration.millis(w) + std.floor(duration.millis(scrapeInterval) / 2)),

  // minSamples is the sample count that proves a series has existed for
  // (almost) the whole nominal window w: 90% of the scrapes it spans, so that a
  // few missed scrapes do not blind a rule, while a series that appeared a
  // moment ago (restart, new pod) cannot fire on a partial window.
  minSamples(w, scrapeInterval)::
    local n = std.floor(0.9 * duration.millis(w) / duration.millis(scrapeInterval));
    assert n >= 2 : 'window %s holds fewer than 3 scrapes of %s' % [w, scrapeInterval];
    n,
}
