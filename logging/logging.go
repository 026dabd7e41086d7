// Package logging builds the project's go-kit logger with the output every
// Prometheus exporter has (logfmt or JSON, ts, caller, level filter), and
// bridges it to slog for the libraries that take only a *slog.Logger.
package logging

import (
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	slgk "github.com/tjhop/slog-gokit"
)

// Levels and Formats are the accepted --log.level and --log.format values.
var (
	Levels  = []string{"debug", "info", "warn", "error"}
	Formats = []string{"logfmt", "json"}
)

// Config is the logger's configuration.
type Config struct {
	Level  string
	Format string
}

// TimestampLayout is the layout of every line's ts: UTC, milliseconds.
const TimestampLayout = "2006-01-02T15:04:05.000Z07:00"

// MaxValueLen caps a logged string value. Request ids come from clients:
// a megabyte of rid must not become a megabyte per log line.
const MaxValueLen = 256

// logger adds ts and caller to every line. It is a distinct type so that
// Slog can reach the filtered writer below it: slog records carry their
// own time and call site, which must replace ts and caller, not repeat
// them.
type logger struct {
	log.Logger            // filter(with(ts, caller, capped(writer)))
	bare       log.Logger // filter(capped(writer))
}

// New returns a logger writing to w. Every line carries the time it was
// logged (UTC, ms) as ts and the logging call site as caller, once each.
func New(w io.Writer, cfg Config) (log.Logger, error) {
	var base log.Logger
	switch cfg.Format {
	case "", "logfmt":
		base = log.NewLogfmtLogger(log.NewSyncWriter(w))
	case "json":
		base = log.NewJSONLogger(log.NewSyncWriter(w))
	default:
		return nil, fmt.Errorf("unknown log format %q (want logfmt or json)", cfg.Format)
	}
	opt, err := levelOption(cfg.Level)
	if err != nil {
		return nil, err
	}
	base = capValues(base)
	// The valuer must call time.Now on every line: a method value such as
	// time.Now().UTC is bound to the instant New ran.
	now := func() time.Time { return time.Now().UTC() }
	// Caller depth 6: the call site, level's context, this wrapper, the
	// filter, the context holding ts and caller, and its valuer binding.
	stamped := log.With(base, "ts", log.TimestampFormat(now, TimestampLayout), "caller", log.Caller(6))
	return &logger{Logger: level.NewFilter(stamped, opt), bare: level.NewFilter(base, opt)}, nil
}

// Log forwards to the stamped logger; it exists so that the caller depth
// is the same for every line.
func (l *logger) Log(keyvals ...interface{}) error { return l.Logger.Log(keyvals...) }

func levelOption(l string) (level.Option, error) {
	switch l {
	case "debug":
		return level.AllowDebug(), nil
	case "", "info":
		return level.AllowInfo(), nil
	case "warn":
		return level.AllowWarn(), nil
	case "error":
		return level.AllowError(), nil
	}
	return nil, fmt.Errorf("unknown log level %q (want debug, info, warn or error)", l)
}

// capValues cuts string values longer than MaxValueLen and says by how
// much. Escaping of control characters is the encoder's job (logfmt and
// JSON both quote them).
func capValues(next log.Logger) log.Logger {
	return log.LoggerFunc(func(keyvals ...interface{}) error {
		for i := 1; i < len(keyvals); i += 2 {
			if s, ok := keyvals[i].(string); ok && len(s) > MaxValueLen {
				kv := append([]interface{}(nil), keyvals...)
				for j := i; j < len(kv); j += 2 {
					if s, ok := kv[j].(string); ok && len(s) > MaxValueLen {
						kv[j] = Truncate(s, MaxValueLen)
					}
				}
				return next.Log(kv...)
			}
		}
		return next.Log(keyvals...)
	})
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

// Slog bridges logger for slog-only libraries (exporter-toolkit). The
// go-kit level filter still applies; slog passes everything down to it.
// Lines keep the go-kit shape: one ts (the record's time, UTC) and one
// caller (the slog call site).
func Slog(l log.Logger) *slog.Logger {
	target := l
	if own, ok := l.(*logger); ok {
		target = own.bare
	}
	reshape := log.LoggerFunc(func(keyvals ...interface{}) error {
		head := make([]interface{}, 0, len(keyvals)+2)
		rest := make([]interface{}, 0, len(keyvals))
		var ts, caller interface{}
		for i := 0; i+1 < len(keyvals); i += 2 {
			switch keyvals[i] {
			case slog.TimeKey:
				if t, ok := keyvals[i+1].(time.Time); ok {
					ts = t.UTC().Format(TimestampLayout)
					continue
				}
			case "caller":
				caller = keyvals[i+1]
				continue
			}
			rest = append(rest, keyvals[i], keyvals[i+1])
		}
		if ts == nil {
			ts = time.Now().UTC().Format(TimestampLayout)
		}
		head = append(head, "ts", ts)
		if caller != nil {
			head = append(head, "caller", caller)
		}
		return target.Log(append(head, rest...)...)
	})
	return slog.New(slgk.NewGoKitHandler(reshape, slog.LevelDebug))
}
