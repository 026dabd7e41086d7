package sglangsim

import (
	"testing"
	"time"
)

// BenchmarkStepDP8Inflight1k: one Step (8 rank passes) with 1000 rooms
// transferring and no new traffic.
func BenchmarkStepDP8Inflight1k(b *testing.B) {
	s, c := newSim(b, Options{DPSize: 8, Era: EraNewest})
	for i := 0; i < 1000; i++ {
		s.Submit(RequestSpec{Rank: i % 8, Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: time.Second})
	}
	for i := 0; i < 20; i++ { // one prefill batch (up to 64k tokens) per pass
		s.Step()
	}
	if n := len(s.Listing(0).Inflight); n != 125 {
		b.Fatalf("%d rooms on rank 0", n)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c.Advance(100 * time.Millisecond)
		s.Step()
	}
}

// BenchmarkStepDP8Traffic: one Step with 2500 requests/s arriving, about 1k
// inflight rooms in steady state, a pass per 100 ms of simulated time.
func BenchmarkStepDP8Traffic(b *testing.B) {
	s, c := newSim(b, Options{DPSize: 8, Era: EraNewest, ArrivalRate: 2500, SlowFraction: 0.001, Seed: 1})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	n := 0
	for i := 0; i < 8; i++ {
		n += len(s.Listing(i).Inflight)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c.Advance(100 * time.Millisecond)
		s.Step()
	}
	b.ReportMetric(float64(n), "inflight")
}

func BenchmarkMetricsTextDP8Newest(b *testing.B) {
	s, c := newSim(b, Options{DPSize: 8, Era: EraNewest, ArrivalRate: 800, Seed: 1})
	run(s, c, 30*time.Second, 100*time.Millisecond)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.SetBytes(int64(len(s.MetricsText())))
	}
}

func BenchmarkListing125Rooms(b *testing.B) {
	s, _ := newSim(b, Options{})
	for i := 0; i < 125; i++ {
		s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1})
	}
	for i := 0; i < 20; i++ {
		s.Step()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_ = s.Listing(0)
	}
}
