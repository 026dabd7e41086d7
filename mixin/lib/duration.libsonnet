// Prometheus durations ('15s', '1m30s', '5m7s500ms') as integer milliseconds,
// so that windows can be derived from the configured scrape interval.
local unitMillis = { d: 86400000, h: 3600000, m: 60000, s: 1000, ms: 1 };
local order = ['d', 'h', 'm', 's', 'ms'];

{
  // millis parses a duration made of d, h, m, s and ms parts.
  millis(d)::
    local chars = std.stringChars(d);
    local n = std.length(chars);
    local scan(i, num, total) =
      if i >= n then
        assert num == '' : 'duration %s: number without a unit at the end' % std.manifestJson(d);
        total
      else if std.member('0123456789', chars[i]) then
        scan(i + 1, num + chars[i], total)
      else
        local isMs = chars[i] == 'm' && i + 1 < n && chars[i + 1] == 's';
        local unit = if isMs then 'ms' else chars[i];
        assert num != '' : 'duration %s: unit %s without a number' % [std.manifestJson(d), unit];
        assert std.objectHas(unitMillis, unit) : 'duration %s: unknown unit %s (want d, h, m, s or ms)' % [std.manifestJson(d), unit];
        scan(i + (if isMs then 2 else 1), '', total + std.parseInt(num) * unitMillis[unit]);
    assert n > 0 : 'duration is empty';
    scan(0, '', 0),

  // format renders milliseconds as the shortest Prometheus duration.
  format(ms)::
    assert ms >= 0 && ms == std.floor(ms) : 'duration %s ms is not a whole, non-negative number' % ms;
    if ms == 0 then '0s'
    else
      local parts = std.foldl(
        function(acc, u)
          local q = std.floor(acc.rest / unitMillis[u]);
          { rest: acc.rest - q * unitMillis[u], out: acc.out + (if q > 0 then std.toString(q) + u else '') },
        order,
        { rest: ms, out: '' },
      );
      parts.out,
}
