// Command sglang-watchdog exports the state of SGLang's prefill/decode
// disaggregation queues and force-fails requests stuck in the prefill
// inflight queue, through the sglang-watchdog plugin that runs inside each
// prefill scheduler. main only wires packages together; flags.go declares
// the flags.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	"github.com/prometheus/common/version"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/internal/liveness"
	"github.com/sglang-watchdog/sglang-watchdog/internal/memlimit"
	"github.com/sglang-watchdog/sglang-watchdog/internal/runconfig"
	"github.com/sglang-watchdog/sglang-watchdog/internal/server"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

const (
	appName     = "sglang-watchdog"
	defaultPort = ":9433"
	// cgroupRoot is where the container's memory limit is read.
	cgroupRoot = "/sys/fs/cgroup"
)

func main() {
	// A sidecar's memory is the user's budget next to a GPU server: collect
	// twice as often as Go's default (BENCHMARKS.md, Footprint: 1.5 MiB
	// lower peak for about 0.2% of a core), unless the operator chose.
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(50)
	}
	memlimit.Set(cgroupRoot)
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	var o options
	app := newApp(&o)
	app.UsageWriter(stdout)
	app.ErrorWriter(stderr)
	// --help and --version ask kingpin to exit; record it instead, so that
	// tests can call run and deferred cleanups run.
	exited := -1
	app.Terminate(func(code int) {
		if exited < 0 {
			exited = code
		}
	})
	cmd, err := app.Parse(args)
	if exited >= 0 {
		return exited
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", appName, flagError(args, err))
		return 2
	}
	logger := logging.New(stderr, o.log)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	switch cmd {
	case "run":
		return runWatchdog(ctx, &o, logger, stdout)
	case "inflight":
		return runInflight(ctx, &o, stdout, stderr)
	case "force-fail":
		return runForceFail(ctx, &o, stdout, stderr)
	case "demo":
		return runDemo(ctx, &o, stdout, stderr)
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n", appName, cmd)
	return 2
}

// watchdogConfig builds the watchdog's config from the run flags.
func watchdogConfig(o *options, logger log.Logger) (watchdog.Config, error) {
	return runconfig.Watchdog(runconfig.Options{
		Watch: o.watch, Decode: o.decode,
		MetricsURL: o.metricsSource(), MetricsInterval: o.metricsInterval, MetricsTimeout: o.metricsTimeout.value(),
		PluginURLs: o.pluginURLs, TokenFile: o.tokenFile, PluginTimeout: o.pluginTimeout.value(),
		PluginTLSFile: o.pluginTLSFile, AllowRemote: o.allowRemote,
	}, logger)
}

// webhookReceiver builds the Alertmanager receiver from the flags, nil
// when it is off.
func webhookReceiver(o *options, wd *watchdog.Watchdog, logger log.Logger) (*alertwebhook.Receiver, error) {
	return alertwebhook.FromSetup(wd, logger, alertwebhook.Setup{Enabled: o.webhook, TokenFile: o.webhookTokenFile,
		MatchLabels: o.webhookMatch, WebConfigFile: *o.web.WebConfigFile})
}

// newLiveness judges the watch loop at the run flags' interval.
func newLiveness(o *options, wd *watchdog.Watchdog) *liveness.Liveness {
	return liveness.New(wd, o.watch.Interval, o.watch.AdminTimeout, time.Now)
}

// newServer builds the HTTP side from the flags.
func newServer(o *options, wd *watchdog.Watchdog, receiver *alertwebhook.Receiver, live *liveness.Liveness, logger log.Logger) (*server.Server, error) {
	return server.New(server.Options{Watchdog: wd, Receiver: receiver, Live: live, TelemetryPath: o.telemetryPath,
		MaxRequests: o.maxRequests, Web: o.web, ProbeAddress: o.probeAddress, Logger: logger})
}

func runWatchdog(ctx context.Context, o *options, logger log.Logger, stdout io.Writer) int {
	if o.configCheck {
		// A check's answer is its errors, or one line on stdout.
		logger = level.NewFilter(logger, level.AllowError())
	}
	level.Info(logger).Log("msg", "Starting "+appName, "version", version.Info())
	level.Info(logger).Log("msg", "Build context", "build_context", version.BuildContext())
	if os.Geteuid() == 0 {
		level.Warn(logger).Log("msg", "running as root; the watchdog needs no privileges")
	}
	if limit := debug.SetMemoryLimit(-1); limit < 1<<62 {
		level.Info(logger).Log("msg", "Go memory limit", "bytes", limit, "from", memorySource())
	}
	if limit, ok := memlimit.Limit(cgroupRoot); ok && limit < memlimit.ForRooms(o.watch.MaxRooms) {
		level.Warn(logger).Log("msg", "the container's memory limit is below what --watchdog.max-rooms may need: lower the flag or raise the limit",
			"limit_bytes", limit, "max_rooms", o.watch.MaxRooms, "needs_bytes", memlimit.ForRooms(o.watch.MaxRooms), "rooms_that_fit", memlimit.RoomsFor(limit))
	}
	urls, err := nodePluginURLs(o, logger)
	if err != nil {
		level.Error(logger).Log("msg", "invalid configuration", "err", err)
		return 2
	}
	o.pluginURLs = urls
	cfg, err := watchdogConfig(o, logger)
	if err == nil {
		err = server.CheckTelemetryPath(o.telemetryPath)
	}
	if err != nil {
		level.Error(logger).Log("msg", "invalid configuration", "err", err)
		return 2
	}
	if len(cfg.Plugins) == 0 && !o.node.given() {
		level.Warn(logger).Log("msg", "no --plugin.url given: watching SGLang's queue gauges only; stuck requests cannot be listed or released")
	}
	if *o.web.WebConfigFile != "" && o.probeAddress == "" {
		level.Warn(logger).Log("msg", "--web.config.file guards /-/healthy too: kubelet probes need --web.probe-listen-address")
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		level.Error(logger).Log("msg", "invalid configuration", "err", err)
		return 2
	}
	receiver, err := webhookReceiver(o, wd, logger)
	if err != nil {
		level.Error(logger).Log("msg", "invalid configuration", "err", err)
		return 2
	}
	if o.configCheck {
		if err := checkFiles(o); err != nil {
			level.Error(logger).Log("msg", "invalid configuration", "err", err)
			return 2
		}
		fmt.Fprintln(stdout, configOKMessage)
		return 0
	}
	live := newLiveness(o, wd)
	srv, err := newServer(o, wd, receiver, live, logger)
	if err != nil {
		level.Error(logger).Log("msg", "cannot start the HTTP server", "err", err)
		return 1
	}
	level.Info(logger).Log("msg", "watching", "plugins", strings.Join(o.pluginURLs, ","), "sglang_metrics", o.metricsSource(),
		"mode", wd.Mode(), "deadline", cfg.Deadline, "stall_window", cfg.StallWindow, "pin_window", cfg.PinWindow)
	return serveAndWatch(ctx, srv, live, wd, receiver, logger)
}

// memorySource says where the Go memory limit came from.
func memorySource() string {
	if os.Getenv("GOMEMLIMIT") != "" {
		return "GOMEMLIMIT"
	}
	return fmt.Sprintf("%.0f%% of the cgroup memory limit", memlimit.Ratio*100)
}

// serveAndWatch runs the HTTP server, the watchdog loop and the webhook
// worker until ctx ends or the server fails.
func serveAndWatch(ctx context.Context, srv *server.Server, live *liveness.Liveness, wd *watchdog.Watchdog, receiver *alertwebhook.Receiver, logger log.Logger) int {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	live.LoopStarted()
	go func() {
		defer close(done)
		wd.Run(ctx)
	}()
	if receiver != nil {
		go receiver.Run(ctx)
	}
	err := srv.Serve(ctx)
	cancel()
	<-done
	if err != nil {
		level.Error(logger).Log("msg", "HTTP server failed", "err", err)
		return 1
	}
	level.Info(logger).Log("msg", "stopped")
	return 0
}
