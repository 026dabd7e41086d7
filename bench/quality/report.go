package main

import (
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// The report: every configuration replayed, analysed and printed.

// inParallel runs f(0) to f(n-1), at most `parallel` at once, and waits.
func inParallel(n, parallel int, f func(i int)) {
	sem := make(chan struct{}, max(parallel, 1))
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			f(i)
		}()
	}
	wg.Wait()
}

func run(o options) int {
	t0 := time.Now()
	tr := makeTrace(o)
	fmt.Printf("# Detection quality, seed %d\n\n", o.seed)
	fmt.Printf("trace: DP%d, %s simulated, %d healthy requests (lognormal transfers, median %s), %d slow-but-progressing (30-150 s, a chunk every 2.5-5 s), %d pins (%.2g%% of healthy, %s evenly, era %s), %d stuck health checks, health checks every %s (0: none); NIXL, transfer queues keyed by decode ports (sglangsim defaults), boot time %s; a scheduler pass every %s (stock: %s)\n",
		o.ranks, o.duration, o.healthy, o.median, int(math.Round(float64(o.healthy)*o.slowPct/100)), tr.pins, o.pinPct, o.mechanisms, o.era, o.ranks, o.hcEvery, o.bootTime, o.step, o.stockStep)
	if tr.attnTP > 1 {
		on := "every rank"
		if o.pinTPRanks != "" {
			on = "TP ranks " + o.pinTPRanks
		}
		fmt.Printf("attention TP %d on every prefill rank (each TP rank its own transfer workers), pins held on %s; plugin view %s\n", tr.attnTP, on, o.tpView)
	}

	all := configs(o)
	type job struct {
		name string
		cfg  replayConfig
	}
	var jobs []job
	for _, n := range strings.Split(o.configs, ",") {
		n = strings.TrimSpace(n)
		if n == "" {
			continue
		}
		c, ok := all[n]
		if !ok {
			fmt.Fprintf(os.Stderr, "-configs: unknown configuration %q (want defaults, decode-off, decode-6, ff-off, restart-30m, restart-5m)\n", n)
			return 2
		}
		c.collectSeries = o.prom && n == "defaults"
		jobs = append(jobs, job{n, c})
	}
	if o.stock {
		jobs = append(jobs, job{"stock", replayConfig{name: "stock", step: o.stockStep, deadline: o.deadline, stall: o.stall, collectSeries: o.prom}})
	}
	nMain := len(jobs)
	if o.sweep {
		base := all["defaults"]
		for _, d := range []time.Duration{10, 20, 30, 60} {
			for _, s := range []time.Duration{5, 10, 30} {
				c := base
				c.deadline, c.stall = d*time.Second, s*time.Second
				if c.deadline == base.deadline && c.stall == base.stall && strings.Contains(","+o.configs+",", ",defaults,") {
					continue // the defaults run
				}
				c.name = fmt.Sprintf("sweep-%s-%s", c.deadline, c.stall)
				jobs = append(jobs, job{c.name, c})
			}
		}
	}
	results := make([]*replayResult, len(jobs))
	errs := make([]error, len(jobs))
	inParallel(len(jobs), o.parallel, func(i int) {
		results[i], errs[i] = replay(tr, jobs[i].cfg)
		if errs[i] == nil {
			fmt.Fprintf(os.Stderr, "replay %s done in %s\n", jobs[i].name, results[i].wall.Round(100*time.Millisecond))
		}
	})
	for i, err := range errs {
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", jobs[i].name, err)
			return 1
		}
	}
	mains := results[:nMain]
	as := make([]*analysis, len(mains))
	for i, r := range mains {
		as[i] = analyse(r)
	}
	fmt.Printf("replays: %d; wall time each: ", len(jobs))
	for i, r := range mains {
		fmt.Printf("%s %s; ", jobs[i].name, r.wall.Round(100*time.Millisecond))
	}
	fmt.Printf("all %s\n\n", time.Since(t0).Round(100*time.Millisecond))

	ref := as[0]
	p50, p999 := quantile(ref.healthyInflight, 0.5), quantile(ref.healthyInflight, 0.999)
	fmt.Printf("healthy transfer times in the %s run (time in the inflight queue, %d completed): p50 %s, p99 %s, p99.9 %s (%.1fx the median), max %s; slow transfers completed %d, max %s\n\n",
		jobs[0].name, len(ref.healthyInflight), secs(p50), secs(quantile(ref.healthyInflight, 0.99)), secs(p999), float64(p999)/float64(max(p50, 1)), secs(maxDur(ref.healthyInflight)),
		len(ref.slowInflight), secs(maxDur(ref.slowInflight)))

	// The comparison, one column per configuration.
	fmt.Printf("## Side by side (deadline %s, stall window %s, interval 1 s, /metrics every 15 s, max 6 force-fails a minute, fail-fast 180 a minute)\n\n", o.deadline, o.stall)
	hdr := "| |"
	sep := "|---|"
	for i := range mains {
		hdr += " " + jobs[i].name + " |"
		sep += "---|"
	}
	fmt.Println(hdr)
	fmt.Println(sep)
	row := func(label string, f func(r *replayResult, a *analysis) string) {
		line := "| " + label + " |"
		for i, r := range mains {
			line += " " + f(r, as[i]) + " |"
		}
		fmt.Println(line)
	}
	pinSum := func(a *analysis, g func(f *fate) int) int {
		n := 0
		for _, k := range pinKinds {
			n += g(a.byKind[k])
		}
		return n
	}
	refusedPins := func(r *replayResult) int {
		n := 0
		for _, k := range pinKinds {
			n += r.refused[k]
		}
		return n
	}
	row("pins submitted (refused while booting)", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("%d (%d)", pinSum(a, func(f *fate) int { return f.n }), refusedPins(r))
	})
	row("pins released by a lever: deadline path + fail-fast", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("%d + %d", pinSum(a, func(f *fate) int { return f.auto }), pinSum(a, func(f *fate) int { return f.failFast }))
	})
	row("pins ended by a restart", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(pinSum(a, func(f *fate) int { return f.restarted }))
	})
	row("pins still held at the end", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(pinSum(a, func(f *fate) int { return f.held }))
	})
	row("pin release latency (lever), median / p99 / max", func(r *replayResult, a *analysis) string {
		var all []time.Duration
		for _, k := range pinKinds {
			all = append(all, a.byKind[k].lat...)
		}
		return dist(all)
	})
	row("false force-fails (healthy, slow, health check, or progressing)", func(r *replayResult, a *analysis) string { return fmt.Sprint(len(a.falseFF)) })
	row("failed by a wedge order (of which would have completed)", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("%d (%d)", a.wedgeOrdered, a.wedgeOrderedFalse)
	})
	row("healthy + slow completed / submitted", func(r *replayResult, a *analysis) string {
		h, s := a.byKind[sglangsim.KindHealthy], a.byKind[sglangsim.KindSlow]
		b := a.byKind[sglangsim.KindBlockedByWedge]
		return fmt.Sprintf("%d / %d", h.success+s.success, h.n+s.n+b.n)
	})
	row("rooms queued behind a wedge (healthy or slow)", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].n)
	})
	row("… failed fast (client can retry)", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].failFast)
	})
	row("… failed by the deadline path", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].auto)
	})
	row("… lost in a restart", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].restarted)
	})
	row("… still hung at the end", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindBlockedByWedge].held)
	})
	row("… of those behind a diagnosed wedge", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(slAnalyse(r).hungBehindDiagnosed)
	})
	row("… error after their wedge's diagnosis, median / p99 / max", func(r *replayResult, a *analysis) string {
		return dist(slAnalyse(r).afterDiagnosis)
	})
	row("… time to their failure (lever), median / p99 / max", func(r *replayResult, a *analysis) string {
		return dist(a.byKind[sglangsim.KindBlockedByWedge].lat)
	})
	row("… age of the hung ones at the end, median / max", func(r *replayResult, a *analysis) string {
		h := a.byKind[sglangsim.KindBlockedByWedge].heldAge
		if len(h) == 0 {
			return "-"
		}
		return secs(quantile(h, 0.5)) + " / " + secs(maxDur(h))
	})
	row("wedges (stuck handles that froze in flight)", func(r *replayResult, a *analysis) string { return fmt.Sprint(a.wedging) })
	row("… diagnosed (transfer_wedged event)", func(r *replayResult, a *analysis) string {
		if !r.cfg.watchdog {
			return "-"
		}
		return fmt.Sprint(a.diagnosed)
	})
	row("… freeze to diagnosis, median / p99 / max", func(r *replayResult, a *analysis) string { return dist(a.toDiagnosis) })
	row("… still wedged at the end", func(r *replayResult, a *analysis) string { return fmt.Sprint(a.wedgeAtEnd) })
	row("restarts performed", func(r *replayResult, a *analysis) string {
		if !r.cfg.watchdog {
			return "-"
		}
		return fmt.Sprintf("%d (%s)", len(r.restartAt), a2s(r.restarts))
	})
	row("requests lost in restarts (all kinds)", func(r *replayResult, a *analysis) string { return fmt.Sprint(a.restartLost) })
	row("arrivals refused while booting", func(r *replayResult, a *analysis) string {
		n := 0
		for _, v := range r.refused {
			n += v
		}
		return fmt.Sprint(n)
	})
	row("health checks force-failed", func(r *replayResult, a *analysis) string {
		n := 0
		for _, rec := range r.records {
			if rec.Kind == sglangsim.KindHealthCheck && !rec.ForcedAt.IsZero() {
				n++
			}
		}
		return fmt.Sprint(n)
	})
	row("client hang after a pin (router waits for both legs), median / p99 / max", func(r *replayResult, a *analysis) string {
		all, open := pinsOf(a, func(f *fate) ([]time.Duration, int) { return f.clientHang, f.clientOpen })
		if open == 0 {
			return dist(all)
		}
		return fmt.Sprintf("%s (%d still waiting at the end)", dist(all), open)
	})
	row("… of pins released by a prefill lever: client answer after that release, median / p99 / max", func(r *replayResult, a *analysis) string {
		all, _ := pinsOf(a, func(f *fate) ([]time.Duration, int) { return f.clientAfterRelease, 0 })
		return dist(all)
	})
	row("decode-side watchdog", func(r *replayResult, a *analysis) string {
		if r.cfg.watchdog && r.cfg.decode {
			return "on"
		}
		return "off"
	})
	row("decode slot held, pins, median / p99 / max", func(r *replayResult, a *analysis) string {
		return holdString(pinsOf(a, func(f *fate) ([]time.Duration, int) { return f.decodeHold, f.decodeOpen }))
	})
	row("… of those the decode-side watchdog released", func(r *replayResult, a *analysis) string {
		var all []time.Duration
		for _, k := range pinKinds {
			all = append(all, a.byKind[k].decodeHoldForced...)
		}
		return dist(all)
	})
	row("decode slot held, rooms behind a wedge, median / p99 / max", func(r *replayResult, a *analysis) string {
		b := a.byKind[sglangsim.KindBlockedByWedge]
		return holdString(b.decodeHold, b.decodeOpen)
	})
	row("decode slot held, healthy, median / p99 / max", func(r *replayResult, a *analysis) string {
		b := a.byKind[sglangsim.KindHealthy]
		return holdString(b.decodeHold, b.decodeOpen)
	})
	row("decode released by a decode force-fail: pins + rooms behind a wedge", func(r *replayResult, a *analysis) string {
		n := 0
		for _, k := range pinKinds {
			n += a.byKind[k].decodeEnd[sglangsim.DecodeForceFail]
		}
		return fmt.Sprintf("%d + %d", n, a.byKind[sglangsim.KindBlockedByWedge].decodeEnd[sglangsim.DecodeForceFail])
	})
	row("decode held as \"transfer may be live\" (then freed by SGLang's timeout)", func(r *replayResult, a *analysis) string {
		if !r.cfg.decode || !r.cfg.watchdog {
			return "-"
		}
		n, t := 0, 0
		for _, f := range a.byKind {
			n += f.heldLive
			t += f.heldThenTimeout
		}
		return fmt.Sprintf("%d (%d)", n, t)
	})
	row("decode force-fails of healthy or slow requests", func(r *replayResult, a *analysis) string {
		return fmt.Sprint(a.byKind[sglangsim.KindHealthy].decodeEnd[sglangsim.DecodeForceFail] + a.byKind[sglangsim.KindSlow].decodeEnd[sglangsim.DecodeForceFail])
	})
	row("decode pages freed under a live transfer: by a force-fail / by SGLang's timeout", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("%d / %d", a.unsafeFree[sglangsim.DecodeForceFail], a.unsafeFree[sglangsim.DecodeTimeout])
	})
	row("prefill requests freed under a transfer: by a lever, live read / by a lever, hung handle / by SGLang itself, live read / hung handle", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("**%d** / %d / %d / %d", a.prefillFreeLever[sglangsim.PrefillFreeLiveRead], a.prefillFreeLever[sglangsim.PrefillFreeHungHandle],
			a.prefillFreeSGLang[sglangsim.PrefillFreeLiveRead], a.prefillFreeSGLang[sglangsim.PrefillFreeHungHandle])
	})
	row("page corruptions (late writes landed): caused by a force-fail / by SGLang's timeout", func(r *replayResult, a *analysis) string {
		return fmt.Sprintf("**%d** / %d", a.corrupt[sglangsim.DecodeForceFail], a.corrupt[sglangsim.DecodeTimeout])
	})
	row("force-fail calls (trigger/result)", func(r *replayResult, a *analysis) string { return a2s(r.calls) })
	row("skips", func(r *replayResult, a *analysis) string { return a2s(r.skips) })
	row("decode force-fail calls (result)", func(r *replayResult, a *analysis) string { return a2s(r.decCalls) })
	row("decode skips", func(r *replayResult, a *analysis) string { return a2s(r.decSkips) })
	row("prefill verdict lookups (answer)", func(r *replayResult, a *analysis) string { return a2s(r.lookups) })
	row("pin releases > 3 s after the windows allowed", func(r *replayResult, a *analysis) string {
		n := 0
		for _, d := range a.excess {
			if d > 3*time.Second {
				n++
			}
		}
		return fmt.Sprintf("%d of %d", n, len(a.excess))
	})

	// Per pin mechanism.
	fmt.Printf("\n## Per pin mechanism\n\n")
	fmt.Printf("| configuration | mechanism | submitted | released by a lever (deadline + fail-fast) | ended by a restart | held at the end | release latency median / p99 / max |\n|---|---|---|---|---|---|---|\n")
	for i := range mains {
		for _, k := range pinKinds {
			f := as[i].byKind[k]
			fmt.Printf("| %s | %s | %d | %d (%d + %d) | %d | %d | %s |\n", jobs[i].name, k, f.n, f.auto+f.failFast, f.auto, f.failFast, f.restarted, f.held, dist(f.lat))
		}
	}

	// Decode, per pin mechanism.
	fmt.Printf("\n## Decode side, per pin mechanism (decode deadline %s, SGLang's waiting timeout %s, no deferred release as up to SGLang v0.5.18)\n\n", watchdog.DefaultDecodeDeadline, o.stockTimeout)
	fmt.Printf("| configuration | class | client hang from the inflight queue, median / p99 / max | decode slot held median / p99 / max | … those a decode force-fail released | how decode let go | held as \"transfer may be live\" (freed by SGLang's timeout) | pages freed under a live transfer: force-fail / timeout | corruptions caused: force-fail / timeout |\n|---|---|---|---|---|---|---|---|---|\n")
	for i, r := range mains {
		for _, k := range append(append([]sglangsim.Kind{}, pinKinds...), sglangsim.KindBlockedByWedge) {
			f := as[i].byKind[k]
			held := "-"
			if r.cfg.watchdog && r.cfg.decode {
				held = fmt.Sprintf("%d (%d)", f.heldLive, f.heldThenTimeout)
			}
			fmt.Printf("| %s | %s | %s | %s | %s | %s | %s | %d / %d | %d / %d |\n", jobs[i].name, k, dist(f.clientHang), holdString(f.decodeHold, f.decodeOpen), dist(f.decodeHoldForced), ends(f.decodeEnd), held,
				as[i].unsafeByKind[k][sglangsim.DecodeForceFail], as[i].unsafeByKind[k][sglangsim.DecodeTimeout],
				as[i].corruptByKind[k][sglangsim.DecodeForceFail], as[i].corruptByKind[k][sglangsim.DecodeTimeout])
		}
	}

	// Details worth reading by hand.
	for i, r := range mains {
		a := as[i]
		fmt.Printf("\n### %s\n\n", jobs[i].name)
		for j, m := range a.falseFF {
			if j == 10 {
				fmt.Printf("  ... %d more\n", len(a.falseFF)-10)
				break
			}
			fmt.Printf("  FALSE FORCE-FAIL %s rank %d %s entered %s forced %s trigger %s\n", m.Kind, m.Rank, m.RID, m.EnteredInflight.Sub(epoch), m.ForcedAt.Sub(epoch), r.trigger[m.RID])
		}
		if n := len(a.decodeHealthy); n > 0 {
			starved, inTime, outcomes := 0, 0, map[string]int{}
			for _, m := range a.decodeHealthy {
				if m.EnteredInflight.IsZero() || m.EnteredInflight.After(m.DecodeForcedAt) {
					starved++
				}
				if m.Outcome == sglangsim.OutcomeSuccess && m.Left.Sub(m.DecodeAdmitted) < o.stockTimeout {
					inTime++
				}
				outcomes[string(m.Outcome)]++
			}
			fmt.Printf("  DECODE FORCE-FAILS OF HEALTHY OR SLOW REQUESTS: %d; not yet in prefill's inflight queue when decode released them: %d; their prefill outcome: %s; prefill transfer done within decode's %s timeout (stock decode would have served them): %d\n",
				n, starved, a2s(outcomes), o.stockTimeout, inTime)
		}
		for j, u := range a.undiagnosed {
			if j == 10 {
				fmt.Printf("  ... %d more\n", len(a.undiagnosed)-10)
				break
			}
			fmt.Printf("  WEDGE NOT DIAGNOSED %s\n", u)
		}
		if r.cfg.watchdog {
			fmt.Printf("  transfer_wedged events: %d (%d name no wedging pin: a re-diagnosis after a restart or of a pin queued behind another wedge)\n", len(r.wedges), a.otherWedgeEvs)
			rules := map[string]int{}
			for _, e := range r.wedges {
				rules[e.rule]++
			}
			fmt.Printf("  by rule: %s\n", a2s(rules))
		}
		if len(r.restartAt) > 0 {
			var ts []string
			for _, at := range r.restartAt {
				ts = append(ts, at.Sub(epoch).Round(time.Second).String())
			}
			fmt.Printf("  restarts at: %s\n", strings.Join(ts, ", "))
		}
		shown := 0
		for _, rec := range r.records {
			if !isPin(rec.Kind) || rec.Outcome == sglangsim.OutcomeFailedForced || shown == 6 {
				continue
			}
			shown++
			fmt.Printf("  PIN NOT RELEASED BY A LEVER %s rank %d %s entered %s outcome %s; events: %s\n", rec.Kind, rec.Rank, rec.RID[:12], rec.EnteredInflight.Sub(epoch).Round(100*time.Millisecond), rec.Outcome, strings.Join(r.ridEvents[rec.RID], "; "))
		}
	}

	// Raw metrics with real Prometheus.
	if o.prom {
		dir, err := os.MkdirTemp("", "wd-quality-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if o.keep {
			fmt.Printf("\n(temp dir kept: %s)\n", dir)
		} else {
			defer os.RemoveAll(dir)
		}
		pinRules := map[string]bool{"SGLangPrefillInflightQueuePinned": true, "SGLangPrefillKVTransferStalled": true}
		for i, res := range mains {
			if res.series == nil {
				continue
			}
			r := evalRaw(o, dir, jobs[i].name, res.series, epoch, res.end)
			fmt.Printf("\n## Raw-metrics rules (alerts/sglang-raw.rules.yml), real Prometheus, series of the %s run\n\n", r.name)
			if r.err != nil {
				fmt.Printf("ERROR: %v\n", r.err)
				continue
			}
			fmt.Printf("(Prometheus evaluated the rules over the trace shifted by %s; eval step 15 s; `for` applied to the range result)\n", r.shift.Round(time.Second))
			for _, rl := range r.rules {
				n, first := 0, time.Duration(-1)
				for _, e := range r.episodes {
					if e.alert == rl.Alert {
						n++
						if first < 0 {
							first = e.fired.Sub(epoch)
						}
					}
				}
				f := "never"
				if first >= 0 {
					f = "first at " + first.String() + " into the trace"
				}
				fmt.Printf("  %-34s for %-4s fired %d time(s), %s\n", rl.Alert, rl.For, n, f)
			}
			fmt.Printf("which part holds (an evaluation counts if any series is present):\n")
			for _, d := range r.diag {
				fmt.Printf("  %s\n", d)
			}
			st := matchPins(res, r, pinRules)
			fmt.Printf("pins alerted (Pinned or Stalled on the pin's dp_rank while the pin was inside): %d/%d", st.alerted, pinSum(as[i], func(f *fate) int { return f.n }))
			if len(st.delays) > 0 {
				fmt.Printf(", time to alert median %s, min %s, max %s", secs(quantile(st.delays, 0.5)), secs(quantile(st.delays, 0)), secs(maxDur(st.delays)))
			}
			fmt.Printf("; firing episodes with no pin inside their rank (false alerts): %d of %d\n", st.falseAlerts, st.episodes)
		}
	}

	// Sweep.
	if o.sweep {
		fmt.Printf("\n## Sweep: deadline x stall window (same trace, defaults configuration)\n\n")
		fmt.Printf("| deadline | stall window | pins released by a lever | false force-fails | pin release median / p99 / max | rooms behind a wedge failed fast / by deadline / hung | freeze to diagnosis median / max |\n|---|---|---|---|---|---|---|\n")
		sw := append([]*replayResult(nil), results[nMain:]...)
		for _, r := range mains {
			if r.cfg.name == "defaults" {
				sw = append(sw, r)
			}
		}
		sort.Slice(sw, func(i, j int) bool {
			if sw[i].cfg.deadline != sw[j].cfg.deadline {
				return sw[i].cfg.deadline < sw[j].cfg.deadline
			}
			return sw[i].cfg.stall < sw[j].cfg.stall
		})
		for _, r := range sw {
			sa := analyse(r)
			var lat []time.Duration
			rel, n := 0, 0
			for _, k := range pinKinds {
				f := sa.byKind[k]
				lat = append(lat, f.lat...)
				rel += f.auto + f.failFast
				n += f.n
			}
			b := sa.byKind[sglangsim.KindBlockedByWedge]
			fmt.Printf("| %s | %s | %d/%d | %d | %s | %d / %d / %d | %s / %s |\n", r.cfg.deadline, r.cfg.stall, rel, n, len(sa.falseFF), dist(lat),
				b.failFast, b.auto, b.held, secs(quantile(sa.toDiagnosis, 0.5)), secs(maxDur(sa.toDiagnosis)))
		}
	}
	if tr.linkClass != nil {
		var rows []slRow
		for i, r := range mains {
			rows = append(rows, slRow{cfg: jobs[i].name, class: "default (" + o.links + ")", attnTP: tr.attnTP, trace: tr, res: r})
		}
		linkTable(rows)
	}
	fmt.Printf("\ntotal wall time %s\n", time.Since(t0).Round(100*time.Millisecond))
	return 0
}

// pinsOf pools one statistic over the pin mechanisms: its durations, and
// how many were still open at the end of the trace.
func pinsOf(a *analysis, get func(f *fate) ([]time.Duration, int)) (all []time.Duration, open int) {
	for _, k := range pinKinds {
		ds, n := get(a.byKind[k])
		all = append(all, ds...)
		open += n
	}
	return all, open
}

// holdString is "median / p99 / max" of decode hold times, saying how
// many were still held at the end (their figure is a lower bound).
func holdString(ds []time.Duration, open int) string {
	if len(ds) == 0 {
		return "-"
	}
	s := dist(ds)
	if open > 0 {
		s += fmt.Sprintf(" (%d still held at the end)", open)
	}
	return s
}

// ends is how decode let go of a class of requests ("" = still held).
func ends(m map[sglangsim.DecodeEnd]int) string {
	out := map[string]int{}
	for k, v := range m {
		if k == "" {
			k = "still_held"
		}
		out[string(k)] = v
	}
	return a2s(out)
}

func a2s(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}
