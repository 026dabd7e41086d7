// Command sglang-watchdog exports the state of SGLang's prefill/decode
// disaggregation queues and force-fails requests stuck in the prefill
// inflight queue, through the sglang-watchdog plugin that runs inside each
// prefill scheduler. main only wires packages together.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	stdlog "log"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
	"github.com/sglang-watchdog/sglang-watchdog/loopback"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

const (
	appName     = "sglang-watchdog"
	defaultPort = ":9433"
)

func main() {
	// A sidecar's memory is the user's budget next to a GPU server: collect
	// twice as often as Go's default (BENCHMARKS.md, Footprint: 1.5 MiB
	// lower peak for about 0.2% of a core), unless the operator chose.
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(50)
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// watchOptions are the flags of the watchdog proper, shared by run and demo.
type watchOptions struct {
	interval, deadline, stallWindow, pinWindow time.Duration
	maxRooms                                   int
	mode                                       string
	maxPerMinute                               int
	confirmTimeout, adminTimeout               time.Duration
	// run only: fail-fast behind a transfer wedge and restart escalation.
	failFast           bool
	failFastPerMinute  int
	restartMode        string
	restartMinInterval time.Duration
}

type options struct {
	log logging.Config

	web           *web.FlagConfig
	telemetryPath string

	metricsURL      string
	metricsInterval time.Duration
	metricsTimeout  time.Duration

	pluginURLs    []string
	tokenFile     string
	pluginTimeout time.Duration
	allowRemote   bool

	watch   watchOptions
	webhook bool

	// inflight
	output string

	// force-fail
	rid        string
	room       string
	oneURL     string
	reason     string
	dryRun     bool
	ffTimeout  time.Duration
	ffToken    string
	ffRemote   bool
	ffInflight time.Duration

	demo demoOptions
}

// newApp declares every flag. Tests parse manifests' arguments with it.
func newApp(o *options) *kingpin.Application {
	app := kingpin.New(appName, "Prometheus exporter and stuck-request watchdog for SGLang prefill/decode disaggregation.").DefaultEnvars()
	app.Version(version.Print(appName))
	app.HelpFlag.Short('h')
	app.Flag("log.level", "Only log messages with the given severity or above: debug, info, warn, error.").Default("info").EnumVar(&o.log.Level, logging.Levels...)
	app.Flag("log.format", "Output format of log messages: logfmt or json.").Default("logfmt").EnumVar(&o.log.Format, logging.Formats...)

	runCmd := app.Command("run", "Export metrics and watch for stuck requests (the default).").Default()
	o.web = kingpinflag.AddFlags(runCmd, defaultPort)
	runCmd.Flag("web.telemetry-path", "Path under which to expose metrics.").Default("/metrics").StringVar(&o.telemetryPath)
	runCmd.Flag("sglang.metrics-url", "SGLang's /metrics URL. Empty turns the gauge watch off.").Default("http://127.0.0.1:30000/metrics").StringVar(&o.metricsURL)
	runCmd.Flag("sglang.metrics-interval", "How often SGLang's /metrics is read. Each read costs SGLang tens of milliseconds of CPU on its API process.").Default("15s").DurationVar(&o.metricsInterval)
	runCmd.Flag("sglang.timeout", "Timeout of one /metrics read; shorter than --sglang.metrics-interval.").Default("5s").DurationVar(&o.metricsTimeout)
	runCmd.Flag("plugin.url", "Base URL of the plugin of one prefill rank, e.g. http://127.0.0.1:30100 (repeatable).").StringsVar(&o.pluginURLs)
	runCmd.Flag("plugin.token-file", "File holding the plugin's bearer token.").StringVar(&o.tokenFile)
	runCmd.Flag("plugin.timeout", "Timeout of one listing read; shorter than --watchdog.interval.").Default("800ms").DurationVar(&o.pluginTimeout)
	runCmd.Flag("plugin.allow-remote", "Allow plugin and SGLang URLs that are not loopback addresses.").BoolVar(&o.allowRemote)
	addWatchFlags(runCmd, &o.watch, "dry-run")
	runCmd.Flag("force-fail.fail-fast", "Fail the requests queued behind a diagnosed transfer wedge at once, on every PP stage, instead of at the deadline (auto mode; dry runs in dry-run mode).").Default("true").BoolVar(&o.watch.failFast)
	runCmd.Flag("force-fail.fail-fast-max-per-minute", "Most fail-fast requests over any 60 seconds, apart from --force-fail.max-per-minute.").Default("180").IntVar(&o.watch.failFastPerMinute)
	runCmd.Flag("restart.mode", "Escalate a diagnosed transfer wedge to a restart of the SGLang server through the plugin: off, dry-run or auto.").Default("off").EnumVar(&o.watch.restartMode, "off", "dry-run", "auto")
	runCmd.Flag("restart.min-interval", "Least time between two restarts of this pod; a process is never restarted twice.").Default("30m").DurationVar(&o.watch.restartMinInterval)
	runCmd.Flag("alertmanager.webhook", "Serve POST "+alertwebhook.Path+": a firing "+alertwebhook.AlertName+" alert force-fails the stuck requests of its rank, through the same rails as auto mode.").BoolVar(&o.webhook)

	inflightCmd := app.Command("inflight", "List every rank's inflight requests, oldest first.")
	inflightCmd.Flag("plugin.url", "Base URL of the plugin of one prefill rank (repeatable).").Required().StringsVar(&o.pluginURLs)
	inflightCmd.Flag("plugin.timeout", "Timeout of one listing read.").Default("5s").DurationVar(&o.ffInflight)
	inflightCmd.Flag("plugin.allow-remote", "Allow plugin URLs that are not loopback addresses.").BoolVar(&o.allowRemote)
	inflightCmd.Flag("output", "Output format: table or json.").Default("table").EnumVar(&o.output, "table", "json")

	ffCmd := app.Command("force-fail", "Force-fail one inflight request through the plugin's admin call.")
	ffCmd.Flag("rid", "Request id to force-fail.").NoEnvar().Required().StringVar(&o.rid)
	ffCmd.Flag("room", "Bootstrap room the request must have; strongly advised, as rooms are reused.").NoEnvar().StringVar(&o.room)
	ffCmd.Flag("plugin.url", "Base URL of the plugin of the request's rank.").Default("http://127.0.0.1:30100").StringVar(&o.oneURL)
	ffCmd.Flag("plugin.token-file", "File holding the plugin's bearer token.").StringVar(&o.ffToken)
	ffCmd.Flag("reason", "Why, recorded by the plugin with the failure.").NoEnvar().Default("manual force-fail with sglang-watchdog").StringVar(&o.reason)
	ffCmd.Flag("dry-run", "Ask the plugin whether it would flip the lever, and change nothing.").NoEnvar().BoolVar(&o.dryRun)
	ffCmd.Flag("force-fail.timeout", "Timeout of the admin call.").Default("7s").DurationVar(&o.ffTimeout)
	ffCmd.Flag("plugin.allow-remote", "Allow a plugin URL that is not a loopback address.").BoolVar(&o.ffRemote)

	addDemoFlags(app, &o.demo)
	return app
}

func addWatchFlags(cmd *kingpin.CmdClause, w *watchOptions, defaultMode string) {
	cmd.Flag("watchdog.interval", "How often plugin listings are read and decisions made.").Default("1s").DurationVar(&w.interval)
	cmd.Flag("watchdog.deadline", "A request younger than this in the inflight queue is never stuck.").Default("60s").DurationVar(&w.deadline)
	cmd.Flag("watchdog.stall-window", "A request is stuck only if neither its progress nor its poll state changed for this long while the scheduler loop kept running; also the wedged-loop window.").Default("30s").DurationVar(&w.stallWindow)
	cmd.Flag("watchdog.pin-window", "A queue gauge non-zero and unchanged this long, with no progress counter moving, is pinned.").Default("2m").DurationVar(&w.pinWindow)
	cmd.Flag("watchdog.max-rooms", "Most inflight requests remembered at once.").Default("100000").IntVar(&w.maxRooms)
	cmd.Flag("force-fail.mode", "off (detect only), dry-run (send dry_run: true), auto (force-fail).").Default(defaultMode).EnumVar(&w.mode, "off", "dry-run", "auto")
	cmd.Flag("force-fail.max-per-minute", "Most force-fail calls over any 60 seconds.").Default("6").IntVar(&w.maxPerMinute)
	cmd.Flag("force-fail.confirm-timeout", "How long a release may take to be confirmed before it counts as unconfirmed.").Default("60s").DurationVar(&w.confirmTimeout)
	cmd.Flag("force-fail.timeout", "Timeout of one admin call; the plugin waits up to 5s for its scheduler.").Default("7s").DurationVar(&w.adminTimeout)
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
		fmt.Fprintf(stderr, "%s: %v\n", appName, err)
		return 2
	}
	logger, err := logging.New(stderr, o.log)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", appName, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	switch cmd {
	case "run":
		return runWatchdog(ctx, &o, logger)
	case "inflight":
		return runInflight(ctx, &o, stdout, stderr)
	case "force-fail":
		return runForceFail(ctx, &o, stdout, stderr)
	case "demo":
		return runDemo(ctx, &o, logger, stdout)
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n", appName, cmd)
	return 2
}

// readToken reads a bearer token from a file. Tokens never come from a flag
// value, so that they stay out of process listings and shell history.
func readToken(path string) (string, error) {
	if path == "" {
		return "", nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("reading token file: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("token file %s is empty", path)
	}
	return tok, nil
}

func checkURLs(allowRemote bool, urls ...string) error {
	for _, u := range urls {
		if allowRemote {
			parsed, err := url.Parse(u)
			if err != nil {
				return fmt.Errorf("invalid URL %q: %w", u, err)
			}
			if parsed.Scheme != "http" && parsed.Scheme != "https" {
				return fmt.Errorf("URL %q: scheme must be http or https", u)
			}
			if parsed.Hostname() == "" {
				return fmt.Errorf("URL %q has no host", u)
			}
			continue
		}
		if err := loopback.Check(u); err != nil {
			return err
		}
	}
	return nil
}

// watchdogConfig validates the watch flags and builds the watchdog's config.
func watchdogConfig(o *options, logger log.Logger) (watchdog.Config, error) {
	w := o.watch
	mode, err := watchdog.ParseMode(w.mode)
	if err != nil {
		return watchdog.Config{}, err
	}
	if o.pluginTimeout >= w.interval {
		return watchdog.Config{}, fmt.Errorf("--plugin.timeout (%s) must be shorter than --watchdog.interval (%s), so that cycles never overlap", o.pluginTimeout, w.interval)
	}
	if o.metricsURL != "" && o.metricsTimeout >= o.metricsInterval {
		return watchdog.Config{}, fmt.Errorf("--sglang.timeout (%s) must be shorter than --sglang.metrics-interval (%s)", o.metricsTimeout, o.metricsInterval)
	}
	if o.metricsURL != "" && o.metricsInterval < w.pinWindow/20 {
		level.Warn(logger).Log("msg", "SGLang /metrics is read very often; each read costs SGLang tens of milliseconds of CPU", "interval", o.metricsInterval)
	}
	urls := append([]string(nil), o.pluginURLs...)
	if o.metricsURL != "" {
		urls = append(urls, o.metricsURL)
	}
	if err := checkURLs(o.allowRemote, urls...); err != nil {
		return watchdog.Config{}, err
	}
	token, err := readToken(o.tokenFile)
	if err != nil {
		return watchdog.Config{}, err
	}
	cfg := watchdog.Config{
		Clock:           clock.Real{},
		Logger:          logger,
		Interval:        w.interval,
		MetricsInterval: o.metricsInterval,
		Deadline:        w.deadline,
		StallWindow:     w.stallWindow,
		PinWindow:       w.pinWindow,
		MaxRooms:        w.maxRooms,
		Mode:            mode,
		MaxPerMinute:    w.maxPerMinute,
		ConfirmTimeout:  w.confirmTimeout,

		FailFast:           w.failFast,
		FailFastPerMinute:  w.failFastPerMinute,
		RestartMode:        watchdog.Mode(w.restartMode),
		RestartMinInterval: w.restartMinInterval,
	}
	if o.metricsURL != "" {
		cfg.Metrics = collector.NewMetricsScraper(o.metricsURL, o.metricsTimeout)
	}
	for _, u := range o.pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: o.pluginTimeout, AdminTimeout: w.adminTimeout, Token: token}))
	}
	return cfg, nil
}

// server is the watchdog's own HTTP side.
type server struct {
	handler   http.Handler
	listeners []net.Listener
}

func newServer(o *options, wd *watchdog.Watchdog, receiver *alertwebhook.Receiver, logger log.Logger) (*server, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collector.NewExporter(wd.Snapshot),
		versioncollector.NewCollector("sglang_watchdog"),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	mux := http.NewServeMux()
	mux.Handle(o.telemetryPath, promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:      stdlog.New(log.NewStdlibAdapter(level.Error(logger)), "", 0),
		ErrorHandling: promhttp.ContinueOnError,
	}))
	mux.HandleFunc("/-/healthy", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "Healthy")
	})
	mux.HandleFunc("/-/ready", func(w http.ResponseWriter, _ *http.Request) {
		if !wd.Ready() {
			http.Error(w, "Not ready: SGLang has not been read successfully yet", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "Ready")
	})
	if receiver != nil {
		mux.Handle(alertwebhook.Path, receiver)
	} else {
		// Count deliveries to a disabled receiver: they mean Alertmanager
		// routes to a watchdog that will not act.
		mux.HandleFunc(alertwebhook.Path, func(w http.ResponseWriter, _ *http.Request) {
			wd.CountWebhook(watchdog.WebhookDisabled)
			http.Error(w, `{"result":"disabled","error":"start the watchdog with --alertmanager.webhook"}`, http.StatusForbidden)
		})
	}
	if o.telemetryPath != "/" {
		landing, err := web.NewLandingPage(web.LandingConfig{
			Name:        "SGLang watchdog",
			Description: "Prometheus exporter and stuck-request watchdog for SGLang prefill/decode disaggregation",
			Version:     version.Info(),
			Links: []web.LandingLinks{
				{Address: o.telemetryPath, Text: "Metrics"},
				{Address: "/-/healthy", Text: "Health"},
				{Address: "/-/ready", Text: "Readiness"},
			},
		})
		if err != nil {
			return nil, err
		}
		mux.Handle("/", landing)
	}
	s := &server{handler: mux}
	for _, addr := range *o.web.WebListenAddresses {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			s.close()
			return nil, fmt.Errorf("listening on %s: %w", addr, err)
		}
		s.listeners = append(s.listeners, l)
	}
	return s, nil
}

func (s *server) close() {
	for _, l := range s.listeners {
		l.Close()
	}
}

// serve runs the HTTP server until ctx ends.
func (s *server) serve(ctx context.Context, flags *web.FlagConfig, logger log.Logger) error {
	srv := &http.Server{Handler: s.handler, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 15 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: 30 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- web.ServeMultiple(s.listeners, srv, flags, logging.Slog(logger)) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
		return nil
	}
}

func runWatchdog(ctx context.Context, o *options, logger log.Logger) int {
	level.Info(logger).Log("msg", "Starting "+appName, "version", version.Info())
	level.Info(logger).Log("msg", "Build context", "build_context", version.BuildContext())
	if os.Geteuid() == 0 {
		level.Warn(logger).Log("msg", "running as root; the watchdog needs no privileges")
	}
	cfg, err := watchdogConfig(o, logger)
	if err != nil {
		level.Error(logger).Log("msg", "invalid configuration", "err", err)
		return 2
	}
	if len(cfg.Plugins) == 0 {
		level.Warn(logger).Log("msg", "no --plugin.url given: watching SGLang's queue gauges only; stuck requests cannot be listed or released")
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		level.Error(logger).Log("msg", "invalid configuration", "err", err)
		return 2
	}
	var receiver *alertwebhook.Receiver
	if o.webhook {
		receiver = alertwebhook.New(wd, logger)
	}
	srv, err := newServer(o, wd, receiver, logger)
	if err != nil {
		level.Error(logger).Log("msg", "cannot start the HTTP server", "err", err)
		return 1
	}
	level.Info(logger).Log("msg", "watching", "plugins", strings.Join(o.pluginURLs, ","), "sglang_metrics", o.metricsURL,
		"mode", cfg.Mode, "deadline", cfg.Deadline, "stall_window", cfg.StallWindow, "pin_window", cfg.PinWindow)
	return serveAndWatch(ctx, srv, o.web, wd, receiver, logger)
}

// serveAndWatch runs the HTTP server, the watchdog loop and the webhook
// worker until ctx ends or the server fails.
func serveAndWatch(ctx context.Context, srv *server, flags *web.FlagConfig, wd *watchdog.Watchdog, receiver *alertwebhook.Receiver, logger log.Logger) int {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = wd.Run(ctx)
	}()
	if receiver != nil {
		go receiver.Run(ctx)
	}
	err := srv.serve(ctx, flags, logger)
	cancel()
	<-done
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		level.Error(logger).Log("msg", "HTTP server failed", "err", err)
		return 1
	}
	level.Info(logger).Log("msg", "stopped")
	return 0
}
