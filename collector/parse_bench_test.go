package collector

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/sglang-watchdog/sglang-watchdog/bench/cputime"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// Benchmarks of reading SGLang's /metrics: the payload is rendered by
// sglangsim in the newest label era after 30 s of simulated traffic on every
// rank (so every scheduler emits every family, histograms included), for 1
// rank and for DP8 (about 3k series, 0.6 MB).
//
//	go test -run '^$' -bench . -benchmem ./collector

var benchPayloads = map[int][2][]byte{}

// benchPayload returns two consecutive /metrics bodies of a DP`ranks`
// server, 15 s of traffic apart.
func benchPayload(b *testing.B, ranks int) [2][]byte {
	b.Helper()
	if p, ok := benchPayloads[ranks]; ok {
		return p
	}
	c := clock.NewFake(time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC))
	s, err := sglangsim.New(sglangsim.Options{Clock: c, DPSize: ranks, Era: sglangsim.EraNewest, Seed: 1,
		ArrivalRate: 100 * float64(ranks), SlowFraction: 0.01, HealthCheckEvery: 10 * time.Second, HookRunsWhenEmpty: true})
	if err != nil {
		b.Fatal(err)
	}
	step := func(d time.Duration) {
		for el := time.Duration(0); el < d; el += 100 * time.Millisecond {
			c.Advance(100 * time.Millisecond)
			s.Step()
		}
	}
	step(30 * time.Second)
	var p [2][]byte
	p[0] = s.MetricsText()
	step(15 * time.Second)
	p[1] = s.MetricsText()
	benchPayloads[ranks] = p
	return p
}

func seriesLines(body []byte) int {
	n := 0
	for _, l := range bytes.Split(body, []byte("\n")) {
		if len(l) > 0 && l[0] != '#' {
			n++
		}
	}
	return n
}

var benchRanks = []struct {
	name  string
	ranks int
}{{"rank1", 1}, {"dp8", 8}}

// BenchmarkParseMetrics is collector.ParseMetrics: the byte-level pre-pass
// and expfmt on the kept lines.
func BenchmarkParseMetrics(b *testing.B) {
	for _, rc := range benchRanks {
		body := benchPayload(b, rc.ranks)[0]
		b.Run(rc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				s, err := ParseMetrics(body)
				if err != nil || len(s.Gauges) == 0 {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(seriesLines(body)), "series")
		})
	}
}

// BenchmarkFilterFamilies is the pre-pass alone.
func BenchmarkFilterFamilies(b *testing.B) {
	for _, rc := range benchRanks {
		body := benchPayload(b, rc.ranks)[0]
		b.Run(rc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			kept := 0
			for i := 0; i < b.N; i++ {
				out, _ := filterFamilies(body)
				kept = seriesLinesCount(out)
			}
			b.ReportMetric(float64(kept), "kept-lines")
		})
	}
}

func seriesLinesCount(b []byte) int { return bytes.Count(b, []byte("\n")) }

// BenchmarkParseFullExpfmt parses the whole payload with expfmt's
// TextParser, what the pre-pass avoids (performance-notes: about 20x).
func BenchmarkParseFullExpfmt(b *testing.B) {
	for _, rc := range benchRanks {
		body := benchPayload(b, rc.ranks)[0]
		b.Run(rc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				p := expfmt.NewTextParser(model.UTF8Validation)
				fams, err := p.TextToMetricFamilies(bytes.NewReader(body))
				if err != nil || len(fams) == 0 {
					b.Fatal(err)
				}
			}
		})
	}
}

// sampleSource hands the watchdog a sample: either pre-parsed (the fold
// alone) or parsed from the body on each read (parse and fold).
type sampleSource struct {
	bodies  [2][]byte
	samples [2]*watchdog.MetricsSample
	parse   bool
	n       int
}

func (s *sampleSource) Target() string { return "bench" }

func (s *sampleSource) Scrape(context.Context) (*watchdog.MetricsSample, error) {
	i := s.n % 2
	s.n++
	if s.parse {
		return ParseMetrics(s.bodies[i])
	}
	return s.samples[i], nil
}

// BenchmarkScrapeFold is watchdog.ScrapeMetrics with the body already read:
// "fold" takes a parsed sample (state update, pinned-gauge evaluation,
// confirmations), "parse+fold" parses the body first. The two bodies
// alternate, so gauges and counters change on every read.
func BenchmarkScrapeFold(b *testing.B) {
	for _, rc := range benchRanks {
		p := benchPayload(b, rc.ranks)
		for _, parse := range []bool{false, true} {
			name := rc.name + "/fold"
			if parse {
				name = rc.name + "/parse+fold"
			}
			b.Run(name, func(b *testing.B) {
				src := &sampleSource{bodies: p, parse: parse}
				for i := range p {
					s, err := ParseMetrics(p[i])
					if err != nil {
						b.Fatal(err)
					}
					src.samples[i] = s
				}
				c := clock.NewFake(time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC))
				w, err := watchdog.New(watchdog.Config{Clock: c, Metrics: src, Interval: time.Second, MetricsInterval: 15 * time.Second,
					Deadline: time.Minute, StallWindow: 30 * time.Second, PinWindow: 2 * time.Minute, MaxRooms: 100000,
					Mode: watchdog.ModeAuto, MaxPerMinute: 6, ConfirmTimeout: time.Minute})
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				w.ScrapeMetrics(ctx)
				var cpu time.Duration
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					c.Advance(15 * time.Second)
					c0 := cputime.Process()
					w.ScrapeMetrics(ctx)
					cpu += cputime.Process() - c0
				}
				b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
			})
		}
	}
}
