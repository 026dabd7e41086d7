package logging

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/go-kit/log/level"
)

func TestLevelFilterAndFormat(t *testing.T) {
	var buf bytes.Buffer
	logger, err := New(&buf, Config{Level: "warn", Format: "logfmt"})
	if err != nil {
		t.Fatal(err)
	}
	level.Info(logger).Log("msg", "hidden")
	level.Warn(logger).Log("msg", "shown", "rid", "abc")
	out := buf.String()
	if strings.Contains(out, "hidden") {
		t.Errorf("info line passed a warn filter: %s", out)
	}
	for _, want := range []string{"level=warn", "msg=shown", "rid=abc", "ts=", "caller="} {
		if !strings.Contains(out, want) {
			t.Errorf("output %q lacks %q", out, want)
		}
	}
}

func TestJSONAndSlogBridge(t *testing.T) {
	var buf bytes.Buffer
	logger, err := New(&buf, Config{Level: "info", Format: "json"})
	if err != nil {
		t.Fatal(err)
	}
	Slog(logger).Debug("filtered by go-kit")
	Slog(logger).Info("from slog", "k", "v")
	out := buf.String()
	if strings.Contains(out, "filtered by go-kit") {
		t.Errorf("debug line passed an info filter: %s", out)
	}
	if !strings.Contains(out, `"msg":"from slog"`) || !strings.Contains(out, `"k":"v"`) {
		t.Errorf("slog line missing from JSON output: %s", out)
	}
}

func TestBadConfig(t *testing.T) {
	if _, err := New(&bytes.Buffer{}, Config{Level: "loud"}); err == nil || !strings.Contains(err.Error(), "loud") {
		t.Errorf("bad level: err = %v", err)
	}
	if _, err := New(&bytes.Buffer{}, Config{Format: "xml"}); err == nil || !strings.Contains(err.Error(), "xml") {
		t.Errorf("bad format: err = %v", err)
	}
}

func TestCallerIsTheLoggingLine(t *testing.T) {
	var buf bytes.Buffer
	logger, err := New(&buf, Config{Level: "info"})
	if err != nil {
		t.Fatal(err)
	}
	level.Info(logger).Log("msg", "here")
	if !strings.Contains(buf.String(), "caller=logging_test.go:") {
		t.Fatalf("caller does not name this file: %s", buf.String())
	}
}

// TestTimestampIsTheTimeOfTheLine: two lines logged a while apart carry
// different ts values, each the time it was logged.
func TestTimestampIsTheTimeOfTheLine(t *testing.T) {
	var buf bytes.Buffer
	logger, err := New(&buf, Config{Level: "info"})
	if err != nil {
		t.Fatal(err)
	}
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
		v, err := time.Parse(TimestampLayout, f)
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
	for _, format := range Formats {
		var buf bytes.Buffer
		logger, err := New(&buf, Config{Level: "info", Format: format})
		if err != nil {
			t.Fatal(err)
		}
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
		if !strings.Contains(line, "logging_test.go:") {
			t.Errorf("%s: caller does not name the slog call site: %s", format, line)
		}
		if _, err := time.Parse(TimestampLayout, fieldsOf(t, line)["ts"]); err != nil && format == "logfmt" {
			t.Errorf("%s: ts: %v (%s)", format, err, line)
		}
	}
}

// TestLongValuesAreCapped: a huge client-chosen value (a rid) is cut and
// the cut is said; control characters stay escaped by the encoder.
func TestLongValuesAreCapped(t *testing.T) {
	var buf bytes.Buffer
	logger, err := New(&buf, Config{Level: "info"})
	if err != nil {
		t.Fatal(err)
	}
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
