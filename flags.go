package main

import (
	"strconv"
	"strings"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/promslog"
	promslogflag "github.com/prometheus/common/promslog/flag"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/internal/runconfig"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// metricsOff turns the gauge watch off: --sglang.metrics-url=off. An empty
// value does too on the command line, but an empty environment variable
// counts as unset.
const metricsOff = "off"

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

// value is the given duration, nil when none was given.
func (o *optDuration) value() *time.Duration {
	if !o.set {
		return nil
	}
	return &o.d
}

type options struct {
	log promslog.Config

	web           *web.FlagConfig
	telemetryPath string
	maxRequests   int
	probeAddress  string

	metricsURL      string
	metricsInterval time.Duration
	metricsTimeout  optDuration

	pluginURLs    []string
	tokenFile     string
	pluginTimeout optDuration
	pluginTLSFile string
	allowRemote   bool
	// node computes this node's plugin URLs (multinode.go).
	node nodeOptions

	watch            runconfig.Watch
	decode           runconfig.Decode
	webhook          bool
	webhookTokenFile string
	webhookMatch     []string
	// configCheck: --config.check, validate and exit.
	configCheck bool

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

// metricsSource is SGLang's /metrics URL, or "" when the watch is off.
func (o *options) metricsSource() string {
	if o.metricsURL == metricsOff {
		return ""
	}
	return o.metricsURL
}

// usageTemplate is kingpin's default help with the default command's flags
// in the top-level help too: `sglang-watchdog --help` is what an operator
// reads, and run is what the sidecar runs.
var usageTemplate = strings.Replace(kingpin.DefaultUsageTemplate, "{{else if .App.Commands -}}\nCommands:\n", `{{else if .App.Commands -}}
{{range .App.Commands}}{{if .Default -}}
Flags of {{.Name}}, the default command:
{{.Flags|FlagsToTwoColumns|FormatTwoColumns}}
{{end}}{{end -}}
Commands:
`, 1)

// newApp declares every flag. Tests parse manifests' arguments with it.
func newApp(o *options) *kingpin.Application {
	app := kingpin.New(appName, "Prometheus exporter and stuck-request watchdog for SGLang prefill/decode disaggregation.").DefaultEnvars()
	app.Version(version.Print(appName))
	app.HelpFlag.Short('h')
	app.UsageTemplate(usageTemplate)
	promslogflag.AddFlags(app, &o.log)

	runCmd := app.Command("run", "Export metrics and watch for stuck requests (the default).").Default()
	o.web = kingpinflag.AddFlags(runCmd, defaultPort)
	runCmd.Flag("web.telemetry-path", "Path under which to expose metrics.").Default("/metrics").StringVar(&o.telemetryPath)
	runCmd.Flag("web.max-requests", "Maximum number of parallel scrape requests; beyond it a scrape gets 503. 0 disables the limit.").Default("40").IntVar(&o.maxRequests)
	runCmd.Flag("web.probe-listen-address", "Address of a plain-HTTP listener serving only /-/healthy and /-/ready, without the TLS and authentication of --web.config.file, for kubelet probes. Empty: none.").StringVar(&o.probeAddress)
	runCmd.Flag("sglang.metrics-url", "SGLang's /metrics URL; \""+metricsOff+"\" turns the gauge watch off.").Default("http://127.0.0.1:30000/metrics").StringVar(&o.metricsURL)
	runCmd.Flag("sglang.metrics-interval", "How often SGLang's /metrics is read. Each read costs SGLang tens of milliseconds of CPU on its API process.").Default("15s").DurationVar(&o.metricsInterval)
	runCmd.Flag("sglang.timeout", "Timeout of one /metrics read; shorter than --sglang.metrics-interval. Default: a third of the interval.").SetValue(&o.metricsTimeout)
	runCmd.Flag("plugin.url", "Base URL of the plugin of one prefill or decode rank, e.g. http://127.0.0.1:28100 (repeatable); the role is read from the listing.").StringsVar(&o.pluginURLs)
	runCmd.Flag("plugin.token-file", "File holding the plugin's bearer token, sent on admin calls only; re-read on every call.").StringVar(&o.tokenFile)
	runCmd.Flag("plugin.timeout", "Timeout of one listing read; shorter than --watchdog.interval. Default: 80% of the interval.").SetValue(&o.pluginTimeout)
	runCmd.Flag("plugin.tls-config-file", "YAML file with the TLS settings for https plugin URLs (the tls_config block of Prometheus: ca_file, cert_file, key_file, server_name, insecure_skip_verify, min_version).").StringVar(&o.pluginTLSFile)
	runCmd.Flag("plugin.allow-remote", "Allow plugin and SGLang URLs that are not loopback addresses.").BoolVar(&o.allowRemote)
	runCmd.Flag("sglang.nnodes", "SGLang's --nnodes: how many nodes (pods) the instance spans. With --sglang.tp-size, the sidecar watches the plugin listeners of its own node (docs/deployment.md, Multi-node instances).").Default("1").IntVar(&o.node.args.NNodes)
	runCmd.Flag("sglang.node-rank", "SGLang's --node-rank of this pod's node, e.g. $(LWS_WORKER_INDEX).").Default("0").IntVar(&o.node.args.NodeRank)
	runCmd.Flag("sglang.tp-size", "SGLang's --tp-size. Given, the sidecar computes its node's plugin URLs (http://<--plugin.host>:<--plugin.base-port + index>) instead of taking --plugin.url.").IntVar(&o.node.args.TPSize)
	runCmd.Flag("sglang.dp-size", "SGLang's --dp-size.").Default("1").IntVar(&o.node.args.DPSize)
	runCmd.Flag("sglang.pp-size", "SGLang's --pp-size.").Default("1").IntVar(&o.node.args.PPSize)
	runCmd.Flag("sglang.attn-cp-size", "SGLang's attention context-parallel size (--attn-cp-size, v0.5.10 on), as SGLang resolved it.").Default("1").IntVar(&o.node.args.AttnCPSize)
	runCmd.Flag("sglang.enable-dp-attention", "SGLang's --enable-dp-attention.").BoolVar(&o.node.args.EnableDPAttention)
	runCmd.Flag("plugin.base-port", "The plugins' SGLANG_WATCHDOG_PLUGIN_PORT, with --sglang.tp-size.").Default("28100").IntVar(&o.node.basePort)
	runCmd.Flag("plugin.host", "The plugins' SGLANG_WATCHDOG_PLUGIN_HOST as seen from this sidecar, with --sglang.tp-size.").Default("127.0.0.1").StringVar(&o.node.host)
	addWatchFlags(runCmd, &o.watch, "dry-run")
	runCmd.Flag("force-fail.fail-fast", "Send one wedge order per diagnosed transfer wedge, renewed while it holds, so that the plugin fails every room queued behind it at once instead of leaving them hung (auto mode; a dry run in dry-run mode). Needs a plugin that reports transfer_progress.").Default("true").BoolVar(&o.watch.FailFast)
	runCmd.Flag("force-fail.fail-fast-max-per-minute", "Most new wedge orders over any 60 seconds (renewals are free), apart from --force-fail.max-per-minute.").Default(strconv.Itoa(watchdog.DefaultFailFastPerMinute)).IntVar(&o.watch.FailFastPerMinute)
	runCmd.Flag("watchdog.fail-fast-min-age", "A wedge order never fails a room younger than this (docs/runbook.md, Transfer liveness).").Default(watchdog.DefaultFailFastMinAge.String()).DurationVar(&o.watch.FailFastMinAge)
	runCmd.Flag("decode.max-per-minute", "Most decode requests released over any 60 seconds, apart from both --force-fail budgets; a decode rank may get several in one cycle. Default: prefill's fail-fast budget, since each room failed fast strands one decode request (docs/design.md, Rate limits).").Default(strconv.Itoa(watchdog.DefaultDecodePerMinute)).IntVar(&o.decode.MaxPerMinute)
	runCmd.Flag("decode.prefill-watchdog-url", "URL of the prefill peer's watchdog with {host} for the host of a decode request's bootstrap_addr, or of each of its prefill_rank_addrs where the decode plugin lists them, e.g. http://{host}:9433. A stuck decode request whose transfer started is released early only when that watchdog answers \"stopped\" for its room (or SGLang marked it Failed). Empty: such requests are held for SGLang's own timeout, unless this watchdog watches the prefill ranks too.").StringVar(&o.decode.PrefillURL)
	runCmd.Flag("decode.prefill-networks", "CIDR a bootstrap_addr host must be in to be asked for a verdict (repeatable); the host comes from listing data, so nothing else is ever asked.").Default("127.0.0.0/8", "::1/128").StringsVar(&o.decode.PrefillNetworks)
	runCmd.Flag("decode.prefill-watchdog-http-config-file", "YAML file with the HTTP client settings (tls_config, basic_auth, authorization) for --decode.prefill-watchdog-url, matching the prefill watchdog's --web.config.file.").StringVar(&o.decode.PrefillHTTPConfig)
	runCmd.Flag("decode.prefill-watchdog-timeout", "Timeout of one verdict lookup; it runs inside the watch cycle, for a held request at most every 5s.").Default("500ms").DurationVar(&o.decode.PrefillTimeout)
	runCmd.Flag("restart.mode", "Escalate a diagnosed transfer wedge to a restart of the SGLang server through the plugin: off, dry-run or auto.").Default("off").EnumVar(&o.watch.RestartMode, "off", "dry-run", "auto")
	runCmd.Flag("restart.min-interval", "Least time between two restarts of this pod; a process is never restarted twice.").Default(watchdog.DefaultRestartMinInterval.String()).DurationVar(&o.watch.RestartMinInterval)
	runCmd.Flag("restart.state-file", "File that keeps the time of the last restart across restarts of the watchdog itself, on a volume that outlives its container (an emptyDir); without it a crash-looping watchdog forgets --restart.min-interval. Written before each restart request, and at start in auto mode.").StringVar(&o.watch.RestartStateFile)
	runCmd.Flag("force-fail.mode-file", "File holding off, dry-run or auto (e.g. a mounted ConfigMap key), re-read every --watchdog.interval: while it holds a valid mode, that mode overrides --force-fail.mode and caps --restart.mode, so an SRE switches modes without restarting SGLang's pods. Missing: the flags' modes apply. Invalid: the modes stay as they were (logged, counted in sglang_watchdog_mode_file_errors_total).").StringVar(&o.watch.ModeFile)
	runCmd.Flag("config.check", "Check every flag and every file the flags name (web config, token files, TLS and HTTP client configs, mode file, restart state file, URLs), print \""+configOKMessage+"\" and exit 0, or the error and exit 2, without listening or reading SGLang.").NoEnvar().BoolVar(&o.configCheck)
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
	ffCmd.Flag("plugin.url", "Base URL of the plugin of the request's rank; repeat it for every PP stage of the DP rank, since SGLang releases a request only when every stage reports it terminal.").Default("http://127.0.0.1:28100").StringsVar(&o.ffURLs)
	ffCmd.Flag("plugin.token-file", "File holding the plugin's bearer token.").StringVar(&o.ffToken)
	ffCmd.Flag("reason", "Why, recorded by the plugin with the failure.").NoEnvar().Default("manual force-fail with sglang-watchdog").StringVar(&o.reason)
	ffCmd.Flag("prefill-stopped", "Decode only: assert that the prefill peer has stopped sending KV for this request's room (sends prefill_stopped: true). A decode plugin refuses a request whose transfer started without it (409 transfer_live). Asserting it wrongly lets a late write from prefill corrupt the KV of another request that reuses the freed pages: a silently wrong answer. Check the prefill watchdog's verdict for the room (GET /api/v1/rooms/<room> answers \"stopped\") first.").NoEnvar().BoolVar(&o.prefillStopped)
	ffCmd.Flag("dry-run", "Ask the plugin whether it would flip the lever, and change nothing.").NoEnvar().BoolVar(&o.dryRun)
	ffCmd.Flag("force-fail.timeout", "Timeout of the admin call; longer than the plugin's 5s wait.").Default(watchdog.DefaultAdminTimeout.String()).DurationVar(&o.ffTimeout)
	ffCmd.Flag("plugin.tls-config-file", "YAML file with the TLS settings for an https plugin URL.").StringVar(&o.pluginTLSFile)
	ffCmd.Flag("plugin.allow-remote", "Allow a plugin URL that is not a loopback address.").BoolVar(&o.ffRemote)

	addDemoFlags(app, &o.demo)
	return app
}

func addWatchFlags(cmd *kingpin.CmdClause, w *runconfig.Watch, defaultMode string) {
	cmd.Flag("watchdog.interval", "How often plugin listings are read and decisions made.").Default(watchdog.DefaultInterval.String()).DurationVar(&w.Interval)
	cmd.Flag("watchdog.deadline", "A request younger than this in the inflight queue is never stuck.").Default(watchdog.DefaultDeadline.String()).DurationVar(&w.Deadline)
	cmd.Flag("watchdog.decode-deadline", "A decode request younger than this (time in the decode prealloc and transfer queues) is never stuck; below SGLang's own 300s waiting timeout, above the prefill deadline plus stall window (docs/decode.md).").Default(watchdog.DefaultDecodeDeadline.String()).DurationVar(&w.DecodeDeadline)
	cmd.Flag("watchdog.link-margin", "A chunk in a transfer worker's hands is overdue after this many times what its size needs at the slow end of its own link's measured pace (a link is the set of decode destinations the chunk is sent to; never before the stall window; twice the deadline while the link showed no chunk). Only with a plugin that reports transfer_progress.").Default(strconv.Itoa(watchdog.DefaultLinkMargin)).Float64Var(&w.LinkMargin)
	cmd.Flag("watchdog.link-idle", "A link that neither finished nor held a chunk for this long is forgotten: its next chunk gets the first-chunk rule again.").Default(watchdog.DefaultLinkIdle.String()).DurationVar(&w.LinkIdle)
	cmd.Flag("watchdog.stall-window", "A request is stuck only if neither its progress nor its poll state changed for this long while the scheduler loop kept running; also the wedged-loop window.").Default(watchdog.DefaultStallWindow.String()).DurationVar(&w.StallWindow)
	cmd.Flag("watchdog.pin-window", "A queue gauge non-zero and unchanged this long, with no progress counter moving, is pinned.").Default(watchdog.DefaultPinWindow.String()).DurationVar(&w.PinWindow)
	cmd.Flag("watchdog.max-rooms", "Most inflight requests remembered at once. Each costs about 2 KiB of memory (BENCHMARKS.md, Footprint): give the container a memory limit of 32 MiB + 2 KiB x max-rooms (64 MiB fits 16,000 rooms; 100,000 needs 228 MiB); run warns at start when the limit is lower.").Default(strconv.Itoa(watchdog.DefaultMaxRooms)).IntVar(&w.MaxRooms)
	cmd.Flag("force-fail.mode", "off (detect only), dry-run (send dry_run: true), auto (force-fail).").Default(defaultMode).EnumVar(&w.Mode, "off", "dry-run", "auto")
	cmd.Flag("force-fail.max-per-minute", "Most force-fail calls over any 60 seconds.").Default(strconv.Itoa(watchdog.DefaultMaxPerMinute)).IntVar(&w.MaxPerMinute)
	cmd.Flag("force-fail.confirm-timeout", "How long a release may take to be confirmed before it counts as unconfirmed.").Default(watchdog.DefaultConfirmTimeout.String()).DurationVar(&w.ConfirmTimeout)
	cmd.Flag("force-fail.timeout", "Timeout of one admin call; longer than the 5s the plugin waits for its scheduler.").Default(watchdog.DefaultAdminTimeout.String()).DurationVar(&w.AdminTimeout)
}
