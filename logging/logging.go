// Package logging gives the project's go-kit loggers the output of
// prometheus/common/promslog, the Prometheus ecosystem's logger (logfmt or
// JSON; ts, caller and level in the go-kit style; the --log.level filter),
// and hands the same handler to the libraries that take only a
// *slog.Logger (exporter-toolkit).
//
// The packages keep go-kit's log.Logger and its key-value pairs; the
// Logger here turns each line into a slog record for promslog's handler.
package logging

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"strings"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	"github.com/prometheus/common/promslog"
	slgk "github.com/tjhop/slog-gokit"
)

// MaxValueLen caps a logged string value. Request ids come from clients:
// a megabyte of rid must not become a megabyte per log line.
const MaxValueLen = 256

// ParseConfig is the promslog configuration for a --log.level and a
// --log.format value ("" for their defaults, info and logfmt), as
// promslog/flag would set it.
func ParseConfig(lvl, format string) (promslog.Config, error) {
	cfg := promslog.Config{Level: promslog.NewLevel(), Format: promslog.NewFormat()}
	if lvl == "" {
		lvl = "info"
	}
	if format == "" {
		format = "logfmt"
	}
	if err := cfg.Level.Set(lvl); err != nil {
		return cfg, err
	}
	return cfg, cfg.Format.Set(format)
}

// Logger is a go-kit log.Logger writing through a slog.Handler.
type Logger struct {
	h slog.Handler
}

// New returns a go-kit logger writing to w through promslog's handler for
// cfg, in the go-kit style: every line carries the time it was logged (UTC,
// ms) as ts, its level and its logging call site as caller.
func New(w io.Writer, cfg promslog.Config) log.Logger {
	cfg.Writer, cfg.Style = w, promslog.GoKitStyle
	return &Logger{h: promslog.New(&cfg).Handler()}
}

// Log turns go-kit key-value pairs into one slog record: the level value
// (go-kit's level package) becomes the record's level, msg its message and
// the rest its attributes, in order. A line without a level is info.
func (l *Logger) Log(keyvals ...interface{}) error {
	ctx := context.Background()
	lvl, lvlAt := levelOf(keyvals)
	if !l.h.Enabled(ctx, lvl) {
		return nil
	}
	if len(keyvals)%2 == 1 {
		keyvals = append(keyvals, log.ErrMissingValue)
	}
	var msg string
	attrs := make([]slog.Attr, 0, len(keyvals)/2)
	for i := 0; i < len(keyvals); i += 2 {
		if i == lvlAt {
			continue
		}
		k, v := fmt.Sprint(keyvals[i]), keyvals[i+1]
		if s, ok := v.(string); ok {
			v = Truncate(s, MaxValueLen)
		}
		if k == slog.MessageKey && msg == "" {
			msg = fmt.Sprint(v)
			continue
		}
		attrs = append(attrs, slog.Any(k, v))
	}
	// The time is read here, once per line: never a value bound earlier.
	r := slog.NewRecord(time.Now(), lvl, msg, callSite())
	r.AddAttrs(attrs...)
	return l.h.Handle(ctx, r)
}

// levelOf finds the go-kit level value among keyvals and where its key is
// (-1: none, info).
func levelOf(keyvals []interface{}) (slog.Level, int) {
	for i := 1; i < len(keyvals); i += 2 {
		if keyvals[i-1] != level.Key() {
			continue
		}
		switch keyvals[i] {
		case level.DebugValue():
			return slog.LevelDebug, i - 1
		case level.InfoValue():
			return slog.LevelInfo, i - 1
		case level.WarnValue():
			return slog.LevelWarn, i - 1
		case level.ErrorValue():
			return slog.LevelError, i - 1
		}
	}
	return slog.LevelInfo, -1
}

// callSite is the program counter of the first caller outside go-kit's
// log packages (contexts, level filters), for the record's source: promslog
// prints it as caller. A fixed depth would be wrong for level.Info(l).Log
// and l.Log alike.
func callSite() uintptr {
	var pcs [16]uintptr
	n := runtime.Callers(3, pcs[:]) // skip runtime.Callers, callSite, Log
	for _, pc := range pcs[:n] {
		f, _ := runtime.CallersFrames([]uintptr{pc}).Next()
		if !strings.HasPrefix(f.Function, "github.com/go-kit/log") {
			return pc
		}
	}
	return 0
}

// Truncate returns s cut to at most max bytes (on a rune boundary) with a
// note of how many bytes were left out, or s itself if it is short enough.
func Truncate(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && cut < len(s) && !isRuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s…[%d more bytes]", s[:cut], len(s)-cut)
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }

// Slog is l for the libraries that take only a *slog.Logger
// (exporter-toolkit). A Logger from New hands them its own handler, so their
// lines are promslog's, with their own time and call site; any other go-kit
// logger (a test's) gets slog's records as key-value pairs with time and
// caller keys (slog-gokit), filtered by its own level filter, if any.
func Slog(l log.Logger) *slog.Logger {
	if own, ok := l.(*Logger); ok {
		return slog.New(own.h)
	}
	return slog.New(slgk.NewGoKitHandler(l, slog.LevelDebug))
}
