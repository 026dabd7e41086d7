package watchdog

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/bench/cputime"
	"github.com/sglang-watchdog/sglang-watchdog/bench/simplugin"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// Benchmarks of one full watch cycle (RunCycle): every rank's listing read
// through the PluginSource interface, decoded from its JSON wire form with
// pluginapi.DecodeListing (the HTTP round trip itself is left out), folded
// into state, every room and rank evaluated, candidates chosen. The listings
// come from an in-process, Step-driven sglangsim; the simulator's work
// (Step, and marshalling the listings) runs with the timer stopped.
//
// Two kinds of load:
//   - steady: the given number of rooms stand in the inflight queues and
//     none leave. As in SGLang, their listed progress stands still for the
//     whole stay; they are rooms that never reach a transfer worker
//     (sglangsim's ABORT-before-register pin: WaitingForInput, nothing in
//     flight), so they hold no worker and are never served;
//   - churn: the same standing rooms, plus Poisson traffic at 606
//     requests/s with lognormal transfers (median 10 ms, so that each
//     transfer queue, which SGLang serves serially, keeps up): about 600
//     rooms arrive and 600 leave each cycle.
//
// The simulator's pools are sized for the standing rooms (its defaults,
// 3,072 requests a rank, could never admit 10k rooms on one rank), and the
// deadline and stall window are longer than any run, so that no room is
// judged stuck: the cost of watching, not of acting. (Until the simulator
// followed SGLang, the steady rooms were slow transfers whose listed
// progress moved, a quarter of them each cycle, and the churn's rooms were
// the traffic itself, with a median of rooms/1000 s; serial transfer
// queues cannot serve that traffic, and the listed progress stands still.)
//
// Each reports ns/op (wall), cpu-ns/op (process CPU time over RunCycle
// only, all threads, from CLOCK_PROCESS_CPUTIME_ID), B/op and allocs/op,
// and rooms (the average number of rooms listed per cycle).
//
//	go test -run '^$' -bench 'RunCycle' -benchmem ./watchdog

type cycleLoad int

const (
	loadSteady cycleLoad = iota
	loadChurn
)

func (l cycleLoad) String() string {
	if l == loadChurn {
		return "churn"
	}
	return "steady"
}

// benchSim builds a simulator with about `rooms` inflight rooms over `ranks`
// ranks, already in steady state.
func benchSim(b *testing.B, ranks, rooms int, load cycleLoad) (*sglangsim.Sim, *clock.Fake) {
	b.Helper()
	c := clock.NewFake(time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC))
	perRank := (rooms + ranks - 1) / ranks
	o := sglangsim.Options{Clock: c, DPSize: ranks, Era: sglangsim.EraNewest, Seed: 1, HookRunsWhenEmpty: true,
		// Room for the standing rooms on top of the default pools.
		MaxRunningRequests: sglangsim.DefaultMaxRunningRequests + perRank,
		KVPoolTokens:       sglangsim.DefaultKVPoolTokens + 512*perRank}
	if load == loadChurn {
		// 606 arrivals/s (what 8 simulated ranks batch comfortably at a pass
		// per 100 ms); the busiest transfer queue of a rank takes a third of
		// its traffic, at 16.5 ms a transfer on average.
		o.TransferMedian = 10 * time.Millisecond
		o.ArrivalRate = 1000 / 1.65
	}
	s, err := sglangsim.New(o)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < rooms; i++ {
		s.Submit(sglangsim.RequestSpec{Rank: i % ranks, Behavior: sglangsim.BehaviorPinAbortBeforeRegister, PromptTokens: 512})
	}
	// Bring them into the inflight queue (a prefill batch holds up to 64k
	// tokens) and, with traffic, into steady state.
	warm := 20 * time.Second
	for el := time.Duration(0); el < warm; el += 100 * time.Millisecond {
		c.Advance(100 * time.Millisecond)
		s.Step()
	}
	// Until every standing room is inflight (they never leave).
	for waited := time.Duration(0); ; waited += 250 * time.Millisecond {
		inflight := 0
		for i := 0; i < ranks; i++ {
			inflight += s.Listing(i).Queues.Inflight
		}
		if inflight >= rooms {
			break
		}
		if waited > 10*time.Minute {
			b.Fatalf("%d of %d rooms inflight after 10 minutes", inflight, rooms)
		}
		c.Advance(250 * time.Millisecond)
		s.Step()
	}
	return s, c
}

func benchWatchdog(b *testing.B, c clock.Clock, srcs []*simplugin.Source) *Watchdog {
	b.Helper()
	cfg := Config{
		// Longer than any run: no room is judged stuck (see above).
		Clock: c, Interval: time.Second, Deadline: 24 * time.Hour, StallWindow: 24 * time.Hour,
		PinWindow: 24 * time.Hour, MaxRooms: 100000, Mode: ModeAuto, MaxPerMinute: 6, ConfirmTimeout: time.Minute,
	}
	for _, s := range srcs {
		cfg.Plugins = append(cfg.Plugins, s)
	}
	w, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	return w
}

func benchCycle(b *testing.B, ranks, rooms int, load cycleLoad, wire bool) {
	s, c := benchSim(b, ranks, rooms, load)
	srcs := simplugin.New(s, wire)
	w := benchWatchdog(b, c, srcs)
	ctx := context.Background()
	advance := func() {
		// A scheduler pass per 100 ms of simulated time, one cycle a second.
		for i := 0; i < 10; i++ {
			c.Advance(100 * time.Millisecond)
			s.Step()
		}
		for _, src := range srcs {
			if err := src.Snapshot(); err != nil {
				b.Fatal(err)
			}
		}
		// The simulator's garbage is collected here, outside the timed
		// cycle: with GOMAXPROCS=1 its collection would otherwise land in
		// the cycle's CPU time (it was most of it at 1k rooms).
		runtime.GC()
	}
	// Two cycles first, so that the watchdog knows every room: the
	// benchmark measures the steady state, not the first sight.
	for i := 0; i < 2; i++ {
		advance()
		w.RunCycle(ctx)
	}
	listed := 0
	var cpu time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		advance()
		b.StartTimer()
		c0 := cputime.Process()
		w.RunCycle(ctx)
		cpu += cputime.Process() - c0
		b.StopTimer()
		w.mu.Lock()
		listed += w.tracked
		w.mu.Unlock()
		b.StartTimer()
	}
	b.StopTimer()
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(listed)/float64(b.N), "rooms")
	w.mu.Lock()
	stuck := 0
	for _, rk := range w.ranks {
		stuck += rk.stuckCount
	}
	w.mu.Unlock()
	if stuck != 0 {
		b.Fatalf("%d rooms stuck in a healthy benchmark", stuck)
	}
}

// BenchmarkRunCycleDP8Rooms1k is the first target case: DP8 with 1k rooms
// in total. Target: <= 2 ms of CPU and <= 1 MB allocated per cycle.
func BenchmarkRunCycleDP8Rooms1k(b *testing.B) {
	for _, load := range []cycleLoad{loadSteady, loadChurn} {
		b.Run(load.String(), func(b *testing.B) { benchCycle(b, 8, 1000, load, true) })
	}
}

// BenchmarkRunCycleRooms10k is the second target case: 10k rooms (DP8).
// Target: <= 20 ms per cycle.
func BenchmarkRunCycleRooms10k(b *testing.B) {
	for _, load := range []cycleLoad{loadSteady, loadChurn} {
		b.Run(load.String(), func(b *testing.B) { benchCycle(b, 8, 10000, load, true) })
	}
}

// BenchmarkRunCycleNoDecode is the DP8 cases with the listing handed over
// as a Go value: the state, decision and actuator part of the cycle alone.
func BenchmarkRunCycleNoDecode(b *testing.B) {
	for _, rooms := range []int{1000, 10000} {
		for _, load := range []cycleLoad{loadSteady, loadChurn} {
			b.Run(fmt.Sprintf("ranks=8/rooms=%d/%s", rooms, load), func(b *testing.B) { benchCycle(b, 8, rooms, load, false) })
		}
	}
}

// BenchmarkRunCycleScale is the cost-against-scale table: ranks {1,8,32} x
// rooms in total {100,1k,10k}, steady load.
func BenchmarkRunCycleScale(b *testing.B) {
	for _, ranks := range []int{1, 8, 32} {
		for _, rooms := range []int{100, 1000, 10000} {
			b.Run(fmt.Sprintf("ranks=%d/rooms=%d", ranks, rooms), func(b *testing.B) { benchCycle(b, ranks, rooms, loadSteady, true) })
		}
	}
}
