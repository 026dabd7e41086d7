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
	restart  bool
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
	cmd.Flag("demo.restart", "Let the watchdog escalate the transfer wedge to a restart of the simulated server (--restart.mode as --force-fail.mode, a 2m --restart.min-interval, a 10s boot); --no-demo.restart leaves the wedge to fail-fast alone, as the shipped default does.").Default("true").BoolVar(&d.restart)
}

// Windows of the demo: short, so that a pin is caught within half a
// minute. The restart interval and the boot time are short too, so that
// the whole escalation fits the demo (the shipped default interval is 30
// minutes; a real server boots in minutes).
const (
	demoDeadline     = 20 * time.Second
	demoStallWindow  = 10 * time.Second
	demoPinWindow    = 30 * time.Second
	demoMetricsEvery = 5 * time.Second
	demoRestartEvery = 2 * time.Minute
	demoBootTime     = 10 * time.Second
	demoToken        = "demo-token"
	// demoHungAfter: a room queued behind the wedge this long before the
	// end and still there counts as hung (younger ones may be failed on
	// the next cycle).
	demoHungAfter = 3 * time.Second
)

// narrator prints one line per event, with the time since the demo began.
type narrator struct {
	mu        sync.Mutex
	out       io.Writer
	start     time.Time
	restarted bool // a restart escalation ended the server
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
		if e.Trigger == watchdog.TriggerFailFast {
			n.say("FAIL-FAST    %s: %s, queued %.0fs behind the wedged transfer queue: prefill fails it now, so its client can retry elsewhere", who, e.Result, e.Age)
			return
		}
		n.say("FORCE-FAIL   %s: %s (trigger %s)", who, e.Result, e.Trigger)
	case watchdog.EventSkipped:
		n.say("NOT ACTED    %s: %s", who, e.Reason)
	case watchdog.EventReleased:
		n.say("RELEASED     %s: left the inflight queue, sglang:num_transfer_failed_reqs_total rose", who)
	case watchdog.EventUnconfirmed:
		n.mu.Lock()
		restarted := n.restarted
		n.mu.Unlock()
		if restarted {
			n.say("UNCONFIRMED  %s: lever set, but the restart reset sglang:num_transfer_failed_reqs_total before the release could be counted", who)
			return
		}
		n.say("UNCONFIRMED  %s: lever set but the release was not seen", who)
	case watchdog.EventPinned:
		n.say("PINNED GAUGE %s dp%s/pp%s/tp%s: non-zero and unchanged for %s with no progress", e.Gauge.Queue, e.Gauge.DP, e.Gauge.PP, e.Gauge.TP, demoPinWindow)
	case watchdog.EventWedged:
		n.say("WEDGED       dp%d/pp%d: scheduler loop stopped with requests queued", e.DPRank, e.PPRank)
	case watchdog.EventTransferWedged:
		evidence := "a stuck room with its transfer in flight"
		switch e.Reason {
		case "orphaned_transfer":
			evidence = "an orphaned transfer that never settles, rooms waiting behind it"
		case "suspected":
			evidence = "two or more stuck rooms in Transferring (suspected: the plugin reports no transfer_in_flight)"
		}
		n.say("WEDGE DIAGNOSED dp%d/pp%d transfer queue %d (rule %s, room=%d): %s; only a restart clears it", e.DPRank, e.PPRank, e.Queue, e.Reason, e.Room, evidence)
	case watchdog.EventRestart:
		if e.Result == watchdog.RestartRestarted {
			n.mu.Lock()
			n.restarted = true
			n.mu.Unlock()
		}
		n.say("RESTART      dp%d/pp%d: %s (transfer queue %d wedged, rule %s); every request inside is lost", e.DPRank, e.PPRank, e.Result, e.Queue, e.Reason)
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
		Token: demoToken, AllowRestart: true, BootTime: demoBootTime,
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
	// The restart escalation follows the force-fail mode: a dry-run demo
	// restarts nothing either.
	restart := watchdog.ModeOff
	if d.restart {
		restart = mode
	}
	cfg := watchdog.Config{
		Clock: clock.Real{}, Logger: logger,
		Metrics:  collector.NewMetricsScraper(metricsURL, 2*time.Second),
		Interval: time.Second, MetricsInterval: demoMetricsEvery,
		Deadline: demoDeadline, StallWindow: demoStallWindow, PinWindow: demoPinWindow,
		MaxRooms: 100000, Mode: mode, MaxPerMinute: 6, ConfirmTimeout: 30 * time.Second,
		FailFast: true, FailFastPerMinute: 180, RestartMode: restart, RestartMinInterval: demoRestartEvery,
		OnEvent: n.event,
	}
	for _, u := range pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: 800 * time.Millisecond, AdminTimeout: 7 * time.Second, Token: demoToken}))
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
	n.say("watchdog:  mode %s, deadline %s, stall window %s, fail-fast on; its metrics at http://%s/metrics", mode, demoDeadline, demoStallWindow, srv.listeners[0].Addr())
	if d.restart {
		n.say("restart:   --restart.mode=%s, min interval %s (shipped default 30m); the simulated server boots in %s", restart, demoRestartEvery, demoBootTime)
	} else {
		n.say("restart:   off (--no-demo.restart): the wedge stays, fail-fast keeps failing the rooms queued behind it")
	}
	n.say("traffic:   ~3 requests/s with heavy-tailed KV transfers, some slow ones that keep progressing, and health checks")

	go injectPins(ctx, sim, d.ranks, n)
	go watchBoot(ctx, sim, n)
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

// watchBoot narrates the simulated server going down for a restart and
// coming back with new pids.
func watchBoot(ctx context.Context, sim *sglangsim.Sim, n *narrator) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	booting := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		switch b := sim.Booting(); {
		case b && !booting:
			n.say("BOOTING      the server restarts: every request inside is lost, plugin listings and /metrics refuse connections (source_down) for %s", demoBootTime)
		case !b && booting:
			l := sim.Listing(0)
			n.say("BACK         the server serves again: rank 0 pid %d, empty queues, no wedged transfer worker", l.Server.PID)
		}
		booting = sim.Booting()
	}
}

// demoSummary tells what became of the pins and of the rooms queued behind
// the wedge. A pin counts as released when a lever released it, or when
// the watchdog's restart ended it; a room behind the wedge when it was
// failed (fast, or after its deadline) or lost in the watchdog's restart,
// and as hung when it had waited more than demoHungAfter at the end.
func demoSummary(sim *sglangsim.Sim, wd *watchdog.Watchdog, n *narrator, code int) int {
	s := wd.Snapshot()
	restarted := s.Restarts[watchdog.RestartRestarted] > 0
	now := time.Now()
	var pins, released, completed, falseFails, behind, failed, lost, hung int
	for _, r := range sim.Records() {
		switch {
		case r.Kind.Pin():
			pins++
			if r.Outcome == sglangsim.OutcomeFailedForced || (restarted && r.Outcome == sglangsim.OutcomeRestarted) {
				released++
			}
		case r.Kind == sglangsim.KindBlockedByWedge:
			behind++
			switch r.Outcome {
			case sglangsim.OutcomeFailedForced:
				failed++
			case sglangsim.OutcomeRestarted:
				lost++
			case sglangsim.OutcomeInflight:
				if now.Sub(r.EnteredInflight) > demoHungAfter {
					hung++
				}
			}
		}
		if r.Outcome == sglangsim.OutcomeSuccess {
			completed++
		}
		if r.ProgressingWhenForced {
			falseFails++
		}
	}
	n.say("summary:   %d of %d injected pins released (by a lever, or ended by the watchdog's restart); %d rooms queued behind the wedge: %d failed (fail-fast or deadline), %d lost in the restart, %d still hung (over %s); %d requests completed normally; %d force-fails of progressing requests; watchdog counted %d released (auto), %d released (fail_fast), %d restart(s)",
		released, pins, behind, failed, lost, hung, demoHungAfter, completed, falseFails,
		s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}], s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerFailFast}], s.Restarts[watchdog.RestartRestarted])
	if code != 0 {
		return code
	}
	if falseFails > 0 || (wd.Mode() == watchdog.ModeAuto && (released < pins || hung > 0)) {
		return 1
	}
	return 0
}
