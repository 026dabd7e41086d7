package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
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
	// slowStuck: some of its stuck handles hang on a slow link, where a
	// stuck chunk is told from a slow one only after that link's own
	// allowance (link margin x its pace), which may outlast the trace.
	slowStuck bool
	// tp: the class replays an attention-TP group (-attn-tp, at least 2)
	// and is replayed only when -classes names it.
	tp bool
	// era: the -era whose pin mechanisms the class needs ("" for any).
	era  string
	what string
	add  func(b *slBuilder)
}

// slBuilder builds one class's trace.
type slBuilder struct {
	o       options
	rng     *rand.Rand
	t       *trace
	traffic time.Duration // arrivals stop here
	speed   float64       // pages per second at full link speed
	attnTP  int           // the trace's attention-TP group size
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

// slowLinks slows queue (-1: every queue) of attention-TP rank tp (-1:
// every rank) down to speed for slowWindow; the default destinations on
// it form one link class.
func (b *slBuilder) slowLinks(tp, queue int, speed float64) {
	b.t.links = append(b.t.links, linkChange{at: slowWindow[0], tp: tp, queue: queue, speed: speed},
		linkChange{at: slowWindow[1], tp: tp, queue: queue, speed: 1})
	class := fmt.Sprintf("%g%% at 5-15 min", speed*100)
	if tp >= 0 {
		class += fmt.Sprintf(" on TP rank %d", tp)
	}
	if b.t.linkClass == nil {
		b.t.linkClass = map[int]string{}
	}
	for _, p := range sglangsim.DefaultDecodePorts {
		if queue == -1 || p%sglangsim.TransferQueues == queue {
			b.t.linkClass[p] = class
		}
	}
}

// destination adds a decode destination of its own speed and traffic.
func (b *slBuilder) destination(d destination) {
	b.t.addDestination(d, b.uniform, func(at time.Duration, port int) {
		b.request(at, b.prompt(), func(s *sglangsim.RequestSpec) { s.DecodePort = port })
	})
}

// hung adds n stuck handles bound for decode port port, arriving within
// [from, to).
func (b *slBuilder) hung(n, port int, from, to time.Duration) {
	for range n {
		b.request(b.uniform(from, to), b.prompt(), func(s *sglangsim.RequestSpec) {
			s.Behavior, s.DecodePort = sglangsim.BehaviorPinStuckHandle, port
		})
	}
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
			add: func(b *slBuilder) { b.slowLinks(-1, 1, 0.1) }},
		{name: "link-1pct-one", what: "queue 1 of every rank at 1% speed for 10 min",
			add: func(b *slBuilder) { b.slowLinks(-1, 1, 0.01) }},
		{name: "link-10pct-all", what: "every queue at 10% speed for 10 min",
			add: func(b *slBuilder) { b.slowLinks(-1, -1, 0.1) }},
		{name: "link-1pct-all", what: "every queue at 1% speed for 10 min",
			add: func(b *slBuilder) { b.slowLinks(-1, -1, 0.01) }},
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
				b.slowLinks(-1, 1, 0.1)
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
		{name: "tp-nonleader-slowlink", tp: true, what: "attention TP (-attn-tp, at least 2): queue 1 of every non-leader TP rank at 1% speed for 10 min, the leader's at full speed",
			add: func(b *slBuilder) {
				for t := 1; t < b.attnTP; t++ {
					b.slowLinks(t, 1, 0.01)
				}
			}},
		{name: "tp-nonleader-wedge", stuck: true, tp: true, what: "attention TP (-attn-tp, at least 2): 10 pairs of hung handles on one rank and decode endpoint, the first on the leader, the second 5 to 30 s later on every other TP rank (it waits behind the first on the leader, hangs on the others), and 10 lone hung handles on the non-leader ranks",
			add: func(b *slBuilder) {
				others := make([]int, 0, b.attnTP-1)
				for t := 1; t < b.attnTP; t++ {
					others = append(others, t)
				}
				for range 10 {
					at := b.uniform(2*time.Minute, b.traffic-2*time.Minute)
					rank, port := b.rng.IntN(b.o.ranks), sglangsim.DefaultDecodePorts[b.rng.IntN(len(sglangsim.DefaultDecodePorts))]
					first := b.request(at, b.prompt(), func(s *sglangsim.RequestSpec) {
						s.Behavior, s.PinTPRanks, s.DecodePort = sglangsim.BehaviorPinStuckHandle, []int{0}, port
					})
					first.rank = rank
					second := b.request(at+b.uniform(5*time.Second, 30*time.Second), b.prompt(), func(s *sglangsim.RequestSpec) {
						s.Behavior, s.PinTPRanks, s.DecodePort = sglangsim.BehaviorPinStuckHandle, others, port
					})
					second.rank = rank
				}
				for range 10 {
					b.request(b.uniform(2*time.Minute, b.traffic-2*time.Minute), b.prompt(), func(s *sglangsim.RequestSpec) {
						s.Behavior, s.PinTPRanks = sglangsim.BehaviorPinStuckHandle, others
					})
				}
			}},
		{name: "mixed-slowlink-hung", stuck: true, what: "link-1pct-one (queue 1's destinations at 1% for 10 min) and 10 hung handles on the other queues' destinations inside the slow window (issue 23)",
			add: func(b *slBuilder) {
				b.slowLinks(-1, 1, 0.01)
				others := []int{17000, 17002, 17003, 17004}
				for range 10 {
					b.hung(1, others[b.rng.IntN(len(others))], slowWindow[0]+time.Minute, slowWindow[1]-time.Minute)
				}
			}},
		{name: "shared-queue-speeds", stuck: true, slowStuck: true, what: "two destinations of different speeds on one queue: 17009 at 1% for the whole run (its own 2% of the traffic) shares queue 1 with 17001 and 17005 at full speed; 5 hung handles on 17001, 5 on 17009",
			add: func(b *slBuilder) {
				b.destination(destination{port: 17009, class: "1% always (shares queue 1)", speeds: []linkChange{{speed: 0.01}},
					to: b.traffic, n: b.o.healthy / 50})
				b.hung(5, 17001, 2*time.Minute, b.traffic-2*time.Minute)
				b.hung(5, 17009, 2*time.Minute, b.traffic-2*time.Minute)
			}},
		{name: "link-drop-recover", stuck: true, slowStuck: true, what: "17010 (queue 2) at full speed, then 1% from 10 min to the end; 17011 (queue 3) at 1%, then full speed from 10 min (2% of the traffic each); 2 hung handles on each before the change, 3 after (17011's right after its recovery)",
			add: func(b *slBuilder) {
				change := 10 * time.Minute
				b.destination(destination{port: 17010, class: "drops to 1% at 10 min", speeds: []linkChange{{at: change, speed: 0.01}},
					to: b.traffic, n: b.o.healthy / 50})
				b.destination(destination{port: 17011, class: "1%, recovers at 10 min", speeds: []linkChange{{speed: 0.01}, {at: change, speed: 1}},
					to: b.traffic, n: b.o.healthy / 50})
				for _, p := range []int{17010, 17011} {
					b.hung(2, p, 3*time.Minute, change-time.Minute)
				}
				b.hung(3, 17010, change+time.Minute, change+10*time.Minute)
				b.hung(3, 17011, change+30*time.Second, change+3*time.Minute)
			}},
		{name: "new-destination", stuck: true, slowStuck: true, what: "17012 (queue 0) appears at 15 min, at 1% (1% of the traffic from then on), after the other links are measured; 3 hung handles on it within its first minute, 3 later",
			add: func(b *slBuilder) {
				from := 15 * time.Minute
				b.destination(destination{port: 17012, class: "new at 15 min, 1%", speeds: []linkChange{{speed: 0.01}},
					from: from, to: b.traffic, n: b.o.healthy / 100})
				b.hung(3, 17012, from+10*time.Second, from+time.Minute)
				b.hung(3, 17012, from+3*time.Minute, b.traffic-2*time.Minute)
			}},
		{name: "silent-pin", stuck: true, era: eraForks, what: "10 resurrection pins and 10 aborted-before-register pins (nothing in flight)",
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
	tp := o.attnTP
	if c.tp {
		tp = max(tp, 2)
	}
	b := &slBuilder{o: o, rng: rand.New(rand.NewPCG(uint64(o.seed), 0x5104)), t: &trace{o: o, attnTP: tp},
		traffic: o.duration - 5*time.Minute, speed: 2048 / o.median.Seconds(), attnTP: tp}
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

// rankQueue is one transfer queue of one rank.
type rankQueue struct{ rank, queue int }

// wedgeIndex finds the wedge that doomed a stuck room and its first
// diagnosis.
type wedgeIndex struct {
	// diag: the transfer_wedged events of each queue, in time order.
	diag map[rankQueue][]time.Time
	// start: when each stuck handle that wedged its worker (seen with its
	// chunk in flight; one queued behind another wedge never is) entered,
	// in time order.
	start map[rankQueue][]time.Time
}

func newWedgeIndex(r *replayResult) *wedgeIndex {
	wi := &wedgeIndex{diag: map[rankQueue][]time.Time{}, start: map[rankQueue][]time.Time{}}
	for _, e := range r.wedges {
		k := rankQueue{e.rank, e.queue}
		wi.diag[k] = append(wi.diag[k], e.at)
	}
	for _, rec := range r.records {
		if t := r.pins.pins[rec.RID]; rec.Kind == sglangsim.KindPinStuckHandle && t != nil && t.inFlight {
			k := rankQueue{rec.Rank, rec.TransferQueue}
			wi.start[k] = append(wi.start[k], rec.EnteredInflight)
		}
	}
	for _, ts := range wi.start {
		sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
	}
	return wi
}

// diagnosis returns the first diagnosis of the wedge that doomed a stuck
// room: the last wedging stuck handle on its queue that entered before it
// (or itself).
func (wi *wedgeIndex) diagnosis(rec sglangsim.Record) (time.Time, bool) {
	k := rankQueue{rec.Rank, rec.TransferQueue}
	var start time.Time
	for _, t := range wi.start[k] {
		if !t.After(rec.EnteredInflight) {
			start = t
		}
	}
	if start.IsZero() {
		return time.Time{}, false
	}
	for _, d := range wi.diag[k] {
		if !d.Before(start) {
			return d, true
		}
	}
	return time.Time{}, false
}

func slAnalyse(r *replayResult) slStats {
	var st slStats
	st.restarts = len(r.restartAt)
	st.diagnoses = len(r.wedges)
	st.refused = r.refused[sglangsim.KindHealthy] + r.refused[sglangsim.KindSlow]
	wi := newWedgeIndex(r)
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
				if _, ok := wi.diagnosis(rec); ok && rec.Kind == sglangsim.KindBlockedByWedge {
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
		if d, ok := wi.diagnosis(rec); ok && !rec.Left.Before(d) {
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
	} else {
		classes = slices.DeleteFunc(classes, func(c slClass) bool { return c.tp || (c.era != "" && c.era != o.era) })
	}
	for _, c := range classes {
		if c.era != "" && c.era != o.era {
			fmt.Fprintf(os.Stderr, "-classes: %s pins by mechanisms that SGLang's releases do not have; replay it with -era %s\n", c.name, c.era)
			return 2
		}
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
		if tp := traces[cl.name].attnTP; tp > 1 {
			fmt.Printf("  (replayed with attention TP %d, plugin view %s)\n", tp, o.tpView)
		}
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
	var rows []slRow
	for _, j := range jobs {
		rows = append(rows, slRow{cfg: j.cfg.name, class: j.class.name, attnTP: traces[j.class.name].attnTP, trace: traces[j.class.name], res: j.res})
	}
	if slices.ContainsFunc(classes, func(c slClass) bool { return c.tp }) || o.attnTP > 1 {
		slDecodeTable(o, rows)
	}
	linkTable(rows)
	fmt.Println("\nA false failure is a room of kind healthy or slow (it would have completed: the simulator knows) that a force-fail or a wedge order failed. Stuck rooms are the pins and the rooms queued behind a stuck handle; their release counts a lever or a restart. \"error after wedge diagnosis\" runs from the watchdog's first transfer_wedged event for the stuck handle's rank and queue (or the room's entry, if later) to the room's error. \"left hung\" counts rooms still in the server at the end; \"other\" ones are still transferring.")
	return 0
}

// slDecodeStats is one class's decode side under one configuration.
type slDecodeStats struct {
	hang                 []time.Duration // stuck rooms: inflight entry to the client's answer (or the end)
	open                 int             // stuck rooms whose client still waits at the end
	freedStopped         int             // decode force-fail releases after a "stopped" verdict
	freedOther           int             // ... after another verdict
	freedNoLookup        int             // ... with no verdict asked (no transfer started)
	heldLive             int             // held as "transfer may be live"
	heldThenTimeout      int             // of those, freed by SGLang's timeout
	unsafeFF, unsafeTO   int             // pages freed under a live write: by a force-fail / SGLang's timeout
	prefillLive          int             // prefill requests a lever freed under a live read
	prefillHung          int             // ... under a hung handle (the remedy's own case)
	corruptFF, corruptTO int             // late writes landed: caused by a force-fail / SGLang's timeout
}

func slDecode(r *replayResult) slDecodeStats {
	var st slDecodeStats
	for _, rec := range r.records {
		if rec.Kind == sglangsim.KindHealthCheck {
			continue
		}
		stuck := rec.Kind.Pin() || rec.Kind == sglangsim.KindBlockedByWedge
		if stuck && !rec.EnteredInflight.IsZero() {
			if at := rec.ClientAnswered(); at.IsZero() {
				st.open++
				st.hang = append(st.hang, r.end.Sub(rec.EnteredInflight))
			} else {
				st.hang = append(st.hang, at.Sub(rec.EnteredInflight))
			}
		}
		if rec.DecodeEnd == sglangsim.DecodeForceFail {
			switch v, asked := r.verdicts[rec.RID]; {
			case !asked:
				st.freedNoLookup++
			case v == pluginapi.VerdictStopped:
				st.freedStopped++
			default:
				st.freedOther++
			}
		}
		if r.heldLive[rec.RID] {
			st.heldLive++
			if rec.DecodeEnd == sglangsim.DecodeTimeout {
				st.heldThenTimeout++
			}
		}
		if !rec.ForcedAt.IsZero() {
			switch rec.PrefillFreedUnder {
			case sglangsim.PrefillFreeLiveRead:
				st.prefillLive++
			case sglangsim.PrefillFreeHungHandle:
				st.prefillHung++
			}
		}
		switch rec.UnsafeFree {
		case sglangsim.DecodeForceFail:
			st.unsafeFF++
		case sglangsim.DecodeTimeout:
			st.unsafeTO++
		}
	}
	for _, c := range r.corruption {
		switch c.Cause {
		case sglangsim.DecodeForceFail:
			st.corruptFF++
		case sglangsim.DecodeTimeout:
			st.corruptTO++
		}
	}
	return st
}

// slRow is one replay of the slow-link family.
type slRow struct {
	cfg, class string
	attnTP     int
	trace      *trace
	res        *replayResult
}

// slDecodeTable prints the decode side of every replay: the client's wait
// on a stuck room and whether a decode release ever freed pages another
// rank still wrote.
func slDecodeTable(o options, rows []slRow) {
	fmt.Printf("\n## Decode side and page safety (decode deadline %s, SGLang's waiting timeout %s)\n\n",
		watchdog.DefaultDecodeDeadline, o.stockTimeout)
	fmt.Println("| configuration | class | prefill attention TP (plugin view) | client hang of stuck rooms from the inflight queue, median / p99 / max (still waiting at the end) | decode force-fail releases: after a \"stopped\" verdict / after another verdict / no lookup (no transfer started) | held as \"transfer may be live\" (then freed by SGLang's timeout) | prefill requests a lever freed under a read: live / hung handle | decode pages freed under a live write: by a force-fail / by SGLang's timeout | page corruptions (late writes landed) caused by a force-fail / by SGLang's timeout |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, row := range rows {
		st := slDecode(row.res)
		tp := "1"
		if row.attnTP > 1 {
			tp = fmt.Sprintf("%d (%s)", row.attnTP, o.tpView)
		}
		fmt.Printf("| %s | %s | %s | %s (%d) | %d / %d / %d | %d (%d) | **%d** / %d | %d / %d | **%d** / %d |\n", row.cfg, row.class, tp, dist(st.hang), st.open,
			st.freedStopped, st.freedOther, st.freedNoLookup, st.heldLive, st.heldThenTimeout, st.prefillLive, st.prefillHung, st.unsafeFF, st.unsafeTO, st.corruptFF, st.corruptTO)
	}
}
