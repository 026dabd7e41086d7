package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// The trace: arrivals drawn from the seed, and the pin mechanisms mixed
// into it.

type arrival struct {
	at       time.Duration // from the start of the trace
	rank     int
	behavior sglangsim.Behavior
	// spec, when set, is the whole request (the slow-link family); rank
	// and behavior override its Rank and Behavior.
	spec *sglangsim.RequestSpec
	// abortAfter > 0: its client aborts it this long after it arrived.
	abortAfter time.Duration
	// port > 0 binds it to that decode destination (RequestSpec.DecodePort).
	port int
}

// linkChange sets, at `at`, the link speed on one attention-TP rank (-1:
// all) of every rank: of one decode destination (port > 0,
// sglangsim.SetDestinationSpeed), else of every destination on one
// transfer queue (-1: all; sglangsim.SetTPLinkSpeed).
type linkChange struct {
	at    time.Duration
	tp    int
	queue int
	port  int
	speed float64
}

type trace struct {
	o        options
	arrivals []arrival    // sorted by at
	links    []linkChange // sorted by at
	pins     int
	// linkClass names the link class of the destinations that have one
	// (addDestination); the others are full speed.
	linkClass map[int]string
	// attnTP is the attention-TP group size of the prefill ranks
	// (sglangsim Options.AttnTP); pinTP the ranks the default family's pins
	// hold on (nil: all).
	attnTP int
	pinTP  []int
}

// unwatched is how many non-leader ranks the plugin does not read: one
// with -tp-view stale-peer.
func (t *trace) unwatched() int {
	if t.attnTP > 1 && t.o.tpView == "stale-peer" {
		return 1
	}
	return 0
}

// tpRanks parses a comma-separated list of attention-TP ranks below n.
func tpRanks(list string, n int) ([]int, error) {
	if strings.TrimSpace(list) == "" {
		return nil, nil
	}
	var out []int
	for _, f := range strings.Split(list, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 0 || v >= n {
			return nil, fmt.Errorf("%q is not an attention-TP rank below -attn-tp %d", f, n)
		}
		out = append(out, v)
	}
	return out, nil
}

func makeTrace(o options) *trace {
	rng := rand.New(rand.NewPCG(uint64(o.seed), 0x5eed))
	t := &trace{o: o, attnTP: o.attnTP}
	t.pinTP, _ = tpRanks(o.pinTPRanks, o.attnTP) // checked by main
	// Traffic stops 6 minutes before the end so that every healthy request
	// (at most 100 medians) and every pin (deadline + windows) can finish.
	traffic := o.duration - 6*time.Minute
	uniform := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Float64()*float64(hi-lo)) }
	for i := 0; i < o.healthy; i++ {
		t.arrivals = append(t.arrivals, arrival{at: uniform(0, traffic), rank: rng.IntN(o.ranks), behavior: sglangsim.BehaviorHealthy})
	}
	slow := int(math.Round(float64(o.healthy) * o.slowPct / 100))
	for i := 0; i < slow; i++ {
		t.arrivals = append(t.arrivals, arrival{at: uniform(0, traffic), rank: rng.IntN(o.ranks), behavior: sglangsim.BehaviorSlow})
	}
	for r := 0; r < o.ranks; r++ {
		t.arrivals = append(t.arrivals, arrival{at: time.Minute + time.Duration(r)*7*time.Second, rank: r, behavior: sglangsim.BehaviorStuckHealthCheck})
	}
	// Pins: evenly spaced slots over [2 min, end - 8 min], one pin at a
	// random point of each slot, mechanisms in a shuffled even mix.
	t.pins = int(math.Round(float64(o.healthy) * o.pinPct / 100))
	mechs := pinMechanisms(o.mechanisms)
	kinds := make([]sglangsim.Behavior, t.pins)
	for i := range kinds {
		kinds[i] = mechs[i%len(mechs)]
	}
	rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	if t.pins > 0 {
		from, to := 2*time.Minute, o.duration-8*time.Minute
		slot := (to - from) / time.Duration(t.pins)
		for i := 0; i < t.pins; i++ {
			at := from + time.Duration(i)*slot + uniform(0, slot)
			t.arrivals = append(t.arrivals, arrival{at: at, rank: rng.IntN(o.ranks), behavior: kinds[i]})
		}
	}
	if o.links == "hetero" {
		t.heterogeneous(traffic)
	}
	sort.SliceStable(t.arrivals, func(i, j int) bool { return t.arrivals[i].at < t.arrivals[j].at })
	return t
}

// heterogeneous adds issue 23's fleet to the default trace, from a stream
// of its own (the rest of the trace is the uniform one): four decode
// destinations beyond the simulator's six, each with its own speed and
// traffic, sized so that its serial workers keep up (a 1% link makes a
// median transfer 100 s), and binds every stuck-handle pin to one of the
// ten destinations that exists when it arrives.
func (t *trace) heterogeneous(traffic time.Duration) {
	o := t.o
	rng := rand.New(rand.NewPCG(uint64(o.seed), 0x11c5))
	uniform := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Float64()*float64(hi-lo)) }
	add := func(at time.Duration, port int) {
		t.arrivals = append(t.arrivals, arrival{at: at, rank: rng.IntN(o.ranks), behavior: sglangsim.BehaviorHealthy, port: port})
	}
	mid := o.duration / 2
	fleet := []destination{
		{port: 17009, class: "1% (shares queue 1)", speeds: []linkChange{{speed: 0.01}}, to: traffic, n: o.healthy / 500},
		{port: 17013, class: "10% (shares queue 1)", speeds: []linkChange{{speed: 0.1}}, to: traffic, n: o.healthy / 100},
		{port: 17010, class: "10% for 10 min from 20 min", speeds: []linkChange{{at: 20 * time.Minute, speed: 0.1}, {at: 30 * time.Minute, speed: 1}},
			to: traffic, n: o.healthy / 50},
		{port: 17012, class: "new at mid-run, 10%", speeds: []linkChange{{speed: 0.1}}, from: mid, to: traffic, n: o.healthy / 200},
	}
	for _, d := range fleet {
		t.addDestination(d, uniform, add)
	}
	ports := append(slices.Clone(sglangsim.DefaultDecodePorts), 17009, 17013, 17010, 17012)
	for i := range t.arrivals {
		a := &t.arrivals[i]
		if a.behavior != sglangsim.BehaviorPinStuckHandle {
			continue
		}
		for a.port == 0 || (a.port == 17012 && a.at < mid) {
			a.port = ports[rng.IntN(len(ports))]
		}
	}
}

// The eras of -era. A stuck transfer handle pins a request on every
// release; the other two mechanisms were read in SGLang code outside the
// releases, whose own code concludes such a request (conformance/pins.py
// plays them on each release).
const (
	eraReleases = "releases"
	eraForks    = "forks"
)

var eraMechanisms = map[string]string{
	eraReleases: "stuck-handle",
	eraForks:    "resurrection,abort-before-register,stuck-handle",
}

// checkMechanisms fills o.mechanisms from -era when it is empty and says
// what is wrong with -era or -mechanisms, naming the flag.
func checkMechanisms(o *options) error {
	allowed, ok := eraMechanisms[o.era]
	if !ok {
		return fmt.Errorf("-era: unknown era %q (want %s or %s)", o.era, eraReleases, eraForks)
	}
	if o.mechanisms == "" {
		o.mechanisms = allowed
		return nil
	}
	for _, m := range strings.Split(o.mechanisms, ",") {
		m = strings.TrimSpace(m)
		if _, ok := mechanismNames[m]; !ok {
			return fmt.Errorf("-mechanisms: unknown mechanism %q (want resurrection, abort-before-register, stuck-handle)", m)
		}
		if !slices.Contains(strings.Split(allowed, ","), m) {
			return fmt.Errorf("-mechanisms: %s does not pin a request on SGLang's releases (v0.4.6 to v0.5.18, upstream main); replay it with -era %s", m, eraForks)
		}
	}
	return nil
}

// pinMechanisms parses -mechanisms; checkMechanisms checks it first.
func pinMechanisms(list string) []sglangsim.Behavior {
	var out []sglangsim.Behavior
	for _, m := range strings.Split(list, ",") {
		if b, ok := mechanismNames[strings.TrimSpace(m)]; ok {
			out = append(out, b)
		}
	}
	return out
}

var mechanismNames = map[string]sglangsim.Behavior{
	"resurrection":          sglangsim.BehaviorPinResurrection,
	"abort-before-register": sglangsim.BehaviorPinAbortBeforeRegister,
	"stuck-handle":          sglangsim.BehaviorPinStuckHandle,
}

func isPinBehavior(b sglangsim.Behavior) bool {
	return b == sglangsim.BehaviorPinResurrection || b == sglangsim.BehaviorPinAbortBeforeRegister || b == sglangsim.BehaviorPinStuckHandle
}
