package logging

import (
	"bytes"
	"strings"
	"testing"

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
