package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// The slow-link family (-family slowlink): issue 17's false-positive
// matrix. Each class is its own trace over the same background traffic,
// replayed with the watchdog as linked (each configuration of -configs),
// and judged by the simulator's ground truth: a room that would have
// completed by itself (kind healthy or slow) and was failed is a false
// failure, whatever failed it.
//
// Every transfer takes its pages over its queue's link: planned time =
// prompt pages / link speed x a lognormal jitter (sigma 0.5), with the
// link speed set so that a 2,048-token prompt takes -median; chunks of
// 1,024 pages unless the class says otherwise (sglangsim plays each chunk
// at the queue's link speed of the moment).

// slClass is one class of the matrix.
type slClass struct {
	name string
	// stuck: the class holds rooms that never complete by themselves
	// (pins, and the rooms queued behind a stuck handle), which must be
	// released.
	stuck bool
	what  string
	add   func(b *slBuilder)
}

// slBuilder builds one class's trace.
type slBuilder struct {
	o       options
	rng     *rand.Rand
	t       *trace
	traffic time.Duration // arrivals stop here
	speed   float64       // pages per second at full link speed
}

// slowWindow is when the link classes slow their links down.
var slowWindow = [2]time.Duration{5 * time.Minute, 15 * time.Minute}

func (b *slBuilder) prompt() int {
	p := int(2048 * math.Exp(0.7*b.rng.NormFloat64()))
	return min(max(p, 64), 32768)
}

// transfer is the planned time of `pages` over a full-speed link.
func (b *slBuilder) transfer(pages int) time.Duration {
	return time.Duration(float64(pages) / b.speed * math.Exp(0.5*b.rng.NormFloat64()) * float64(time.Second))
}

// erroring adds n single-chunk requests whose chunk errors half-way
// through a transfer planned between min and max.
func (b *slBuilder) erroring(n int, min, max time.Duration) {
	for range n {
		planned := b.uniform(min, max)
		b.request(b.uniform(2*time.Minute, b.traffic), b.prompt(), func(s *sglangsim.RequestSpec) {
			s.Behavior = sglangsim.BehaviorTransferFail
			s.Transfer = planned
			s.Chunks = 1
		})
	}
}

// request adds a request of `pages` pages at `at` on a random rank; the
// pointer is good until the next request.
func (b *slBuilder) request(at time.Duration, pages int, f func(*sglangsim.RequestSpec)) *arrival {
	spec := &sglangsim.RequestSpec{PromptTokens: pages, Transfer: b.transfer(pages),
		Bootstrap: 2*time.Millisecond + time.Duration(b.rng.Float64()*float64(28*time.Millisecond))}
	if f != nil {
		f(spec)
	}
	b.t.arrivals = append(b.t.arrivals, arrival{at: at, rank: b.rng.IntN(b.o.ranks), behavior: spec.Behavior, spec: spec})
	return &b.t.arrivals[len(b.t.arrivals)-1]
}

func (b *slBuilder) uniform(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(b.rng.Float64()*float64(hi-lo))
}

func (b *slBuilder) slowLinks(queue int, speed float64) {
	b.t.links = append(b.t.links, linkChange{at: slowWindow[0], queue: queue, speed: speed},
		linkChange{at: slowWindow[1], queue: queue, speed: 1})
}

// queue1Port is a decode endpoint whose rooms take transfer queue 1
// (sglangsim.DefaultDecodePorts, keyed by decode ports).
const queue1Port = 17001

func slowlinkClasses() []slClass {
	long := func(b *slBuilder, chunks int) {
		// 1% of the traffic: prompts of 64k to 128k tokens.
		n := b.o.healthy / 100
		for range n {
			pages := 65536 + b.rng.IntN(65537)
			b.request(b.uniform(0, b.traffic), pages, func(s *sglangsim.RequestSpec) { s.Chunks = chunks })
		}
	}
	return []slClass{
		{name: "long-prompt", what: "1% of requests carry 64k-128k-token prompts: 64-128 chunks, 32-64 times a median prompt's transfer at full speed",
			add: func(b *slBuilder) { long(b, 0) }},
		{name: "huge-chunk", what: "1% of requests carry 64k-128k-token prompts in one chunk (32-64 times a median prompt's transfer)",
			add: func(b *slBuilder) { long(b, 1) }},
		{name: "link-10pct-one", what: "queue 1 of every rank at 10% speed for 10 min",
			add: func(b *slBuilder) { b.slowLinks(1, 0.1) }},
		{name: "link-1pct-one", what: "queue 1 of every rank at 1% speed for 10 min",
			add: func(b *slBuilder) { b.slowLinks(1, 0.01) }},
		{name: "link-10pct-all", what: "every queue at 10% speed for 10 min",
			add: func(b *slBuilder) { b.slowLinks(-1, 0.1) }},
		{name: "link-1pct-all", what: "every queue at 1% speed for 10 min",
			add: func(b *slBuilder) { b.slowLinks(-1, 0.01) }},
		{name: "burst", what: "three bursts of 1,000 requests within a second",
			add: func(b *slBuilder) {
				for _, at := range []time.Duration{5 * time.Minute, 10 * time.Minute, 15 * time.Minute} {
					for range 1000 {
						b.request(at+b.uniform(0, time.Second), b.prompt(), nil)
					}
				}
			}},
		{name: "abort-behind-slow", what: "queue 1 at 10% for 10 min; 100 rooms bound for it aborted by their clients 20 s after arrival",
			add: func(b *slBuilder) {
				b.slowLinks(1, 0.1)
				for range 100 {
					a := b.request(b.uniform(slowWindow[0], slowWindow[1]), b.prompt(), func(s *sglangsim.RequestSpec) { s.DecodePort = queue1Port })
					a.abortAfter = 20 * time.Second
				}
			}},
		{name: "error-settle", what: "20 chunks that error after 2 to 20 s, as a transport reports a failed transfer (the room fails through SGLang's own path); rooms queue behind them",
			add: func(b *slBuilder) { b.erroring(20, 4*time.Second, 40*time.Second) }},
		{name: "error-late", what: "20 chunks that error only after about 94 s, past their allowance: until the error they look exactly like a stuck handle (the limit, not a goal)",
			add: func(b *slBuilder) { b.erroring(20, 184*time.Second, 184*time.Second) }},
		{name: "hung-handle", stuck: true, what: "10 stuck handles (one chunk held for ever), traffic queued behind them",
			add: func(b *slBuilder) {
				for range 10 {
					b.request(b.uniform(2*time.Minute, b.traffic-2*time.Minute), b.prompt(), func(s *sglangsim.RequestSpec) {
						s.Behavior = sglangsim.BehaviorPinStuckHandle
					})
				}
			}},
		{name: "silent-pin", stuck: true, what: "10 resurrection pins and 10 aborted-before-register pins (nothing in flight)",
			add: func(b *slBuilder) {
				for i := range 20 {
					beh := sglangsim.BehaviorPinResurrection
					if i%2 == 1 {
						beh = sglangsim.BehaviorPinAbortBeforeRegister
					}
					b.request(b.uniform(2*time.Minute, b.traffic-2*time.Minute), b.prompt(), func(s *sglangsim.RequestSpec) { s.Behavior = beh })
				}
			}},
	}
}

// slowlinkTrace is class c's trace: -healthy requests spread evenly over
// the trace (arrivals stop 5 minutes before its end) plus the class's own.
func slowlinkTrace(o options, c slClass) *trace {
	b := &slBuilder{o: o, rng: rand.New(rand.NewPCG(uint64(o.seed), 0x5104)), t: &trace{o: o},
		traffic: o.duration - 5*time.Minute, speed: 2048 / o.median.Seconds()}
	for range o.healthy {
		b.request(b.uniform(0, b.traffic), b.prompt(), nil)
	}
	// The class draws from its own stream, so that every class shares the
	// background traffic.
	b.rng = rand.New(rand.NewPCG(uint64(o.seed), 0x5105))
	c.add(b)
	for _, a := range b.t.arrivals {
		if isPinBehavior(a.behavior) {
			b.t.pins++
		}
	}
	sort.SliceStable(b.t.arrivals, func(i, j int) bool { return b.t.arrivals[i].at < b.t.arrivals[j].at })
	return b.t
}

// slStats is one class under one configuration.
type slStats struct {
	rooms, completable, stuck int
	falseFF, falseWedge       int // completable rooms failed by a force-fail / a wedge order
	forcedFailing             int // rooms that would have failed by themselves, failed first
	restarts                  int
	lostCompletable           int // completable rooms lost in restarts
	released                  int // stuck rooms released (lever or restart)
	fromAdmission, overDL     []time.Duration
	afterDiagnosis            []time.Duration
	// hungBehindDiagnosed: rooms queued behind a wedge the watchdog had
	// diagnosed, still in the server at the end.
	hungBehindDiagnosed  int
	hungStuck, hungOther int
	diagnoses            int // transfer_wedged events
	refused              int // completable requests refused while the server booted
}

func slAnalyse(r *replayResult) slStats {
	var st slStats
	st.restarts = len(r.restartAt)
	st.diagnoses = len(r.wedges)
	st.refused = r.refused[sglangsim.KindHealthy] + r.refused[sglangsim.KindSlow]
	// The first diagnosis of each wedge: by (rank, queue), the
	// transfer_wedged events in time order.
	type rq struct{ rank, queue int }
	diag := map[rq][]time.Time{}
	for _, e := range r.wedges {
		k := rq{e.rank, e.queue}
		diag[k] = append(diag[k], e.at)
	}
	// When each stuck handle that wedged its worker (seen with its chunk
	// in flight; one queued behind another wedge never is) entered.
	wedgeStart := map[rq][]time.Time{}
	for _, rec := range r.records {
		if t := r.pins.pins[rec.RID]; rec.Kind == sglangsim.KindPinStuckHandle && t != nil && t.inFlight {
			k := rq{rec.Rank, rec.TransferQueue}
			wedgeStart[k] = append(wedgeStart[k], rec.EnteredInflight)
		}
	}
	for _, ts := range wedgeStart {
		sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
	}
	// diagnosis returns the first diagnosis of the wedge that doomed a
	// stuck room: the last wedging stuck handle on its queue that entered
	// before it (or itself).
	diagnosis := func(rec sglangsim.Record) (time.Time, bool) {
		k := rq{rec.Rank, rec.TransferQueue}
		var start time.Time
		for _, t := range wedgeStart[k] {
			if !t.After(rec.EnteredInflight) {
				start = t
			}
		}
		if start.IsZero() {
			return time.Time{}, false
		}
		for _, d := range diag[k] {
			if !d.Before(start) {
				return d, true
			}
		}
		return time.Time{}, false
	}
	for _, rec := range r.records {
		if rec.Kind == sglangsim.KindHealthCheck {
			continue
		}
		st.rooms++
		completable := rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow
		stuck := rec.Kind.Pin() || rec.Kind == sglangsim.KindBlockedByWedge
		forced := !rec.ForcedAt.IsZero()
		switch {
		case completable:
			st.completable++
			if forced && rec.WedgeOrdered {
				st.falseWedge++
			} else if forced {
				st.falseFF++
			}
			if rec.Outcome == sglangsim.OutcomeRestarted {
				st.lostCompletable++
			}
		case rec.Kind == sglangsim.KindFailing && forced:
			st.forcedFailing++
		}
		held := rec.Outcome == sglangsim.OutcomeInflight || rec.Outcome == sglangsim.OutcomeQueued
		if held {
			if stuck {
				st.hungStuck++
				if _, ok := diagnosis(rec); ok && rec.Kind == sglangsim.KindBlockedByWedge {
					st.hungBehindDiagnosed++
				}
			} else {
				st.hungOther++
			}
		}
		if !stuck || rec.EnteredInflight.IsZero() {
			continue
		}
		st.stuck++
		if held {
			continue
		}
		st.released++
		age := rec.Left.Sub(rec.EnteredInflight)
		st.fromAdmission = append(st.fromAdmission, age)
		st.overDL = append(st.overDL, max(age-r.cfg.deadline, 0))
		if rec.Kind != sglangsim.KindPinStuckHandle && rec.Kind != sglangsim.KindBlockedByWedge {
			continue
		}
		if d, ok := diagnosis(rec); ok && !rec.Left.Before(d) {
			from := d
			if rec.EnteredInflight.After(d) {
				from = rec.EnteredInflight
			}
			st.afterDiagnosis = append(st.afterDiagnosis, rec.Left.Sub(from))
		}
	}
	return st
}

// runSlowlink replays every class under every configuration and prints
// the matrix.
func runSlowlink(o options, cfgNames []string) int {
	t0 := time.Now()
	all := configs(o)
	classes := slowlinkClasses()
	if o.classes != "" {
		var keep []slClass
		for _, n := range strings.Split(o.classes, ",") {
			found := false
			for _, c := range classes {
				if c.name == strings.TrimSpace(n) {
					keep, found = append(keep, c), true
				}
			}
			if !found {
				fmt.Fprintf(os.Stderr, "-classes: unknown class %q\n", n)
				return 2
			}
		}
		classes = keep
	}
	type job struct {
		class slClass
		cfg   replayConfig
		res   *replayResult
		err   error
	}
	var jobs []*job
	for i, n := range cfgNames {
		n = strings.TrimSpace(n)
		cfgNames[i] = n
		c, ok := all[n]
		if !ok {
			fmt.Fprintf(os.Stderr, "-configs: unknown configuration %q\n", n)
			return 2
		}
		for _, cl := range classes {
			jobs = append(jobs, &job{class: cl, cfg: c})
		}
	}
	traces := map[string]*trace{}
	for _, cl := range classes {
		traces[cl.name] = slowlinkTrace(o, cl)
	}
	inParallel(len(jobs), o.parallel, func(i int) {
		j := jobs[i]
		j.res, j.err = replay(traces[j.class.name], j.cfg)
		if j.err == nil {
			fmt.Fprintf(os.Stderr, "replay %s/%s done in %s\n", j.cfg.name, j.class.name, j.res.wall.Round(100*time.Millisecond))
		}
	})
	for _, j := range jobs {
		if j.err != nil {
			fmt.Fprintf(os.Stderr, "%s/%s: %v\n", j.cfg.name, j.class.name, j.err)
			return 1
		}
	}
	fmt.Printf("# Slow links and wedges (issue 17's matrix), seed %d\n\n", o.seed)
	fmt.Printf("each class: DP%d, %s simulated, %d background requests (lognormal prompts around 2,048 tokens; a 2,048-token prompt takes %s over a full-speed link, jitter sigma 0.5; chunks of 1,024 pages), arrivals stop 5 min before the end; NIXL, newest era, round-4 plugin; watchdog deadline %s, stall window %s; a scheduler pass every %s; replays took %s in all\n\n",
		o.ranks, o.duration, o.healthy, o.median, o.deadline, o.stall, o.step, time.Since(t0).Round(100*time.Millisecond))
	for _, cl := range classes {
		fmt.Printf("- %s: %s\n", cl.name, cl.what)
	}
	for _, n := range cfgNames {
		fmt.Printf("\n## %s\n\n", n)
		fmt.Println("| class | rooms (completable) | false force-fails | false wedge-order failures | transfer_wedged events | restarts (false) | completable lost in restarts + refused while booting | stuck rooms released / all | release from admission, median / p99 / max | beyond the deadline, median / p99 / max | error after wedge diagnosis, median / p99 / max (rooms) | left hung: stuck / other | failing rooms failed first |")
		fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
		for _, j := range jobs {
			if j.cfg.name != n {
				continue
			}
			s := slAnalyse(j.res)
			falseRestarts := 0
			if !j.class.stuck {
				falseRestarts = s.restarts
			}
			fmt.Printf("| %s | %d (%d) | %d | %d | %d | %d (%d) | %d + %d | %d / %d | %s | %s | %s | %d / %d | %d |\n",
				j.class.name, s.rooms, s.completable, s.falseFF, s.falseWedge, s.diagnoses, s.restarts, falseRestarts, s.lostCompletable, s.refused,
				s.released, s.stuck, dist(s.fromAdmission), dist(s.overDL), fmt.Sprintf("%s (%d)", dist(s.afterDiagnosis), len(s.afterDiagnosis)), s.hungStuck, s.hungOther, s.forcedFailing)
		}
	}
	fmt.Println("\nA false failure is a room of kind healthy or slow (it would have completed: the simulator knows) that a force-fail or a wedge order failed. Stuck rooms are the pins and the rooms queued behind a stuck handle; their release counts a lever or a restart. \"error after wedge diagnosis\" runs from the watchdog's first transfer_wedged event for the stuck handle's rank and queue (or the room's entry, if later) to the room's error. \"left hung\" counts rooms still in the server at the end; \"other\" ones are still transferring.")
	return 0
}
