// Command quality measures how well stuck requests are detected and
// released, and what a transfer wedge costs, on a trace replayed from a
// seed on the fake clock:
//
//	go run ./bench/quality -seed 1
//
// The trace (see -h for its knobs): DP8 prefill ranks (sglangsim, newest
// label era, NIXL, transfer queues keyed by destination decode ports), 25k
// healthy requests over an hour with lognormal (heavy-tailed) KV transfer
// times, 0.5% slow-but-progressing transfers, SGLang health checks every
// 10 s plus one stuck health check per rank, and 0.4% pins (100) spread
// evenly in time over the pin mechanisms of the era replayed (-era): on
// SGLang's releases (v0.4.6 to v0.5.18 and upstream main) only a stuck
// transfer handle (PinStuckHandle) pins a request in the inflight queue;
// -era forks adds the two mechanisms read in SGLang code outside them
// (PinResurrection, PinAbortBeforeRegister), which those releases conclude
// on their own (docs/plugin.md, "Seed mechanisms"). A stuck
// handle wedges its transfer queue until the server restarts: every later
// room bound for that queue waits behind it (SGLang v0.5.18:
// NixlKVManager.transfer_worker in disaggregation/nixl/conn.py).
//
// It replays the trace (Step-driven simulator, no goroutines of its own)
// under several configurations of the real watchdog (watchdog.New,
// RunCycle every 1 s and ScrapeMetrics every 15 s, mode auto, default
// windows, reading the plugin listings through bench/simplugin and
// /metrics through collector.ParseMetrics) and without it (stock SGLang):
//
//   - defaults: as shipped (fail-fast on, 180 a minute; restart off), and
//     on the decode server (-decode-ranks ranks) the decode pod's own
//     watchdog: a second watchdog.New over the decode ranks and the decode
//     /metrics, default decode deadline (180 s) and rails, asking the
//     prefill watchdog for verdicts through pluginapi.VerdictClient and the
//     prefill watchdog's VerdictHandler (in memory, no sockets), as
//     --decode.prefill-watchdog-url does;
//   - decode-off: the same without the decode-side watchdog;
//   - decode-6: the decode-side watchdog with --decode.max-per-minute=6,
//     the budget decode releases shared with prefill's deadline path before;
//   - ff-off: --force-fail.fail-fast=false;
//   - restart-30m: fail-fast and --restart.mode=auto with the default
//     --restart.min-interval (30 min);
//   - restart-5m: the same with a 5 min interval;
//   - stock: no watchdog.
//
// The decode side is reported from the simulator's ground truth: decode
// slot hold time (Record.DecodeHold), how decode let go (force-fail, its
// own waiting timeout, its heartbeat after a prefill restart), the decode
// requests held as "transfer may be live" (skip transfer_live), pages freed
// under a live transfer (Record.UnsafeFree) and late writes that landed
// (Sim.Corruptions), by what freed the pages.
//
// A restart restarts the whole simulated server: the requests inside are
// lost, and for its boot time (30 s) the listings and /metrics fail and
// arriving requests are refused by the simulator (counted apart from the
// requests it admitted).
//
// For the defaults and stock runs, the raw-metrics alert group
// alerts/sglang-raw.rules.yml is evaluated by a real Prometheus: /metrics
// sampled every 15 s, backfilled with `promtool tsdb create-blocks-from
// openmetrics`, every alert expression queried with /api/v1/query_range
// at a 15 s step, `for:` applied as Prometheus does. -sweep adds
// --watchdog.deadline {10,20,30,60}s x --watchdog.stall-window {5,10,30}s
// on the defaults configuration. Everything printed is reproducible from
// -seed; only the Prometheus time shift depends on the wall clock. Every
// replay reads the round-4 listing (transfer workers, chunks queued) and
// counts the rooms standing wedge orders failed.
//
// -family slowlink replays issue 17's false-positive matrix instead (see
// slowlink.go), one trace per class on the fake clock:
//
//	go run ./bench/quality -family slowlink -seed 1
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// epoch is where the simulated clock starts; fixed so that a seed replays
// the same trace. Prometheus sees the samples shifted to end just before
// the wall-clock now.
var epoch = time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC)

type options struct {
	seed         int64
	ranks        int
	healthy      int
	pinPct       float64
	slowPct      float64
	duration     time.Duration
	median       time.Duration
	linkMargin   float64
	step         time.Duration
	stockTimeout time.Duration
	stockStep    time.Duration
	sweep        bool
	prom         bool
	stock        bool
	configs      string
	prometheus   string
	promtool     string
	rules        string
	keep         bool
	parallel     int
	deadline     time.Duration
	stall        time.Duration
	hcEvery      time.Duration
	bootTime     time.Duration
	decodeRanks  int
	mechanisms   string
	era          string
	memprofile   string
	cpuprofile   string
	family       string
	classes      string
	attnTP       int
	tpView       string
	pinTPRanks   string
	links        string
}

func main() {
	var o options
	flag.Int64Var(&o.seed, "seed", 1, "seed of the trace and the simulator")
	flag.IntVar(&o.ranks, "ranks", 8, "DP ranks")
	flag.IntVar(&o.healthy, "healthy", 25000, "healthy requests")
	flag.Float64Var(&o.pinPct, "pins", 0.4, "pinned requests, in percent of -healthy, spread over the pin mechanisms")
	flag.Float64Var(&o.slowPct, "slow", 0.5, "slow-but-progressing requests (30-150 s), in percent of -healthy")
	flag.DurationVar(&o.duration, "duration", time.Hour, "simulated length of the trace")
	flag.DurationVar(&o.median, "median", time.Second, "median healthy KV transfer time (lognormal, sigma 1, capped at 100 medians)")
	flag.DurationVar(&o.step, "step", 100*time.Millisecond, "simulated time between scheduler passes")
	flag.DurationVar(&o.stockStep, "stock-step", time.Second, "simulated time between scheduler passes in the stock replay, where thousands of requests pile up behind wedged queues")
	flag.DurationVar(&o.stockTimeout, "decode-timeout", sglangsim.DefaultDecodeWaitingTimeout, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT of decode")
	flag.StringVar(&o.era, "era", eraReleases, "the SGLang code the pins model: releases (v0.4.6 to v0.5.18 and upstream main, where only a stuck handle pins: stuck-handle) or forks (code outside them, which also pins by resurrection and abort-before-register)")
	flag.StringVar(&o.mechanisms, "mechanisms", "", "pin mechanisms to mix evenly (resurrection and abort-before-register need -era forks; stuck-handle); empty: every mechanism of -era; without stuck-handle no transfer queue wedges")
	flag.IntVar(&o.decodeRanks, "decode-ranks", 2, "decode ranks (scheduler processes of the decode server); the decode endpoints are spread over them")
	flag.DurationVar(&o.bootTime, "boot-time", sglangsim.DefaultBootTime, "how long a restarted server boots (listings, /metrics and arrivals refused)")
	flag.BoolVar(&o.sweep, "sweep", false, "also sweep deadline x stall window on the defaults configuration (12 more replays)")
	flag.BoolVar(&o.stock, "stock", true, "replay stock SGLang (no watchdog) too")
	flag.StringVar(&o.configs, "configs", "defaults,decode-off,decode-6,ff-off,restart-30m,restart-5m", "watchdog configurations to replay (defaults, decode-off, decode-6, ff-off, restart-30m, restart-5m)")
	flag.BoolVar(&o.prom, "prom", true, "evaluate alerts/sglang-raw.rules.yml with real Prometheus on the defaults and stock runs")
	flag.StringVar(&o.prometheus, "prometheus", "/usr/bin/prometheus", "Prometheus binary")
	flag.StringVar(&o.promtool, "promtool", "/usr/bin/promtool", "promtool binary")
	flag.StringVar(&o.rules, "rules", "alerts/sglang-raw.rules.yml", "raw-metrics rule file")
	flag.BoolVar(&o.keep, "keep", false, "keep the temp dir (OpenMetrics files, TSDB, Prometheus log)")
	flag.IntVar(&o.parallel, "parallel", runtime.NumCPU(), "replays run at once")
	flag.DurationVar(&o.deadline, "deadline", 60*time.Second, "--watchdog.deadline of the main runs")
	flag.Float64Var(&o.linkMargin, "link-margin", 0, "--watchdog.link-margin of the main runs (0: the watchdog's default)")
	flag.DurationVar(&o.stall, "stall", 30*time.Second, "--watchdog.stall-window of the main runs")
	flag.DurationVar(&o.hcEvery, "health-checks", 10*time.Second, "SGLang health checks every (round robin over the ranks); 0: none")
	flag.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the harness")
	flag.StringVar(&o.memprofile, "memprofile", "", "write a heap profile of the harness at the end")
	flag.StringVar(&o.family, "family", "default", "trace family: default (the trace above), or slowlink (issue 17's slow-link and wedge matrix, one trace per class; its own defaults: -duration 30m, -healthy 12500, -configs defaults,restart-5m)")
	flag.StringVar(&o.classes, "classes", "", "slowlink: the classes to replay, comma-separated (default all but tp-nonleader-wedge: long-prompt, huge-chunk, link-10pct-one, link-1pct-one, link-10pct-all, link-1pct-all, burst, abort-behind-slow, error-settle, error-late, hung-handle, mixed-slowlink-hung, shared-queue-speeds, link-drop-recover, new-destination, and with -era forks silent-pin; tp-nonleader-wedge replays with -attn-tp 2 at least)")
	flag.IntVar(&o.attnTP, "attn-tp", 1, "attention-TP group size of every prefill rank: each rank of the group runs its own transfer workers into its decode peer's pages (sglangsim Options.AttnTP)")
	flag.StringVar(&o.tpView, "tp-view", "round5", "with an attention-TP group (-attn-tp > 1, or the slowlink class tp-nonleader-wedge), what the prefill plugin lists: round5 (every rank's chunks merged), stale-peer (one non-leader rank not read: fails closed), leader-only (the leader alone, as the only writer: the view the watchdog trusted through round 4)")
	flag.StringVar(&o.links, "links", "uniform", "default family: uniform (every decode destination at full speed) or hetero (issue 23's heterogeneous fleet: four more destinations, at 1% and 10%, one at 10% for 10 min, one new at mid-run, each with its own traffic; the stuck-handle pins spread over every destination)")
	flag.StringVar(&o.pinTPRanks, "pin-tp-ranks", "", "default family: the attention-TP ranks the pins hold on, comma-separated (0 is the leader; \"1\": non-leader wedges); empty: every rank")
	flag.Parse()
	if o.attnTP < 1 {
		fmt.Fprintln(os.Stderr, "-attn-tp: at least 1")
		os.Exit(2)
	}
	switch o.tpView {
	case "round5", "leader-only", "stale-peer":
	default:
		fmt.Fprintf(os.Stderr, "-tp-view: unknown view %q (want round5, stale-peer or leader-only)\n", o.tpView)
		os.Exit(2)
	}
	if err := checkMechanisms(&o); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if _, err := tpRanks(o.pinTPRanks, o.attnTP); err != nil {
		fmt.Fprintln(os.Stderr, "-pin-tp-ranks:", err)
		os.Exit(2)
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if o.family == "slowlink" {
		if !set["duration"] {
			o.duration = 30 * time.Minute
		}
		if !set["healthy"] {
			o.healthy = 12500 // the default trace's 25,000 an hour
		}
		if !set["configs"] {
			o.configs = "defaults,restart-5m"
		}
		if !set["median"] {
			// An RDMA-class link: a 2,048-token prompt's KV (about 256 MiB at
			// 128 KiB a token) in 100 ms; -median 1s replays a slow one.
			o.median = 100 * time.Millisecond
		}
	} else if o.links != "uniform" && o.links != "hetero" {
		fmt.Fprintf(os.Stderr, "-links: unknown fleet %q (want uniform or hetero)\n", o.links)
		os.Exit(2)
	} else if o.family != "default" {
		fmt.Fprintf(os.Stderr, "-family: unknown family %q (want default or slowlink)\n", o.family)
		os.Exit(2)
	}
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err == nil {
			_ = pprof.StartCPUProfile(f)
			defer pprof.StopCPUProfile()
		}
	}
	var code int
	if o.family == "slowlink" {
		code = runSlowlink(o, strings.Split(o.configs, ","))
	} else {
		code = run(o)
	}
	if o.memprofile != "" {
		if f, err := os.Create(o.memprofile); err == nil {
			_ = pprof.WriteHeapProfile(f)
			f.Close()
		}
	}
	if o.cpuprofile != "" {
		pprof.StopCPUProfile()
	}
	os.Exit(code)
}
