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

// New returns a logger writing to w.
func New(w io.Writer, cfg Config) (log.Logger, error) {
	var logger log.Logger
	switch cfg.Format {
	case "", "logfmt":
		logger = log.NewLogfmtLogger(log.NewSyncWriter(w))
	case "json":
		logger = log.NewJSONLogger(log.NewSyncWriter(w))
	default:
		return nil, fmt.Errorf("unknown log format %q (want logfmt or json)", cfg.Format)
	}
	opt, err := levelOption(cfg.Level)
	if err != nil {
		return nil, err
	}
	logger = log.With(logger, "ts", log.TimestampFormat(time.Now().UTC, "2006-01-02T15:04:05.000Z07:00"), "caller", log.Caller(5))
	return level.NewFilter(logger, opt), nil
}

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

// Slog bridges logger for slog-only libraries (exporter-toolkit). The
// go-kit level filter still applies; slog passes everything down to it.
func Slog(logger log.Logger) *slog.Logger {
	return slog.New(slgk.NewGoKitHandler(logger, slog.LevelDebug))
}
