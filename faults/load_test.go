//go:build load

package faults

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// rssBytes reads VmRSS of this process.
func rssBytes() uint64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

// TestLoad64Ranks1kRooms: 64 simulated prefill ranks with 1000 inflight
// rooms each (slow transfers that keep sending chunks, so nothing is
// stuck), plus 64 healthy requests a second coming and going, listed every
// second by the real Run loop on the real clock, SGLang's /metrics every
// 15 s, for LOAD_DURATION (default 5m). It prints RSS, heap and cycle
// figures every 30 s and checks that memory stays flat and every cycle
// ends within the interval.
//
//	go test -tags load -run Load -timeout 10m -v ./faults/
//
// The simulator runs in the same process: RSS includes its 64k requests
// (it also keeps a record per request, about 80 bytes each, a slow growth
// of its own).
func TestLoad64Ranks1kRooms(t *testing.T) {
	duration := 5 * time.Minute
	if s := os.Getenv("LOAD_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatal(err)
		}
		duration = d
	}
	const ranks, rooms = 64, 1000
	sim, err := sglangsim.New(sglangsim.Options{Clock: clock.Real{}, DPSize: ranks, Seed: 1,
		ArrivalRate: ranks, TransferMedian: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for r := 0; r < ranks; r++ {
		for i := 0; i < rooms; i++ {
			sim.Submit(sglangsim.RequestSpec{Rank: r, Behavior: sglangsim.BehaviorSlow, Transfer: -1})
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	metricsURL, pluginURLs, err := sim.Listen(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The scheduler loops: a pass of every rank every 200 ms.
	go func() {
		tk := time.NewTicker(200 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
				sim.Step()
			}
		}
	}()
	sim.Step()

	logs := &syncBuffer{}
	logCfg, _ := logging.ParseConfig("info", "")
	logger := logging.New(logs, logCfg)
	cfg := productionConfig()
	cfg.Mode = watchdog.ModeDryRun
	cfg.Clock = clock.Real{}
	cfg.Logger = logger
	cfg.Metrics = collector.NewMetricsScraper(metricsURL, defaultMetricsTimeout)
	var probes []*probedPlugin
	for _, u := range pluginURLs {
		p := &probedPlugin{PluginSource: pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: defaultPluginTimeout, AdminTimeout: defaultAdminTimeout})}
		probes = append(probes, p)
		cfg.Plugins = append(cfg.Plugins, p)
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		t.Fatal(err)
	}

	var mu sync.Mutex
	var cycles []time.Duration // every distinct LastCycle seen
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		wd.Run(runCtx)
	}()
	go func() {
		var last time.Duration
		for runCtx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
			if c := wd.Snapshot().LastCycle; c != last && c != 0 {
				last = c
				mu.Lock()
				cycles = append(cycles, c)
				mu.Unlock()
			}
		}
	}()

	type sample struct {
		at                  time.Duration
		rss, heap, heapSys  uint64
		goroutines, tracked int
		cycles              []time.Duration
	}
	var samples []sample
	start := time.Now()
	seen := 0
	fmt.Printf("load: %d ranks x %d rooms, interval %s, for %s on %d CPUs, %s\n", ranks, rooms, cfg.Interval, duration, runtime.NumCPU(), runtime.Version())
	fmt.Printf("| t (s) | RSS (MiB) | heap in use (MiB) | heap sys (MiB) | goroutines | tracked rooms | cycles | p50 cycle | p99 cycle | max cycle |\n")
	fmt.Printf("|---|---|---|---|---|---|---|---|---|---|\n")
	for elapsed := time.Duration(0); elapsed < duration; elapsed = time.Since(start) {
		time.Sleep(min(30*time.Second, duration-elapsed))
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		mu.Lock()
		window := append([]time.Duration(nil), cycles[seen:]...)
		seen = len(cycles)
		mu.Unlock()
		s := sample{at: time.Since(start).Round(time.Second), rss: rssBytes(), heap: ms.HeapInuse, heapSys: ms.HeapSys,
			goroutines: runtime.NumGoroutine(), tracked: wd.Snapshot().TrackedRooms, cycles: window}
		samples = append(samples, s)
		fmt.Printf("| %d | %d | %d | %d | %d | %d | %d | %s | %s | %s |\n", int(s.at.Seconds()), s.rss>>20, s.heap>>20, s.heapSys>>20,
			s.goroutines, s.tracked, len(window), percentile(window, 0.5).Round(time.Millisecond),
			percentile(window, 0.99).Round(time.Millisecond), percentile(window, 1).Round(time.Millisecond))
	}
	stop()
	<-done

	mu.Lock()
	all := append([]time.Duration(nil), cycles...)
	mu.Unlock()
	reads := 0
	maxActive := 0
	for _, p := range probes {
		a, starts, _ := p.snapshot()
		reads += len(starts)
		maxActive = max(maxActive, a)
	}
	fmt.Printf("cycles: %d sampled, p50 %s, p99 %s, max %s; listing reads %d (%.1f per rank per second); max concurrent reads per rank %d\n",
		len(all), percentile(all, 0.5).Round(time.Millisecond), percentile(all, 0.99).Round(time.Millisecond),
		percentile(all, 1).Round(time.Millisecond), reads, float64(reads)/float64(ranks)/time.Since(start).Seconds(), maxActive)
	failures := strings.Count(logs.String(), "level=error")
	fmt.Printf("error log lines: %d\n", failures)

	if percentile(all, 1) >= cfg.Interval {
		t.Errorf("a cycle took %s, not within the %s interval", percentile(all, 1), cfg.Interval)
	}
	if maxActive > 1 {
		t.Errorf("%d concurrent listing reads of one rank: cycles overlapped", maxActive)
	}
	if len(samples) >= 3 {
		first, last := samples[1], samples[len(samples)-1] // the first sample still warms up
		if last.rss > first.rss+first.rss/5+16<<20 {
			t.Errorf("RSS grew from %d MiB to %d MiB", first.rss>>20, last.rss>>20)
		}
	}
	if s := samples[len(samples)-1]; s.tracked < ranks*rooms {
		t.Errorf("tracked %d rooms, want at least %d", s.tracked, ranks*rooms)
	}
	if failures > 0 {
		t.Errorf("%d error log lines under load:\n%s", failures, tail(logs.String(), 2000))
	}
}
