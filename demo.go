package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/go-kit/log"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/internal/liveness"
	"github.com/sglang-watchdog/sglang-watchdog/internal/runconfig"
	"github.com/sglang-watchdog/sglang-watchdog/internal/server"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
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
	logs     string
}

func addDemoFlags(app *kingpin.Application, d *demoOptions) {
	cmd := app.Command("demo", "Run the SGLang simulator (prefill and decode servers) and two watchdogs (prefill pod, decode pod) together on loopback, inject the three pin mechanisms, and narrate detection and release on both sides.")
	cmd.Flag("demo.ranks", "Prefill DP ranks to simulate, one plugin listener each.").Default("2").IntVar(&d.ranks)
	cmd.Flag("demo.duration", "How long to run; 0 runs until interrupted.").Default("75s").DurationVar(&d.duration)
	cmd.Flag("demo.era", "SGLang /metrics label era: name, model_name, engine_type, v0.5 or newest.").Default(sglangsim.EraV05).EnumVar(&d.era,
		sglangsim.EraName, sglangsim.EraModelName, sglangsim.EraEngineType, sglangsim.EraV05, sglangsim.EraNewest)
	cmd.Flag("demo.backend", "KV transfer backend, which decides the lever: nixl (_send_failed) or mooncake (conclude_state).").Default(sglangsim.BackendNIXL).EnumVar(&d.backend,
		sglangsim.BackendNIXL, sglangsim.BackendMooncake)
	cmd.Flag("web.listen-address", "Address of the watchdog's metrics endpoint.").Default("127.0.0.1:0").StringVar(&d.listen)
	cmd.Flag("force-fail.mode", "off, dry-run or auto.").Default("auto").EnumVar(&d.mode, "off", "dry-run", "auto")
	cmd.Flag("demo.logs", "File the watchdogs' own log lines go to, so that the terminal shows the narration alone; - sends them to standard error, between the narrated lines. Default: a new file in the temporary directory, whose path the demo prints.").StringVar(&d.logs)
	cmd.Flag("demo.restart", "Let the watchdog escalate the transfer wedge to a restart of the simulated server (--restart.mode as --force-fail.mode, a 2m --restart.min-interval, a 10s boot); --no-demo.restart leaves the wedge to fail-fast alone, as the shipped default does.").Default("true").BoolVar(&d.restart)
}

// Windows of the demo: short, so that a pin is caught within half a
// minute. The restart interval and the boot time are short too, so that
// the whole escalation fits the demo (the shipped default interval is 30
// minutes; a real server boots in minutes). The decode deadline (shipped
// 180 s) sits between the prefill deadline and the point where prefill
// releases a pin (deadline + stall window), so that the decode side asks
// for a verdict both before and after prefill's release.
const (
	demoDeadline       = 20 * time.Second
	demoDecodeDeadline = 25 * time.Second
	demoStallWindow    = 10 * time.Second
	// demoLinkMargin (shipped 200): a stuck chunk is told from a slow one
	// only once it is held that many times what its size needs at the
	// slowest pace its link showed. With the demo's 0.3 s transfers and
	// their heavy tail, 200 would put the wedge's diagnosis minutes past
	// the end of the demo; its slow transfers stay well inside 20.
	demoLinkMargin   = 20
	demoPinWindow    = 30 * time.Second
	demoMetricsEvery = 5 * time.Second
	demoRestartEvery = 2 * time.Minute
	demoBootTime     = 10 * time.Second
	demoToken        = "demo-token"
	// demoAdminTimeout is the shipped --force-fail.timeout.
	demoAdminTimeout = 7 * time.Second
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
	sim       *sglangsim.Sim
	// pins are the injected pins' names by rid, pinRooms their rooms; the
	// decode side is narrated for them only (the rooms failed fast on
	// prefill are counted in the summary).
	pins     map[string]string
	pinRooms map[uint64]bool
	// verdicts is the last prefill verdict the decode-side watchdog got
	// for each room.
	verdicts map[uint64]pluginapi.RoomVerdict
}

func (n *narrator) pin(rid string) (string, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	name, ok := n.pins[rid]
	return name, ok
}

func (n *narrator) record(rid string) (sglangsim.Record, bool) {
	for _, r := range n.sim.Records() {
		if r.RID == rid {
			return r, true
		}
	}
	return sglangsim.Record{}, false
}

func (n *narrator) verdict(room uint64) (pluginapi.RoomVerdict, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	v, ok := n.verdicts[room]
	return v, ok
}

// narratedVerdicts is the decode-side watchdog's verdict source: the real
// HTTP client of --decode.prefill-watchdog-url, with each new answer for
// a pin's room narrated.
type narratedVerdicts struct {
	*pluginapi.VerdictClient
	n   *narrator
	url string
}

func (v narratedVerdicts) Verdict(ctx context.Context, q pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error) {
	room := q.Room
	ans, err := v.VerdictClient.Verdict(ctx, q)
	if err != nil {
		return ans, err
	}
	v.n.mu.Lock()
	last, seen := v.n.verdicts[room]
	v.n.verdicts[room] = ans
	pin := v.n.pinRooms[room]
	v.n.mu.Unlock()
	if pin && (!seen || last.Verdict != ans.Verdict) {
		v.n.say("VERDICT      room=%d: the prefill watchdog (%s/api/v1/rooms/%d) answers %q: %s", room, v.url, room, ans.Verdict, ans.Reason)
	}
	return ans, err
}

// decodeEvent narrates the decode-side watchdog's events on the pins'
// decode requests.
func (n *narrator) decodeEvent(e watchdog.Event) {
	name, ok := n.pin(e.RID)
	if !ok {
		return
	}
	who := fmt.Sprintf("decode dp%d rid=%.12s room=%d (%s)", e.DPRank, e.RID, e.Room, name)
	switch e.Kind {
	case watchdog.EventStuck:
		n.say("DECODE STUCK %s: %.0fs in decode's queues (%s), nothing moved", who, e.Age, e.Poll)
	case watchdog.EventSkipped:
		if e.Reason == watchdog.SkipTransferLive {
			v, _ := n.verdict(e.Room)
			n.say("HELD         %s: transfer may be live (prefill verdict %q): its pages stay, SGLang's own timeout (%s) or a \"stopped\" verdict ends it", who, v.Verdict, sglangsim.DefaultDecodeWaitingTimeout)
			return
		}
		n.say("DECODE NOT ACTED %s: %s", who, e.Reason)
	case watchdog.EventForceFail:
		why := "its transfer never started, nothing can write into its pages"
		if v, ok := n.verdict(e.Room); ok && v.Verdict == pluginapi.VerdictStopped {
			why = "prefill verdict stopped"
		}
		n.say("DECODE FORCE-FAIL %s: %s (%s)", who, e.Result, why)
	case watchdog.EventReleased:
		why := "transfer never started"
		if v, ok := n.verdict(e.Room); ok && v.Verdict == pluginapi.VerdictStopped {
			why = "prefill verdict stopped"
		}
		r, _ := n.record(e.RID)
		if r.DecodeHold() > 0 {
			n.say("DECODE RELEASE dp%d rid=%.12s room=%d: %s; slot freed %.0f s after admission (stock SGLang: %.0f s)", e.DPRank, e.RID, e.Room, why, r.DecodeHold().Seconds(), sglangsim.DefaultDecodeWaitingTimeout.Seconds())
			return
		}
		n.say("DECODE RELEASE dp%d rid=%.12s room=%d: %s; request failed %.0f s after admission, its pages freed on decode's next pass (no deferred release up to SGLang v0.5.18)", e.DPRank, e.RID, e.Room, why, e.Age)
	case watchdog.EventUnconfirmed:
		n.say("DECODE UNCONFIRMED %s: lever set but the release was not seen", who)
	}
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

// demoLogs opens where the watchdogs' log lines go: a file (named by
// --demo.logs, or a new one in the temporary directory) or, with "-",
// stderr. The narration is the demo's story; the raw log lines, about a
// third of the output when interleaved, bury it. close is nil for stderr.
func demoLogs(path string, stderr io.Writer) (w io.Writer, name string, close func() error, err error) {
	var f *os.File
	switch path {
	case "-":
		return stderr, "", nil, nil
	case "":
		f, err = os.CreateTemp("", "sglang-watchdog-demo-*.log")
	default:
		f, err = os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	}
	if err != nil {
		return nil, "", nil, fmt.Errorf("--demo.logs: %w", err)
	}
	return f, f.Name(), f.Close, nil
}

func runDemo(ctx context.Context, o *options, stdout, stderr io.Writer) int {
	d := o.demo
	if d.ranks < 1 {
		fmt.Fprintln(stdout, "--demo.ranks must be at least 1")
		return 2
	}
	logs, logName, closeLogs, err := demoLogs(d.logs, stderr)
	if err != nil {
		fmt.Fprintln(stdout, err)
		return 2
	}
	if closeLogs != nil {
		defer func() {
			// The demo printed where the log is: say when it may be cut short.
			if err := closeLogs(); err != nil {
				fmt.Fprintf(stderr, "closing the watchdogs' log %s: %v\n", logName, err)
			}
		}()
	}
	logger := logging.New(logs, o.log)
	if d.duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.duration)
		defer cancel()
	}
	sim, err := sglangsim.New(sglangsim.Options{
		Clock: clock.Real{}, DPSize: d.ranks, Era: d.era, Backend: d.backend, Seed: 1,
		// 0.5% slow transfers: a 30-150 s transfer holds every room behind
		// it on its (serial) transfer queue, so 3% would outrun the workers.
		ArrivalRate: 3, TransferMedian: 300 * time.Millisecond, SlowFraction: 0.005, SlowChunkEvery: 3 * time.Second,
		HealthCheckEvery: 10 * time.Second, HookRunsWhenEmpty: d.era == sglangsim.EraNewest,
		Token: demoToken, AllowRestart: true, BootTime: demoBootTime,
		// Prefill's bootstrap server on loopback: the decode-side watchdog
		// asks the watchdog at that host for its verdicts.
		BootstrapAddr: "127.0.0.1:8998",
	})
	if err != nil {
		fmt.Fprintf(stdout, "simulator: %v\n", err)
		return 1
	}
	n := &narrator{out: stdout, start: time.Now(), sim: sim, pins: map[string]string{}, pinRooms: map[uint64]bool{}, verdicts: map[uint64]pluginapi.RoomVerdict{}}
	sim.Start(ctx)
	metricsURL, pluginURLs, err := sim.Listen(ctx)
	if err != nil {
		fmt.Fprintf(stdout, "simulator: %v\n", err)
		return 1
	}
	decodeMetricsURL, decodeURLs, err := sim.ListenDecode(ctx)
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
		Deadline: demoDeadline, StallWindow: demoStallWindow, PinWindow: demoPinWindow, LinkMargin: demoLinkMargin,
		MaxRooms: 100000, Mode: mode, MaxPerMinute: 6, ConfirmTimeout: 30 * time.Second,
		FailFast: true, FailFastPerMinute: 180, RestartMode: restart, RestartMinInterval: demoRestartEvery,
		OnEvent: n.event,
	}
	for _, u := range pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: 800 * time.Millisecond, AdminTimeout: demoAdminTimeout, Token: demoToken}))
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		fmt.Fprintf(stdout, "watchdog: %v\n", err)
		return 1
	}
	listen := []string{d.listen}
	live := liveness.New(wd, cfg.Interval, demoAdminTimeout, time.Now)
	srv, err := server.New(server.Options{Watchdog: wd, Live: live, TelemetryPath: "/metrics", Logger: logger,
		Web: &web.FlagConfig{WebListenAddresses: &listen, WebSystemdSocket: new(bool), WebConfigFile: new(string)}})
	if err != nil {
		fmt.Fprintf(stdout, "watchdog: %v\n", err)
		return 1
	}
	served := make(chan int, 1)
	go func() { served <- serveAndWatch(ctx, srv, live, wd, nil, logger) }()
	addr := srv.Addr(ctx)
	if addr == nil {
		fmt.Fprintf(stdout, "watchdog: cannot serve on %s (see the log)\n", d.listen)
		return <-served
	}
	_, port, _ := net.SplitHostPort(addr.String())
	verdictURL := "http://{host}:" + port
	dwd, err := decodeWatchdog(cfg, decodeMetricsURL, decodeURLs, verdictURL, n, logger)
	if err != nil {
		fmt.Fprintf(stdout, "decode watchdog: %v\n", err)
		return 1
	}

	n.say("simulator: %d SGLang prefill rank(s), %s backend, %s /metrics at %s", d.ranks, d.backend, d.era, metricsURL)
	for i, u := range pluginURLs {
		n.say("simulator: plugin of rank %d at %s", i, u)
	}
	n.say("watchdog:  mode %s, deadline %s, stall window %s, link margin %d (shipped 200), fail-fast on; its metrics at http://%s/metrics", mode, demoDeadline, demoStallWindow, demoLinkMargin, addr)
	if d.restart {
		n.say("restart:   --restart.mode=%s, min interval %s (shipped default 30m); the simulated server boots in %s", restart, demoRestartEvery, demoBootTime)
	} else {
		n.say("restart:   off (--no-demo.restart): the wedge stays, fail-fast keeps failing the rooms queued behind it")
	}
	n.say("decode:    %d SGLang decode rank(s), /metrics at %s, waiting timeout %s (no deferred release, as SGLang up to v0.5.18); a second watchdog for the decode pod: decode deadline %s (shipped 180s), prefill verdicts from %s",
		len(decodeURLs), decodeMetricsURL, sglangsim.DefaultDecodeWaitingTimeout, demoDecodeDeadline, verdictURL)
	n.say("traffic:   ~3 requests/s with heavy-tailed KV transfers, some slow ones (which list no progress, as every room in SGLang), and health checks")
	if logName != "" {
		n.say("logs:      the watchdogs' own log lines go to %s", logName)
	}

	go injectPins(ctx, sim, d.ranks, n)
	go watchBoot(ctx, sim, n)
	go watchDecodeFrees(ctx, n)
	decodeDone := make(chan struct{})
	go func() {
		defer close(decodeDone)
		dwd.Run(ctx)
	}()
	code := <-served
	<-decodeDone
	return demoSummary(sim, wd, dwd, n, code)
}

// decodeWatchdog is the decode pod's watchdog: the prefill one's windows
// and rails, the demo's decode deadline, the decode ranks and the decode
// server's /metrics, and the prefill watchdog's verdicts over HTTP
// (--decode.prefill-watchdog-url=verdictURL).
func decodeWatchdog(prefill watchdog.Config, metricsURL string, pluginURLs []string, verdictURL string, n *narrator, logger log.Logger) (*watchdog.Watchdog, error) {
	client, err := runconfig.VerdictClient(runconfig.Decode{PrefillURL: verdictURL, PrefillNetworks: []string{"127.0.0.0/8", "::1/128"}, PrefillTimeout: 500 * time.Millisecond})
	if err != nil {
		return nil, err
	}
	cfg := prefill
	cfg.Logger = log.With(logger, "watchdog", "decode")
	cfg.Metrics = collector.NewMetricsScraper(metricsURL, 2*time.Second)
	cfg.DecodeDeadline = demoDecodeDeadline
	cfg.Verdicts = narratedVerdicts{VerdictClient: client, n: n, url: strings.ReplaceAll(verdictURL, "{host}", "127.0.0.1")}
	cfg.FailFast, cfg.RestartMode = false, watchdog.ModeOff
	cfg.OnEvent = n.decodeEvent
	cfg.Plugins = nil
	for _, u := range pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: 800 * time.Millisecond, AdminTimeout: demoAdminTimeout, Token: demoToken}))
	}
	return watchdog.New(cfg)
}

// injectPins reproduces the incident's three mechanisms, a few seconds
// apart. The stuck handle comes last, so that the decode side has released
// the other two pins' decode requests before the restart it leads to.
func injectPins(ctx context.Context, sim *sglangsim.Sim, ranks int, n *narrator) {
	pins := []struct {
		at    time.Duration
		kind  sglangsim.PinKind
		short string
		name  string
	}{
		{3 * time.Second, sglangsim.PinResurrection, "resurrection", "max() resurrection: Failed overwritten by Transferring"},
		{6 * time.Second, sglangsim.PinAbortBeforeRegister, "abort-before-register", "ABORT popped transfer_infos before the room was registered: WaitingForInput for ever"},
		{12 * time.Second, sglangsim.PinStuckHandle, "stuck handle", "NIXL transfer handle never completes: its transfer queue stays wedged until the server restarts"},
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
		n.mu.Lock()
		n.pins[rid] = p.short
		n.pinRooms[room] = true
		n.mu.Unlock()
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

// watchDecodeFrees narrates the pins' decode slots freed by SGLang itself
// (its heartbeat after a prefill restart, its waiting timeout), and the
// late release of the pages the decode-side watchdog's lever left to the
// deferred release.
func watchDecodeFrees(ctx context.Context, n *narrator) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	told := map[string]bool{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, r := range n.sim.Records() {
			name, pin := n.pin(r.RID)
			if !pin || told[r.RID] || r.DecodeReleased.IsZero() {
				continue
			}
			told[r.RID] = true
			switch r.DecodeEnd {
			case sglangsim.DecodeHeartbeat:
				n.say("DECODE FREED dp%d rid=%.12s room=%d (%s): the prefill restart ended its transfer, decode's heartbeat failed it; slot freed %.0f s after admission (a dead prefill writes no more)", r.DecodeRank, r.RID, r.Room, name, r.DecodeHold().Seconds())
			case sglangsim.DecodeTimeout:
				n.say("DECODE FREED dp%d rid=%.12s room=%d (%s): SGLang's own waiting timeout; slot freed %.0f s after admission", r.DecodeRank, r.RID, r.Room, name, r.DecodeHold().Seconds())
			case sglangsim.DecodeForceFail:
				if r.DecodeReleased.Sub(r.DecodeForcedAt) > 2*time.Second {
					n.say("DECODE FREED dp%d rid=%.12s room=%d (%s): its pages, after the deferred release; slot freed %.0f s after admission", r.DecodeRank, r.RID, r.Room, name, r.DecodeHold().Seconds())
				}
			}
		}
	}
}

// demoSummary tells what became of the pins and of the rooms queued behind
// the wedge. A pin counts as released when a lever released it, or when
// the watchdog's restart ended it; a room behind the wedge when it was
// failed (fast, or after its deadline) or lost in the watchdog's restart,
// and as hung when it had waited more than demoHungAfter at the end.
func demoSummary(sim *sglangsim.Sim, wd, dwd *watchdog.Watchdog, n *narrator, code int) int {
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
	unsafe := decodeSummary(sim, dwd, n, now)
	if code != 0 {
		return code
	}
	if falseFails > 0 || unsafe > 0 || (wd.Mode() == watchdog.ModeAuto && (released < pins || hung > 0)) {
		return 1
	}
	return 0
}

// decodeSummary tells what became of the pins' decode requests and of the
// other decode requests the decode-side watchdog released, and returns
// the number of decode pages a force-fail freed under a live transfer or
// late writes that landed because of one (which must be 0).
func decodeSummary(sim *sglangsim.Sim, dwd *watchdog.Watchdog, n *narrator, now time.Time) int {
	var others, unsafe int
	for _, r := range sim.Records() {
		if r.UnsafeFree == sglangsim.DecodeForceFail {
			unsafe++
		}
		name, pin := n.pin(r.RID)
		if !pin {
			if r.DecodeEnd == sglangsim.DecodeForceFail {
				others++
			}
			continue
		}
		switch {
		case r.DecodeAdmitted.IsZero():
			n.say("summary:   decode, %s pin rid=%.12s: never reached decode", name, r.RID)
		case r.DecodeEnd == "":
			n.say("summary:   decode, %s pin rid=%.12s: still held after %.0f s at the end of the demo; SGLang's own timeout frees it %s after admission, later than the demo runs",
				name, r.RID, now.Sub(r.DecodeAdmitted).Seconds(), sglangsim.DefaultDecodeWaitingTimeout)
		default:
			how := map[sglangsim.DecodeEnd]string{
				sglangsim.DecodeForceFail: "the decode-side watchdog released it",
				sglangsim.DecodeHeartbeat: "the prefill restart ended its transfer and decode's heartbeat failed it (a dead prefill writes no more; without the restart it stays held for SGLang's own timeout)",
				sglangsim.DecodeTimeout:   "SGLang's own waiting timeout",
				sglangsim.DecodeSuccess:   "it completed",
				sglangsim.DecodeRestarted: "the decode server restarted",
			}[r.DecodeEnd]
			n.say("summary:   decode, %s pin rid=%.12s: slot freed %.0f s after admission (stock SGLang: %.0f s): %s", name, r.RID, r.DecodeHold().Seconds(), sglangsim.DefaultDecodeWaitingTimeout.Seconds(), how)
		}
	}
	byCause := map[sglangsim.DecodeEnd]int{}
	for _, c := range sim.Corruptions() {
		byCause[c.Cause]++
	}
	s := dwd.Snapshot()
	n.say("summary:   decode, other requests released early by the decode-side watchdog: %d; held as \"transfer may be live\": %d; prefill verdict lookups %s; pages freed under a live transfer by a force-fail: %d; page corruptions caused by a force-fail: %d, by SGLang's own timeout: %d",
		others, s.RoleSkips[[2]string{watchdog.SkipTransferLive, watchdog.RoleDecode}], lookupString(s.VerdictLookups), unsafe, byCause[sglangsim.DecodeForceFail], byCause[sglangsim.DecodeTimeout])
	return unsafe + byCause[sglangsim.DecodeForceFail]
}

func lookupString(m map[string]uint64) string {
	var parts []string
	for _, v := range watchdog.VerdictAnswers {
		if m[v] > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", v, m[v]))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}
