package logging

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
)

// newLogger is New over buf with a level and format as the flags spell them.
func newLogger(t *testing.T, buf *bytes.Buffer, lvl, format string) log.Logger {
	t.Helper()
	cfg, err := ParseConfig(lvl, format)
	if err != nil {
		t.Fatal(err)
	}
	return New(buf, cfg)
}

// timestampLayout is promslog's go-kit style ts: UTC, milliseconds.
const timestampLayout = "2006-01-02T15:04:05.000Z07:00"

func TestLevelFilterAndFormat(t *testing.T) {
	var buf bytes.Buffer
	logger := newLogger(t, &buf, "warn", "logfmt")
	level.Info(logger).Log("msg", "hidden")
	logger.Log("msg", "no level is info: hidden too")
	level.Warn(logger).Log("msg", "shown", "rid", "abc", "took", 1500*time.Millisecond)
	out := strings.TrimSpace(buf.String())
	if strings.Contains(out, "hidden") || strings.Count(out, "\n") != 0 {
		t.Errorf("info lines passed a warn filter: %s", out)
	}
	// go-kit's shape, as promslog's go-kit style writes it: ts first, then
	// level, caller, msg and the pairs in the order given.
	if !regexp.MustCompile(`^ts=\S+ level=warn caller=logging_test\.go:\d+ msg=shown rid=abc took=1.5s$`).MatchString(out) {
		t.Errorf("line %q is not ts, level, caller, msg and the pairs", out)
	}
}

// The level of a line can be raised or lowered per line by go-kit's level
// package alone: every value maps to promslog's, and debug passes a debug
// filter.
func TestEveryLevelMaps(t *testing.T) {
	var buf bytes.Buffer
	logger := newLogger(t, &buf, "debug", "json")
	for _, l := range []func(log.Logger) log.Logger{level.Debug, level.Info, level.Warn, level.Error} {
		l(logger).Log("msg", "x")
	}
	logger.Log("msg", "x", "odd")
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		f := fieldsOf(t, line)
		got = append(got, f["level"])
		if f["odd"] != "" && f["odd"] != log.ErrMissingValue.Error() {
			t.Errorf("odd key's value %q, want go-kit's %q", f["odd"], log.ErrMissingValue)
		}
	}
	if strings.Join(got, ",") != "debug,info,warn,error,info" {
		t.Errorf("levels %v, want debug,info,warn,error,info", got)
	}
}

func TestJSONAndSlogBridge(t *testing.T) {
	var buf bytes.Buffer
	logger := newLogger(t, &buf, "info", "json")
	Slog(logger).Debug("filtered by the level")
	Slog(logger).Info("from slog", "k", "v")
	out := buf.String()
	if strings.Contains(out, "filtered by the level") {
		t.Errorf("debug line passed an info filter: %s", out)
	}
	if !strings.Contains(out, `"msg":"from slog"`) || !strings.Contains(out, `"k":"v"`) {
		t.Errorf("slog line missing from JSON output: %s", out)
	}
}

func TestBadConfig(t *testing.T) {
	if _, err := ParseConfig("loud", ""); err == nil || !strings.Contains(err.Error(), "loud") {
		t.Errorf("bad level: err = %v", err)
	}
	if _, err := ParseConfig("", "xml"); err == nil || !strings.Contains(err.Error(), "xml") {
		t.Errorf("bad format: err = %v", err)
	}
}

// caller names the line that logged, however many go-kit contexts stand
// between it and the logger.
func TestCallerIsTheLoggingLine(t *testing.T) {
	var buf bytes.Buffer
	logger := newLogger(t, &buf, "info", "")
	_, _, line, _ := runtime.Caller(0)
	level.Info(logger).Log("msg", "level context")
	logger.Log("msg", "direct")
	level.Info(log.With(logger, "component", "x")).Log("msg", "nested contexts")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("want 3 lines: %q", buf.String())
	}
	for i, l := range lines {
		if want := fmt.Sprintf("logging_test.go:%d", line+1+i); fieldsOf(t, l)["caller"] != want {
			t.Errorf("caller of %q, want %s", l, want)
		}
	}
}

// TestTimestampIsTheTimeOfTheLine: two lines logged a while apart carry
// different ts values, each the time it was logged.
func TestTimestampIsTheTimeOfTheLine(t *testing.T) {
	var buf bytes.Buffer
	logger := newLogger(t, &buf, "info", "")
	level.Info(logger).Log("msg", "first")
	time.Sleep(20 * time.Millisecond)
	before := time.Now().UTC()
	level.Info(logger).Log("msg", "second")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("want 2 lines: %q", buf.String())
	}
	ts := func(line string) time.Time {
		f := fieldsOf(t, line)["ts"]
		v, err := time.Parse(timestampLayout, f)
		if err != nil {
			t.Fatalf("ts %q: %v", f, err)
		}
		return v
	}
	first, second := ts(lines[0]), ts(lines[1])
	if !second.After(first) {
		t.Errorf("ts did not move: %s then %s", first, second)
	}
	if second.Before(before.Truncate(time.Millisecond)) {
		t.Errorf("second line stamped %s, before it was logged (%s)", second, before)
	}
}

// TestSlogLinesHaveOneTimestampAndOneCaller: lines from slog-only
// libraries (exporter-toolkit) look like the rest: one ts, one caller
// naming the slog call site, no time key.
func TestSlogLinesHaveOneTimestampAndOneCaller(t *testing.T) {
	for _, format := range []string{"logfmt", "json"} {
		var buf bytes.Buffer
		logger := newLogger(t, &buf, "info", format)
		_, _, at, _ := runtime.Caller(0)
		Slog(logger).Info("Listening on", "address", "[::]:9433")
		line := strings.TrimSpace(buf.String())
		for _, key := range []string{"ts", "caller", "time"} {
			n := strings.Count(line, key+"=") + strings.Count(line, `"`+key+`":`)
			want := 1
			if key == "time" {
				want = 0
			}
			if n != want {
				t.Errorf("%s: key %s appears %d times, want %d: %s", format, key, n, want, line)
			}
		}
		if want := fmt.Sprintf("logging_test.go:%d", at+1); fieldsOf(t, line)["caller"] != want {
			t.Errorf("%s: caller does not name the slog call site %s: %s", format, want, line)
		}
		if _, err := time.Parse(timestampLayout, fieldsOf(t, line)["ts"]); err != nil {
			t.Errorf("%s: ts: %v (%s)", format, err, line)
		}
	}
}

// TestLongValuesAreCapped: a huge client-chosen value (a rid) is cut and
// the cut is said; control characters stay escaped by the encoder.
func TestLongValuesAreCapped(t *testing.T) {
	var buf bytes.Buffer
	logger := newLogger(t, &buf, "info", "")
	level.Info(logger).Log("msg", "stuck", "rid", strings.Repeat("r", 100000)+"\x1b[2J\nlevel=error")
	out := buf.String()
	if len(out) > 2*MaxValueLen {
		t.Errorf("line of %d bytes for a %d-byte cap", len(out), MaxValueLen)
	}
	if !strings.Contains(out, "more bytes]") {
		t.Errorf("the cut is not said: %s", out)
	}
	if strings.Count(out, "\n") != 1 || strings.Contains(out, "\x1b") {
		t.Errorf("raw control characters reached the log: %q", out)
	}
}

func fieldsOf(t *testing.T, line string) map[string]string {
	t.Helper()
	out := map[string]string{}
	if strings.HasPrefix(line, "{") {
		var m map[string]interface{}
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		for k, v := range m {
			out[k] = fmt.Sprint(v)
		}
		return out
	}
	for _, f := range strings.Fields(line) {
		if k, v, ok := strings.Cut(f, "="); ok {
			out[k] = strings.Trim(v, `"`)
		}
	}
	return out
}
