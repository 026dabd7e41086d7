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
	"net/netip"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/config"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"
	"go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
	"github.com/sglang-watchdog/sglang-watchdog/loopback"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/tokenfile"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

const (
	appName     = "sglang-watchdog"
	defaultPort = ":9433"

	// pluginWait is how long the plugin holds an admin call while it waits
	// for its scheduler thread (docs/plugin-api.md); an admin timeout must
	// be longer, or every answer from a busy scheduler is lost.
	pluginWait = 5 * time.Second
	// metricsOff turns the gauge watch off: --sglang.metrics-url=off. An
	// empty value does too on the command line, but an empty environment
	// variable counts as unset.
	metricsOff = "off"
)

// optDuration is a duration flag that remembers whether it was given (on
// the command line or in the environment), so that its default can follow
// another flag and an explicit value can be checked against it.
type optDuration struct {
	d   time.Duration
	set bool
}

func (o *optDuration) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	o.d, o.set = d, true
	return nil
}

func (o *optDuration) String() string {
	if !o.set {
		return ""
	}
	return o.d.String()
}

// or returns the given value, or def when none was given.
func (o optDuration) or(def time.Duration) time.Duration {
	if o.set {
		return o.d
	}
	return def
}

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
	decodeDeadline                             time.Duration
	maxRooms                                   int
	mode                                       string
	maxPerMinute                               int
	confirmTimeout, adminTimeout               time.Duration
	// run only: fail-fast behind a transfer wedge and restart escalation.
	failFast           bool
	failFastPerMinute  int
	restartMode        string
	restartMinInterval time.Duration
	restartStateFile   string
}

// decodeOptions say how a decode-side watchdog asks the watchdogs of the
// prefill peers for their verdicts (docs/decode.md).
type decodeOptions struct {
	prefillURL        string
	prefillNetworks   []string
	prefillHTTPConfig string
	prefillTimeout    time.Duration
	maxPerMinute      int
}

type options struct {
	log logging.Config

	web           *web.FlagConfig
	telemetryPath string
	probeAddress  string

	metricsURL      string
	metricsInterval time.Duration
	metricsTimeout  optDuration

	pluginURLs    []string
	tokenFile     string
	pluginTimeout optDuration
	pluginTLSFile string
	allowRemote   bool

	watch            watchOptions
	decode           decodeOptions
	webhook          bool
	webhookTokenFile string
	webhookMatch     []string

	// inflight
	output string

	// force-fail
	rid        string
	room       string
	ffURLs     []string
	reason     string
	dryRun     bool
	ffTimeout  time.Duration
	ffToken    string
	ffRemote   bool
	ffInflight time.Duration
	// decode only
	prefillStopped bool

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
	runCmd.Flag("web.probe-listen-address", "Address of a plain-HTTP listener serving only /-/healthy and /-/ready, without the TLS and authentication of --web.config.file, for kubelet probes. Empty: none.").StringVar(&o.probeAddress)
	runCmd.Flag("sglang.metrics-url", "SGLang's /metrics URL; \""+metricsOff+"\" turns the gauge watch off.").Default("http://127.0.0.1:30000/metrics").StringVar(&o.metricsURL)
	runCmd.Flag("sglang.metrics-interval", "How often SGLang's /metrics is read. Each read costs SGLang tens of milliseconds of CPU on its API process.").Default("15s").DurationVar(&o.metricsInterval)
	runCmd.Flag("sglang.timeout", "Timeout of one /metrics read; shorter than --sglang.metrics-interval. Default: a third of the interval.").SetValue(&o.metricsTimeout)
	runCmd.Flag("plugin.url", "Base URL of the plugin of one prefill or decode rank, e.g. http://127.0.0.1:30100 (repeatable); the role is read from the listing.").StringsVar(&o.pluginURLs)
	runCmd.Flag("plugin.token-file", "File holding the plugin's bearer token, sent on admin calls only; re-read on every call.").StringVar(&o.tokenFile)
	runCmd.Flag("plugin.timeout", "Timeout of one listing read; shorter than --watchdog.interval. Default: 80% of the interval.").SetValue(&o.pluginTimeout)
	runCmd.Flag("plugin.tls-config-file", "YAML file with the TLS settings for https plugin URLs (the tls_config block of Prometheus: ca_file, cert_file, key_file, server_name, insecure_skip_verify, min_version).").StringVar(&o.pluginTLSFile)
	runCmd.Flag("plugin.allow-remote", "Allow plugin and SGLang URLs that are not loopback addresses.").BoolVar(&o.allowRemote)
	addWatchFlags(runCmd, &o.watch, "dry-run")
	runCmd.Flag("force-fail.fail-fast", "Fail the requests queued behind a diagnosed transfer wedge at once, on every PP stage, instead of at the deadline (auto mode; dry runs in dry-run mode).").Default("true").BoolVar(&o.watch.failFast)
	runCmd.Flag("force-fail.fail-fast-max-per-minute", "Most fail-fast requests over any 60 seconds, apart from --force-fail.max-per-minute.").Default("180").IntVar(&o.watch.failFastPerMinute)
	runCmd.Flag("decode.max-per-minute", "Most decode requests released over any 60 seconds, apart from both --force-fail budgets; a decode rank may get several in one cycle. Default: prefill's fail-fast budget, since each room failed fast strands one decode request (README, Rate limits).").Default(strconv.Itoa(watchdog.DefaultDecodePerMinute)).IntVar(&o.decode.maxPerMinute)
	runCmd.Flag("decode.prefill-watchdog-url", "URL of the prefill peer's watchdog with {host} for the host of a decode request's bootstrap_addr, e.g. http://{host}:9433. A stuck decode request whose transfer started is released early only when that watchdog answers \"stopped\" for its room (or SGLang marked it Failed). Empty: such requests are held for SGLang's own timeout, unless this watchdog watches the prefill ranks too.").StringVar(&o.decode.prefillURL)
	runCmd.Flag("decode.prefill-networks", "CIDR a bootstrap_addr host must be in to be asked for a verdict (repeatable); the host comes from listing data, so nothing else is ever asked.").Default("127.0.0.0/8", "::1/128").StringsVar(&o.decode.prefillNetworks)
	runCmd.Flag("decode.prefill-watchdog-http-config-file", "YAML file with the HTTP client settings (tls_config, basic_auth, authorization) for --decode.prefill-watchdog-url, matching the prefill watchdog's --web.config.file.").StringVar(&o.decode.prefillHTTPConfig)
	runCmd.Flag("decode.prefill-watchdog-timeout", "Timeout of one verdict lookup; it runs inside the watch cycle, for a held request at most every 5s.").Default("500ms").DurationVar(&o.decode.prefillTimeout)
	runCmd.Flag("restart.mode", "Escalate a diagnosed transfer wedge to a restart of the SGLang server through the plugin: off, dry-run or auto.").Default("off").EnumVar(&o.watch.restartMode, "off", "dry-run", "auto")
	runCmd.Flag("restart.min-interval", "Least time between two restarts of this pod; a process is never restarted twice.").Default("30m").DurationVar(&o.watch.restartMinInterval)
	runCmd.Flag("restart.state-file", "File that keeps the time of the last restart across restarts of the watchdog itself, on a volume that outlives its container (an emptyDir); without it a crash-looping watchdog forgets --restart.min-interval. Written before each restart request, and at start in auto mode.").StringVar(&o.watch.restartStateFile)
	runCmd.Flag("alertmanager.webhook", "Serve POST "+alertwebhook.Path+": a firing "+alertwebhook.AlertName+" alert about this watchdog force-fails the stuck requests of its rank, through the same rails as auto mode. Needs --alertmanager.webhook.token-file and --alertmanager.webhook.match-label.").BoolVar(&o.webhook)
	runCmd.Flag("alertmanager.webhook.token-file", "File holding the bearer token Alertmanager must send to the webhook; re-read on every delivery.").StringVar(&o.webhookTokenFile)
	runCmd.Flag("alertmanager.webhook.match-label", "NAME=VALUE that an alert must carry to be acted on, naming this watchdog, e.g. pod=$(POD_NAME) (repeatable; all must match).").StringsVar(&o.webhookMatch)

	inflightCmd := app.Command("inflight", "List every rank's inflight requests (prefill) and prealloc and transfer queues (decode), oldest first.")
	inflightCmd.Flag("plugin.url", "Base URL of the plugin of one prefill or decode rank (repeatable).").Required().StringsVar(&o.pluginURLs)
	inflightCmd.Flag("plugin.timeout", "Timeout of one listing read.").Default("5s").DurationVar(&o.ffInflight)
	inflightCmd.Flag("plugin.tls-config-file", "YAML file with the TLS settings for https plugin URLs.").StringVar(&o.pluginTLSFile)
	inflightCmd.Flag("plugin.allow-remote", "Allow plugin URLs that are not loopback addresses.").BoolVar(&o.allowRemote)
	inflightCmd.Flag("output", "Output format: table or json.").Default("table").EnumVar(&o.output, "table", "json")

	ffCmd := app.Command("force-fail", "Force-fail one inflight request through the plugin's admin call.")
	ffCmd.Flag("rid", "Request id to force-fail.").NoEnvar().Required().StringVar(&o.rid)
	ffCmd.Flag("room", "Bootstrap room the request must have; strongly advised, as rooms are reused.").NoEnvar().StringVar(&o.room)
	ffCmd.Flag("plugin.url", "Base URL of the plugin of the request's rank; repeat it for every PP stage of the DP rank, since SGLang releases a request only when every stage reports it terminal.").Default("http://127.0.0.1:30100").StringsVar(&o.ffURLs)
	ffCmd.Flag("plugin.token-file", "File holding the plugin's bearer token.").StringVar(&o.ffToken)
	ffCmd.Flag("reason", "Why, recorded by the plugin with the failure.").NoEnvar().Default("manual force-fail with sglang-watchdog").StringVar(&o.reason)
	ffCmd.Flag("prefill-stopped", "Decode only: assert that the prefill peer has stopped sending KV for this request's room (sends prefill_stopped: true). A decode plugin refuses a request whose transfer started without it (409 transfer_live). Asserting it wrongly lets a late write from prefill corrupt the KV of another request that reuses the freed pages: a silently wrong answer. Check the prefill watchdog's verdict for the room (GET /api/v1/rooms/<room> answers \"stopped\") first.").NoEnvar().BoolVar(&o.prefillStopped)
	ffCmd.Flag("dry-run", "Ask the plugin whether it would flip the lever, and change nothing.").NoEnvar().BoolVar(&o.dryRun)
	ffCmd.Flag("force-fail.timeout", "Timeout of the admin call; longer than the plugin's 5s wait.").Default("7s").DurationVar(&o.ffTimeout)
	ffCmd.Flag("plugin.tls-config-file", "YAML file with the TLS settings for an https plugin URL.").StringVar(&o.pluginTLSFile)
	ffCmd.Flag("plugin.allow-remote", "Allow a plugin URL that is not a loopback address.").BoolVar(&o.ffRemote)

	addDemoFlags(app, &o.demo)
	return app
}

func addWatchFlags(cmd *kingpin.CmdClause, w *watchOptions, defaultMode string) {
	cmd.Flag("watchdog.interval", "How often plugin listings are read and decisions made.").Default("1s").DurationVar(&w.interval)
	cmd.Flag("watchdog.deadline", "A request younger than this in the inflight queue is never stuck.").Default("60s").DurationVar(&w.deadline)
	cmd.Flag("watchdog.decode-deadline", "A decode request younger than this (time in the decode prealloc and transfer queues) is never stuck; below SGLang's own 300s waiting timeout, above the prefill deadline plus stall window (docs/decode.md).").Default("180s").DurationVar(&w.decodeDeadline)
	cmd.Flag("watchdog.stall-window", "A request is stuck only if neither its progress nor its poll state changed for this long while the scheduler loop kept running; also the wedged-loop window.").Default("30s").DurationVar(&w.stallWindow)
	cmd.Flag("watchdog.pin-window", "A queue gauge non-zero and unchanged this long, with no progress counter moving, is pinned.").Default("2m").DurationVar(&w.pinWindow)
	cmd.Flag("watchdog.max-rooms", "Most inflight requests remembered at once.").Default("100000").IntVar(&w.maxRooms)
	cmd.Flag("force-fail.mode", "off (detect only), dry-run (send dry_run: true), auto (force-fail).").Default(defaultMode).EnumVar(&w.mode, "off", "dry-run", "auto")
	cmd.Flag("force-fail.max-per-minute", "Most force-fail calls over any 60 seconds.").Default("6").IntVar(&w.maxPerMinute)
	cmd.Flag("force-fail.confirm-timeout", "How long a release may take to be confirmed before it counts as unconfirmed.").Default("60s").DurationVar(&w.confirmTimeout)
	cmd.Flag("force-fail.timeout", "Timeout of one admin call; longer than the 5s the plugin waits for its scheduler.").Default("7s").DurationVar(&w.adminTimeout)
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

// pluginTransports returns the round trippers of listing reads (TLS only:
// a listing needs no token) and of admin calls (TLS and the bearer token,
// re-read from its file on every call, so that a rotated Secret needs no
// restart). Neither uses a proxy from the environment.
func pluginTransports(tlsFile, tokenFile string) (listing, admin http.RoundTripper, err error) {
	var cfg config.HTTPClientConfig
	if tlsFile != "" {
		b, err := os.ReadFile(tlsFile)
		if err != nil {
			return nil, nil, fmt.Errorf("reading --plugin.tls-config-file: %w", err)
		}
		if err := yaml.UnmarshalStrict(b, &cfg.TLSConfig); err != nil {
			return nil, nil, fmt.Errorf("--plugin.tls-config-file %s: %w", tlsFile, err)
		}
		cfg.TLSConfig.SetDirectory(filepath.Dir(tlsFile))
		if _, err := config.NewTLSConfig(&cfg.TLSConfig); err != nil {
			return nil, nil, fmt.Errorf("--plugin.tls-config-file %s: %w", tlsFile, err)
		}
	}
	listing, err = config.NewRoundTripperFromConfig(cfg, "plugin", config.WithIdleConnTimeout(30*time.Second))
	if err != nil {
		return nil, nil, err
	}
	admin = listing
	if tokenFile != "" {
		if _, err := tokenfile.Read(tokenFile); err != nil {
			return nil, nil, err
		}
		admin = config.NewAuthorizationCredentialsRoundTripper("Bearer", tokenfile.Secret{Path: tokenFile}, listing)
	}
	return listing, admin, nil
}

// canonicalURL is the form under which two URLs of one endpoint compare
// equal: scheme and host in lower case, IP addresses in one spelling
// (::1 and 0:0:0:0:0:0:0:1, ::ffff:127.0.0.1 and 127.0.0.1), the port
// written out (default ports included, no leading zeros), no trailing
// slash.
func canonicalURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("invalid URL %q: %w", raw, err)
	}
	scheme := strings.ToLower(u.Scheme)
	host := strings.ToLower(u.Hostname())
	if ip := net.ParseIP(host); ip != nil {
		host = ip.String()
	}
	port := u.Port()
	switch {
	case port == "" && scheme == "https":
		port = "443"
	case port == "":
		port = "80"
	default:
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			return "", fmt.Errorf("URL %q: invalid port %q", raw, port)
		}
		port = strconv.FormatUint(n, 10)
	}
	return scheme + "://" + net.JoinHostPort(host, port) + strings.TrimRight(u.EscapedPath(), "/"), nil
}

// checkDistinct refuses two plugin URLs that name the same endpoint: one
// rank watched twice means two admin calls for one room and a /metrics
// that fails on duplicate series.
func checkDistinct(urls []string) error {
	seen := map[string]string{}
	for _, u := range urls {
		c, err := canonicalURL(u)
		if err != nil {
			return err
		}
		if first, ok := seen[c]; ok {
			return fmt.Errorf("--plugin.url %q and %q name the same plugin (%s); give each rank once", first, u, c)
		}
		seen[c] = u
	}
	return nil
}

// checkTimeout refuses a timeout of zero or below, which would mean "no
// timeout": one source that never answers would stop the watchdog.
func checkTimeout(flag string, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("%s (%s) must be above zero: without a timeout, one source that never answers stops the watchdog", flag, d)
	}
	return nil
}

// checkAdminTimeout also refuses a timeout the plugin's own wait fills.
func checkAdminTimeout(flag string, d time.Duration) error {
	if err := checkTimeout(flag, d); err != nil {
		return err
	}
	if d <= pluginWait {
		return fmt.Errorf("%s (%s) must be longer than the %s the plugin waits for its scheduler, or a busy scheduler's answer is always lost", flag, d, pluginWait)
	}
	return nil
}

// checkTelemetryPath refuses a metrics path that the HTTP mux would panic
// on or that would shadow another endpoint.
func checkTelemetryPath(p string) error {
	switch {
	case !strings.HasPrefix(p, "/"):
		return fmt.Errorf("--web.telemetry-path %q must start with /", p)
	case strings.IndexFunc(p, func(r rune) bool { return r <= ' ' || r == 0x7f || strings.ContainsRune("{}?#%", r) }) >= 0:
		return fmt.Errorf("--web.telemetry-path %q may not contain spaces, control characters, braces, ?, # or %%", p)
	case p == "/-/healthy" || p == "/-/ready" || p == alertwebhook.Path:
		return fmt.Errorf("--web.telemetry-path %q is taken by another endpoint", p)
	}
	return nil
}

// metricsSource is SGLang's /metrics URL, or "" when the watch is off.
func (o *options) metricsSource() string {
	if o.metricsURL == metricsOff {
		return ""
	}
	return o.metricsURL
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
	metricsURL := o.metricsSource()
	pluginTimeout := o.pluginTimeout.or(w.interval * 4 / 5)
	metricsTimeout := o.metricsTimeout.or(o.metricsInterval / 3)
	checks := []error{
		checkTimeout("--watchdog.interval", w.interval),
		checkTimeout("--plugin.timeout", pluginTimeout),
		checkAdminTimeout("--force-fail.timeout", w.adminTimeout),
	}
	if metricsURL != "" {
		checks = append(checks, checkTimeout("--sglang.metrics-interval", o.metricsInterval), checkTimeout("--sglang.timeout", metricsTimeout))
	}
	if err := errors.Join(checks...); err != nil {
		return watchdog.Config{}, err
	}
	if pluginTimeout >= w.interval {
		return watchdog.Config{}, fmt.Errorf("--plugin.timeout (%s) must be shorter than --watchdog.interval (%s), so that cycles never overlap; leave it unset to use 80%% of the interval", pluginTimeout, w.interval)
	}
	if metricsURL != "" && metricsTimeout >= o.metricsInterval {
		return watchdog.Config{}, fmt.Errorf("--sglang.timeout (%s) must be shorter than --sglang.metrics-interval (%s); leave it unset to use a third of the interval", metricsTimeout, o.metricsInterval)
	}
	if metricsURL != "" && o.metricsInterval < w.pinWindow/20 {
		level.Warn(logger).Log("msg", "SGLang /metrics is read very often; each read costs SGLang tens of milliseconds of CPU", "interval", o.metricsInterval)
	}
	urls := append([]string(nil), o.pluginURLs...)
	if metricsURL != "" {
		urls = append(urls, metricsURL)
	}
	if err := checkURLs(o.allowRemote, urls...); err != nil {
		return watchdog.Config{}, err
	}
	if err := checkDistinct(o.pluginURLs); err != nil {
		return watchdog.Config{}, err
	}
	listingRT, adminRT, err := pluginTransports(o.pluginTLSFile, o.tokenFile)
	if err != nil {
		return watchdog.Config{}, err
	}
	cfg := watchdog.Config{
		Clock:           clock.Real{},
		Logger:          logger,
		Interval:        w.interval,
		MetricsInterval: o.metricsInterval,
		Deadline:        w.deadline,
		DecodeDeadline:  w.decodeDeadline,
		StallWindow:     w.stallWindow,
		PinWindow:       w.pinWindow,
		MaxRooms:        w.maxRooms,
		Mode:            mode,
		MaxPerMinute:    w.maxPerMinute,
		ConfirmTimeout:  w.confirmTimeout,

		FailFast:           w.failFast,
		FailFastPerMinute:  w.failFastPerMinute,
		DecodePerMinute:    o.decode.maxPerMinute,
		RestartMode:        watchdog.Mode(w.restartMode),
		RestartMinInterval: w.restartMinInterval,
		RestartStateFile:   w.restartStateFile,
	}
	if metricsURL != "" {
		cfg.Metrics = collector.NewMetricsScraper(metricsURL, metricsTimeout)
	}
	if o.decode.maxPerMinute <= 0 {
		return watchdog.Config{}, fmt.Errorf("--decode.max-per-minute must be positive, got %d; to release no decode request, run the decode pod's watchdog with --force-fail.mode=off or dry-run", o.decode.maxPerMinute)
	}
	if w.decodeDeadline <= 0 {
		return watchdog.Config{}, fmt.Errorf("--watchdog.decode-deadline must be positive, got %s", w.decodeDeadline)
	}
	verdicts, err := verdictClient(&o.decode)
	if err != nil {
		return watchdog.Config{}, err
	}
	if verdicts != nil {
		cfg.Verdicts = verdicts
	}
	for _, u := range o.pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: pluginTimeout, AdminTimeout: w.adminTimeout,
			Transport: listingRT, AdminTransport: adminRT}))
	}
	return cfg, nil
}

// verdictCacheTTL keeps a prefill verdict other than "stopped", so that a
// held decode request costs its prefill peer a lookup every few cycles,
// not every cycle.
const verdictCacheTTL = 5 * time.Second

// verdictClient builds the client of the prefill watchdogs' verdict API, or
// nil without --decode.prefill-watchdog-url.
func verdictClient(d *decodeOptions) (*pluginapi.VerdictClient, error) {
	if d.prefillURL == "" {
		if d.prefillHTTPConfig != "" {
			return nil, errors.New("--decode.prefill-watchdog-http-config-file needs --decode.prefill-watchdog-url")
		}
		return nil, nil
	}
	if d.prefillTimeout <= 0 {
		return nil, fmt.Errorf("--decode.prefill-watchdog-timeout must be positive, got %s", d.prefillTimeout)
	}
	var nets []netip.Prefix
	for _, n := range d.prefillNetworks {
		p, err := netip.ParsePrefix(n)
		if err != nil {
			return nil, fmt.Errorf("--decode.prefill-networks %q: %w", n, err)
		}
		nets = append(nets, p.Masked())
	}
	cfg := config.HTTPClientConfig{}
	if d.prefillHTTPConfig != "" {
		c, _, err := config.LoadHTTPConfigFile(d.prefillHTTPConfig)
		if err != nil {
			return nil, fmt.Errorf("--decode.prefill-watchdog-http-config-file %s: %w", d.prefillHTTPConfig, err)
		}
		cfg = *c
	}
	// The prefill watchdog's address comes from listing data: never through
	// a proxy, never redirected.
	cfg.ProxyConfig = config.ProxyConfig{}
	client, err := config.NewClientFromConfig(cfg, "prefill_watchdog", config.WithIdleConnTimeout(30*time.Second))
	if err != nil {
		return nil, fmt.Errorf("--decode.prefill-watchdog-http-config-file %s: %w", d.prefillHTTPConfig, err)
	}
	return pluginapi.NewVerdictClient(pluginapi.VerdictClientOptions{URLTemplate: d.prefillURL, Networks: nets, Client: client,
		Timeout: d.prefillTimeout, CacheTTL: verdictCacheTTL})
}

// liveness tells whether the watch loop still cycles. A cycle ends within
// about an interval (no admin call starts once it is spent, and one call
// lasts at most --force-fail.timeout), so a loop that has not finished a
// cycle for three intervals plus an admin timeout has stopped.
type liveness struct {
	wd      *watchdog.Watchdog
	limit   time.Duration
	started atomic.Pointer[time.Time] // when the loop was started; nil before
	now     func() time.Time
}

func newLiveness(wd *watchdog.Watchdog, interval, adminTimeout time.Duration) *liveness {
	return &liveness{wd: wd, limit: 3*interval + adminTimeout, now: time.Now}
}

func (l *liveness) loopStarted() {
	t := l.now()
	l.started.Store(&t)
}

// check returns why the loop is not live, or "".
func (l *liveness) check() string {
	started := l.started.Load()
	if started == nil {
		return ""
	}
	last := l.wd.LastCycleEnd()
	if last.IsZero() {
		last = *started
	}
	if idle := l.now().Sub(last); idle > l.limit {
		return fmt.Sprintf("the watch loop has not finished a cycle for %s (limit %s)", idle.Round(time.Second), l.limit)
	}
	return ""
}

// server is the watchdog's own HTTP side.
type server struct {
	handler   http.Handler
	listeners []net.Listener
	// probes serves only the health endpoints, in plain HTTP without the
	// web config's authentication, for kubelet probes.
	probes        http.Handler
	probeListener net.Listener
	live          *liveness
}

// healthHandlers registers /-/healthy (the watch loop cycles) and /-/ready
// (the first SGLang read succeeded) on mux.
func healthHandlers(mux *http.ServeMux, wd *watchdog.Watchdog, live *liveness) {
	mux.HandleFunc("/-/healthy", func(w http.ResponseWriter, _ *http.Request) {
		if why := live.check(); why != "" {
			http.Error(w, "Unhealthy: "+why, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "Healthy")
	})
	mux.HandleFunc("/-/ready", func(w http.ResponseWriter, _ *http.Request) {
		if !wd.Ready() {
			http.Error(w, "Not ready: SGLang has not been read successfully yet", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "Ready")
	})
}

// handle registers a pattern given by the operator, turning the mux's
// panic on a pattern it cannot take into an error.
func handle(mux *http.ServeMux, pattern string, h http.Handler) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("--web.telemetry-path %q: %v", pattern, r)
		}
	}()
	mux.Handle(pattern, h)
	return nil
}

func newServer(o *options, wd *watchdog.Watchdog, receiver *alertwebhook.Receiver, logger log.Logger) (*server, error) {
	if err := checkTelemetryPath(o.telemetryPath); err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collector.NewExporter(wd.Snapshot),
		versioncollector.NewCollector("sglang_watchdog"),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	if receiver != nil {
		reg.MustRegister(receiver)
	}
	live := newLiveness(wd, o.watch.interval, o.watch.adminTimeout)
	mux := http.NewServeMux()
	metrics := promhttp.InstrumentMetricHandler(reg, promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:      stdlog.New(log.NewStdlibAdapter(level.Error(logger)), "", 0),
		ErrorHandling: promhttp.ContinueOnError,
	}))
	if err := handle(mux, o.telemetryPath, metrics); err != nil {
		return nil, err
	}
	healthHandlers(mux, wd, live)
	// Read-only, behind the same web config as the metrics: decode-side
	// watchdogs ask it whether prefill stopped sending for a room.
	mux.Handle(pluginapi.PathRoomVerdict, wd.VerdictHandler())
	if receiver != nil {
		mux.Handle(alertwebhook.Path, receiver)
	} else {
		// Count deliveries to a disabled receiver: they mean Alertmanager
		// routes to a watchdog that will not act.
		mux.HandleFunc(alertwebhook.Path, func(w http.ResponseWriter, _ *http.Request) {
			wd.CountWebhook(watchdog.WebhookDisabled)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprintln(w, `{"result":"disabled","error":"start the watchdog with --alertmanager.webhook"}`)
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
	s := &server{handler: mux, live: live}
	if o.probeAddress != "" {
		probes := http.NewServeMux()
		healthHandlers(probes, wd, live)
		s.probes = probes
		l, err := net.Listen("tcp", o.probeAddress)
		if err != nil {
			return nil, fmt.Errorf("listening on --web.probe-listen-address %s: %w", o.probeAddress, err)
		}
		s.probeListener = l
	}
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
	if s.probeListener != nil {
		s.probeListener.Close()
	}
}

func newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 15 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: 30 * time.Second}
}

// serve runs the HTTP server (and the probe listener) until ctx ends.
func (s *server) serve(ctx context.Context, flags *web.FlagConfig, logger log.Logger) error {
	srv := newHTTPServer(s.handler)
	errc := make(chan error, 2)
	go func() { errc <- web.ServeMultiple(s.listeners, srv, flags, logging.Slog(logger)) }()
	var probeSrv *http.Server
	if s.probeListener != nil {
		probeSrv = newHTTPServer(s.probes)
		level.Info(logger).Log("msg", "serving probes without authentication", "address", s.probeListener.Addr(), "paths", "/-/healthy,/-/ready")
		go func() { errc <- probeSrv.Serve(s.probeListener) }()
	}
	select {
	case err := <-errc:
		if probeSrv != nil {
			_ = probeSrv.Close()
		}
		_ = srv.Close()
		return err
	case <-ctx.Done():
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
		if probeSrv != nil {
			_ = probeSrv.Shutdown(shutdown)
		}
		return nil
	}
}

// webhookReceiver builds the Alertmanager receiver from the flags.
func webhookReceiver(o *options, wd *watchdog.Watchdog, logger log.Logger) (*alertwebhook.Receiver, error) {
	if !o.webhook {
		if o.webhookTokenFile != "" || len(o.webhookMatch) > 0 {
			return nil, errors.New("--alertmanager.webhook.token-file and --alertmanager.webhook.match-label need --alertmanager.webhook")
		}
		return nil, nil
	}
	if o.webhookTokenFile == "" {
		return nil, errors.New("--alertmanager.webhook needs --alertmanager.webhook.token-file: the webhook can turn a dry run into force-fails, so it has its own credential")
	}
	if len(o.webhookMatch) == 0 {
		return nil, errors.New("--alertmanager.webhook needs at least one --alertmanager.webhook.match-label (e.g. pod=$(POD_NAME)) naming this watchdog, so that an alert about another pod is never acted on here")
	}
	match := map[string]string{}
	for _, m := range o.webhookMatch {
		k, v, ok := strings.Cut(m, "=")
		if !ok || k == "" || v == "" {
			return nil, fmt.Errorf("--alertmanager.webhook.match-label %q: want NAME=VALUE", m)
		}
		if prev, dup := match[k]; dup && prev != v {
			return nil, fmt.Errorf("--alertmanager.webhook.match-label gives %s twice (%q and %q)", k, prev, v)
		}
		match[k] = v
	}
	if path := *o.web.WebConfigFile; path != "" {
		users, err := webConfigUsers(path)
		if err != nil {
			return nil, err
		}
		if users > 0 {
			return nil, fmt.Errorf("--web.config.file %s sets basic_auth_users, which also guard the webhook, and Alertmanager cannot send basic auth and the webhook's bearer token together; guard scrapers with TLS client certificates (client_ca_file) instead", path)
		}
	}
	return alertwebhook.New(wd, logger, alertwebhook.Options{TokenFile: o.webhookTokenFile, Match: match})
}

// webConfigUsers counts the basic-auth users of a web config file.
func webConfigUsers(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("reading --web.config.file: %w", err)
	}
	var c struct {
		Users map[string]string `yaml:"basic_auth_users"`
	}
	if err := yaml.Unmarshal(b, &c); err != nil {
		return 0, fmt.Errorf("--web.config.file %s: %w", path, err)
	}
	return len(c.Users), nil
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
	if err := checkTelemetryPath(o.telemetryPath); err != nil {
		level.Error(logger).Log("msg", "invalid configuration", "err", err)
		return 2
	}
	if len(cfg.Plugins) == 0 {
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
	srv, err := newServer(o, wd, receiver, logger)
	if err != nil {
		level.Error(logger).Log("msg", "cannot start the HTTP server", "err", err)
		return 1
	}
	level.Info(logger).Log("msg", "watching", "plugins", strings.Join(o.pluginURLs, ","), "sglang_metrics", o.metricsSource(),
		"mode", cfg.Mode, "deadline", cfg.Deadline, "stall_window", cfg.StallWindow, "pin_window", cfg.PinWindow)
	return serveAndWatch(ctx, srv, o.web, wd, receiver, logger)
}

// serveAndWatch runs the HTTP server, the watchdog loop and the webhook
// worker until ctx ends or the server fails.
func serveAndWatch(ctx context.Context, srv *server, flags *web.FlagConfig, wd *watchdog.Watchdog, receiver *alertwebhook.Receiver, logger log.Logger) int {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	srv.live.loopStarted()
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
