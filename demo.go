package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/go-kit/log"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

type demoOptions struct {
	ranks    int
	duration time.Duration
	era      string
	backend  string
	listen   string
	mode     string
}

func addDemoFlags(app *kingpin.Application, d *demoOptions) {
	cmd := app.Command("demo", "Run the SGLang simulator and the watchdog together on loopback, inject the three pin mechanisms, and narrate detection and release.")
	cmd.Flag("demo.ranks", "Prefill DP ranks to simulate, one plugin listener each.").Default("2").IntVar(&d.ranks)
	cmd.Flag("demo.duration", "How long to run; 0 runs until interrupted.").Default("75s").DurationVar(&d.duration)
	cmd.Flag("demo.era", "SGLang /metrics label era: name, model_name, engine_type, v0.5 or newest.").Default(sglangsim.EraV05).EnumVar(&d.era,
		sglangsim.EraName, sglangsim.EraModelName, sglangsim.EraEngineType, sglangsim.EraV05, sglangsim.EraNewest)
	cmd.Flag("demo.backend", "KV transfer backend, which decides the lever: nixl (_send_failed) or mooncake (conclude_state).").Default(sglangsim.BackendNIXL).EnumVar(&d.backend,
		sglangsim.BackendNIXL, sglangsim.BackendMooncake)
	cmd.Flag("web.listen-address", "Address of the watchdog's metrics endpoint.").Default("127.0.0.1:0").StringVar(&d.listen)
	cmd.Flag("force-fail.mode", "off, dry-run or auto.").Default("auto").EnumVar(&d.mode, "off", "dry-run", "auto")
}

// Windows of the demo: short, so that a pin is caught within half a minute.
const (
	demoDeadline     = 20 * time.Second
	demoStallWindow  = 10 * time.Second
	demoPinWindow    = 30 * time.Second
	demoMetricsEvery = 5 * time.Second
)

// narrator prints one line per event, with the time since the demo began.
type narrator struct {
	mu    sync.Mutex
	out   io.Writer
	start time.Time
}

func (n *narrator) say(format string, args ...interface{}) {
	n.mu.Lock()
	defer n.mu.Unlock()
	fmt.Fprintf(n.out, "[%5.1fs] %s\n", time.Since(n.start).Seconds(), fmt.Sprintf(format, args...))
}

func (n *narrator) event(e watchdog.Event) {
	who := fmt.Sprintf("dp%d/pp%d rid=%.12s room=%d", e.DPRank, e.PPRank, e.RID, e.Room)
	switch e.Kind {
	case watchdog.EventStuck:
		n.say("STUCK        %s: %.0fs in %s, progress %d frozen", who, e.Age, e.Poll, e.Progress)
	case watchdog.EventForceFail:
		n.say("FORCE-FAIL   %s: %s (trigger %s)", who, e.Result, e.Trigger)
	case watchdog.EventSkipped:
		n.say("NOT ACTED    %s: %s", who, e.Reason)
	case watchdog.EventReleased:
		n.say("RELEASED     %s: left the inflight queue, sglang:num_transfer_failed_reqs_total rose", who)
	case watchdog.EventUnconfirmed:
		n.say("UNCONFIRMED  %s: lever set but the release was not seen", who)
	case watchdog.EventPinned:
		n.say("PINNED GAUGE %s dp%s/pp%s/tp%s: non-zero and unchanged for %s with no progress", e.Gauge.Queue, e.Gauge.DP, e.Gauge.PP, e.Gauge.TP, demoPinWindow)
	case watchdog.EventWedged:
		n.say("WEDGED       dp%d/pp%d: scheduler loop stopped with requests queued", e.DPRank, e.PPRank)
	}
}

func runDemo(ctx context.Context, o *options, logger log.Logger, stdout io.Writer) int {
	d := o.demo
	if d.ranks < 1 {
		fmt.Fprintln(stdout, "--demo.ranks must be at least 1")
		return 2
	}
	if d.duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.duration)
		defer cancel()
	}
	n := &narrator{out: stdout, start: time.Now()}
	sim, err := sglangsim.New(sglangsim.Options{
		Clock: clock.Real{}, DPSize: d.ranks, Era: d.era, Backend: d.backend, Seed: 1,
		ArrivalRate: 3, TransferMedian: 300 * time.Millisecond, SlowFraction: 0.03, SlowChunkEvery: 3 * time.Second,
		HealthCheckEvery: 10 * time.Second, HookRunsWhenEmpty: d.era == sglangsim.EraNewest,
	})
	if err != nil {
		fmt.Fprintf(stdout, "simulator: %v\n", err)
		return 1
	}
	sim.Start(ctx)
	metricsURL, pluginURLs, err := sim.Listen(ctx)
	if err != nil {
		fmt.Fprintf(stdout, "simulator: %v\n", err)
		return 1
	}
	mode, _ := watchdog.ParseMode(d.mode)
	cfg := watchdog.Config{
		Clock: clock.Real{}, Logger: logger,
		Metrics:  collector.NewMetricsScraper(metricsURL, 2*time.Second),
		Interval: time.Second, MetricsInterval: demoMetricsEvery,
		Deadline: demoDeadline, StallWindow: demoStallWindow, PinWindow: demoPinWindow,
		MaxRooms: 100000, Mode: mode, MaxPerMinute: 6, ConfirmTimeout: 30 * time.Second,
		OnEvent: n.event,
	}
	for _, u := range pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: 800 * time.Millisecond, AdminTimeout: 7 * time.Second}))
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		fmt.Fprintf(stdout, "watchdog: %v\n", err)
		return 1
	}
	listen := []string{d.listen}
	o.web = &web.FlagConfig{WebListenAddresses: &listen, WebSystemdSocket: new(bool), WebConfigFile: new(string)}
	o.telemetryPath = "/metrics"
	// The liveness limit of /-/healthy follows these.
	o.watch.interval, o.watch.adminTimeout = cfg.Interval, 7*time.Second
	srv, err := newServer(o, wd, nil, logger)
	if err != nil {
		fmt.Fprintf(stdout, "watchdog: %v\n", err)
		return 1
	}

	n.say("simulator: %d SGLang prefill rank(s), %s backend, %s /metrics at %s", d.ranks, d.backend, d.era, metricsURL)
	for i, u := range pluginURLs {
		n.say("simulator: plugin of rank %d at %s", i, u)
	}
	n.say("watchdog:  mode %s, deadline %s, stall window %s; its metrics at http://%s/metrics", mode, demoDeadline, demoStallWindow, srv.listeners[0].Addr())
	n.say("traffic:   ~3 requests/s with heavy-tailed KV transfers, some slow ones that keep progressing, and health checks")

	go injectPins(ctx, sim, d.ranks, n)
	code := serveAndWatch(ctx, srv, o.web, wd, nil, log.NewNopLogger())
	return demoSummary(sim, wd, n, code)
}

// injectPins reproduces the incident's three mechanisms, a few seconds apart.
func injectPins(ctx context.Context, sim *sglangsim.Sim, ranks int, n *narrator) {
	pins := []struct {
		at   time.Duration
		kind sglangsim.PinKind
		name string
	}{
		{3 * time.Second, sglangsim.PinResurrection, "max() resurrection: Failed overwritten by Transferring"},
		{6 * time.Second, sglangsim.PinAbortBeforeRegister, "ABORT popped transfer_infos before the room was registered: WaitingForInput for ever"},
		{9 * time.Second, sglangsim.PinStuckHandle, "NIXL transfer handle never completes: its transfer queue stays wedged until the server restarts"},
	}
	start := time.Now()
	for i, p := range pins {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Until(start.Add(p.at))):
		}
		rank := i % ranks
		rid, room := sim.Inject(rank, p.kind)
		n.say("INJECT       rank %d rid=%.12s room=%d: %s", rank, rid, room, p.name)
	}
}

func demoSummary(sim *sglangsim.Sim, wd *watchdog.Watchdog, n *narrator, code int) int {
	var pins, released, completed, falseFails int
	for _, r := range sim.Records() {
		if r.Kind.Pin() {
			pins++
			if r.Outcome == sglangsim.OutcomeFailedForced {
				released++
			}
		}
		if r.Outcome == sglangsim.OutcomeSuccess {
			completed++
		}
		if r.ProgressingWhenForced {
			falseFails++
		}
	}
	s := wd.Snapshot()
	n.say("summary:   %d of %d injected pins released; %d requests completed normally; %d force-fails of progressing requests; watchdog counted %d released",
		released, pins, completed, falseFails, s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}])
	if code != 0 {
		return code
	}
	if falseFails > 0 || (wd.Mode() == watchdog.ModeAuto && released < pins) {
		return 1
	}
	return 0
}
