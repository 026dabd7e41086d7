package pluginapi

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"
)

// benchListing builds a listing of n rooms shaped like a real one: 32-hex
// rids, full 64-bit rooms, the default bootstrap address, mostly
// Transferring, ages up to a minute, a health check every 100 rooms.
func benchListing(n int) []byte {
	rng := rand.New(rand.NewPCG(1, 2))
	l := Listing{
		APIVersion: APIVersion,
		Server:     Server{PID: 4242, DPRank: 3, DisaggregationMode: "prefill", TransferBackend: "nixl", SGLangVersion: "0.6.0"},
		NowUnix:    1764403200.123,
		Loop:       Loop{Iterations: 123456789, LastIterationUnix: 1764403200.121},
		Queues:     Queues{Bootstrap: 3, Waiting: 7, Inflight: n},
		Inflight:   make([]Room, n),
	}
	polls := []string{PollTransferring, PollTransferring, PollTransferring, PollWaitingForInput}
	for i := range l.Inflight {
		r := Room{
			RID:           fmt.Sprintf("%016x%016x", rng.Uint64(), rng.Uint64()),
			BootstrapRoom: rng.Uint64(),
			BootstrapAddr: "10.0.0.7:8998",
			Poll:          polls[i%len(polls)],
			AgeSeconds:    rng.Float64() * 60,
			PromptTokens:  64 + rng.IntN(8000),
			Progress:      rng.Int64N(40),
		}
		if i%100 == 99 {
			r = Room{RID: fmt.Sprintf("HEALTH_CHECK_%.6f", 1764403200+rng.Float64()), BootstrapAddr: "2.2.2.2:8998",
				Poll: PollSuccess, AgeSeconds: 0.001, PromptTokens: 1, Progress: -1, HealthCheck: true}
		}
		l.Inflight[i] = r
	}
	b, err := json.Marshal(&l)
	if err != nil {
		panic(err)
	}
	return b
}

// BenchmarkDecodeListing decodes and validates one rank's listing of 100,
// 1k and 10k rooms (the client's work after reading the body).
//
//	go test -run '^$' -bench DecodeListing -benchmem ./pluginapi
func BenchmarkDecodeListing(b *testing.B) {
	for _, n := range []int{100, 1000, 10000} {
		body := benchListing(n)
		b.Run(fmt.Sprintf("rooms=%d", n), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				l, err := DecodeListing(body)
				if err != nil || len(l.Inflight) != n {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(body))/float64(n), "bytes/room")
		})
	}
}
