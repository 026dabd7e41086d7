// Command footprint measures the resident memory (and CPU) of the real
// sglang-watchdog binary while it watches a simulated DP8 SGLang prefill
// server on loopback, in real time.
//
//	go run ./bench/footprint -duration 10m
//
// It runs the simulator in-process (sglangsim, real clock, DP8, newest label
// era, Poisson traffic with heavy-tailed transfers, slow-but-progressing
// requests, health checks, and one pin injected every -pin-every, rotating
// over the ranks and the pin mechanisms of -era: a stuck transfer handle,
// the only one SGLang's releases have, and with -era forks also the two
// read in code outside them), builds the watchdog with
// scripts/build.sh (the shipped static build; -build go for a plain
// `go build -o`) into a temporary directory, starts it in auto mode with the
// default windows against the simulator's /metrics and plugin URLs, and
// samples /proc/<pid>/status (VmRSS, VmHWM), /proc/<pid>/stat (CPU) and the
// watchdog's own /metrics every -sample. It prints a table row every -print
// and a summary at the end. Only 127.0.0.1 is used.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

func main() {
	duration := flag.Duration("duration", 10*time.Minute, "how long to watch")
	sampleEvery := flag.Duration("sample", 5*time.Second, "how often RSS and the watchdog's metrics are sampled")
	printEvery := flag.Duration("print", time.Minute, "how often a table row is printed")
	ranks := flag.Int("ranks", 8, "simulated DP ranks")
	rate := flag.Float64("rate", 500, "healthy arrivals per second over all ranks")
	// A load the serial transfer workers keep up with: DP8 has 32 of them,
	// each taking its queue one transfer at a time. At 500 requests/s a
	// 1 s median, or 0.2% slow requests (about 90 transfers of 30-150 s at
	// once), saturates them, every room waits behind live chunks, and no
	// pin reaches its deadline within a run.
	median := flag.Duration("median", 20*time.Millisecond, "median KV transfer time (lognormal, sigma 1)")
	slow := flag.Float64("slow", 0.0001, "fraction of slow-but-progressing requests (30-150 s)")
	pinEvery := flag.Duration("pin-every", time.Minute, "inject one pin this often (0: none)")
	era := flag.String("era", "releases", "the SGLang code the pins model: releases (v0.4.6 to v0.5.18 and upstream main: stuck handles only) or forks (resurrection and abort-before-register too, which only code outside those releases pins by)")
	seed := flag.Int64("seed", 1, "simulator seed")
	bin := flag.String("bin", "", "watchdog binary to run (default: build one into a temp dir from -repo, see -build)")
	buildHow := flag.String("build", "script", "how to build: script (scripts/build.sh, the shipped static -s -w build) or go (plain go build -o)")
	gogc := flag.String("gogc", "", "GOGC for the watchdog (empty: unset)")
	memlimit := flag.String("gomemlimit", "", "GOMEMLIMIT for the watchdog (empty: unset)")
	repo := flag.String("repo", ".", "module root to build the watchdog from")
	keep := flag.Bool("keep", false, "keep the temp dir (binary and the watchdog's log)")
	flag.Parse()
	pinEra = *era
	switch *era {
	case "releases":
		pinKinds = []sglangsim.PinKind{sglangsim.PinStuckHandle}
	case "forks":
		pinKinds = []sglangsim.PinKind{sglangsim.PinResurrection, sglangsim.PinAbortBeforeRegister, sglangsim.PinStuckHandle}
	default:
		fmt.Fprintf(os.Stderr, "-era: unknown era %q (want releases or forks)\n", *era)
		os.Exit(2)
	}
	extraEnv = nil
	if *gogc != "" {
		extraEnv = append(extraEnv, "GOGC="+*gogc)
	}
	if *memlimit != "" {
		extraEnv = append(extraEnv, "GOMEMLIMIT="+*memlimit)
	}
	os.Exit(run(*duration, *sampleEvery, *printEvery, *ranks, *rate, *median, *slow, *pinEvery, *seed, *bin, *buildHow, *repo, *keep))
}

// extraEnv is added to the watchdog's environment.
var extraEnv []string

// pinKinds are the mechanisms the injected pins rotate over, those of
// pinEra (-era).
var (
	pinKinds []sglangsim.PinKind
	pinEra   string
)

func run(duration, sampleEvery, printEvery time.Duration, ranks int, rate float64, median time.Duration, slow float64,
	pinEvery time.Duration, seed int64, bin, buildHow, repo string, keep bool) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	dir, err := os.MkdirTemp("", "wd-footprint-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if !keep {
		defer os.RemoveAll(dir)
	} else {
		fmt.Printf("temp dir: %s\n", dir)
	}
	if bin == "" {
		bin = filepath.Join(dir, "sglang-watchdog")
		build := exec.Command("go", "build", "-o", bin, ".")
		if buildHow == "script" {
			build = exec.Command("bash", "scripts/build.sh", bin)
		}
		build.Dir = repo
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		t0 := time.Now()
		if err := build.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "go build: %v\n", err)
			return 1
		}
		fmt.Printf("built %s (%s build) in %s\n", bin, buildHow, time.Since(t0).Round(100*time.Millisecond))
	}

	sim, err := sglangsim.New(sglangsim.Options{
		Clock: clock.Real{}, DPSize: ranks, Era: sglangsim.EraNewest, Seed: seed,
		ArrivalRate: rate, TransferMedian: median, SlowFraction: slow,
		HealthCheckEvery: 10 * time.Second, HookRunsWhenEmpty: true,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	simCtx, simCancel := context.WithCancel(ctx)
	defer simCancel()
	sim.Start(simCtx)
	metricsURL, pluginURLs, err := sim.Listen(simCtx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}

	port, err := freePort()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	listen := fmt.Sprintf("127.0.0.1:%d", port)
	args := []string{"run", "--web.listen-address=" + listen, "--sglang.metrics-url=" + metricsURL, "--force-fail.mode=auto"}
	for _, u := range pluginURLs {
		args = append(args, "--plugin.url="+u)
	}
	logPath := filepath.Join(dir, "watchdog.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer logFile.Close()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(cleanEnv(), extraEnv...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	pid := cmd.Process.Pid
	// exited is closed once the watchdog has exited, with waitErr set: a
	// closed channel tells the sampling loop and the stop below alike (a
	// value sent once would leave the stop waiting for ever after the loop
	// took it).
	var waitErr error
	exited := make(chan struct{})
	go func() { waitErr = cmd.Wait(); close(exited) }()
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}()

	if pinEvery > 0 {
		go injectPins(simCtx, sim, pinEvery, pinKinds)
	}

	fmt.Printf("machine: %d CPUs, %s; simulator: DP%d newest era, %.0f req/s, median transfer %s, slow %.3f, a pin every %s (pin era %s)\n",
		nproc(), cpuModel(), ranks, rate, median, slow, pinEvery, pinEra)
	st, _ := os.Stat(bin)
	var size int64
	if st != nil {
		size = st.Size()
	}
	fmt.Printf("watchdog pid %d (binary %.1f MiB, env %v): %s %s\n\n", pid, float64(size)/(1<<20), extraEnv, filepath.Base(bin), strings.Join(args, " "))
	fmt.Printf("%8s %9s %9s %8s %8s %9s %9s %7s %9s %8s %9s %8s\n",
		"elapsed", "VmRSS MiB", "VmHWM MiB", "anon MiB", "file MiB", "heap MiB", "CPU s", "CPU %", "sim rooms", "tracked", "cycle ms", "released")

	start := time.Now()
	client := &http.Client{Timeout: 2 * time.Second}
	var maxRSS, lastRSS, lastHWM float64
	var lastCPU float64
	tick := time.NewTicker(sampleEvery)
	defer tick.Stop()
	nextPrint := start.Add(printEvery)
	end := start.Add(duration)
	for {
		select {
		case <-ctx.Done():
			fmt.Println("interrupted")
			return 1
		case <-exited:
			fmt.Printf("the watchdog exited early: %v (log: %s)\n", waitErr, logPath)
			keepLog(logPath)
			return 1
		case now := <-tick.C:
			rss, hwm, anon, file, err := procStatus(pid)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				continue
			}
			cpu, _ := procCPU(pid)
			lastRSS, lastHWM, lastCPU = rss, hwm, cpu
			if rss > maxRSS {
				maxRSS = rss
			}
			if !now.Before(nextPrint) || !now.Before(end) {
				nextPrint = nextPrint.Add(printEvery)
				m := scrape(client, "http://"+listen+"/metrics")
				rooms := 0
				for i := 0; i < sim.Ranks(); i++ {
					rooms += len(sim.Listing(i).Inflight)
				}
				el := now.Sub(start)
				row := fmt.Sprintf("%8s %9.1f %9.1f %8.1f %8.1f %9.1f %9.2f %7.2f %9d %8.0f %9.2f %8.0f",
					el.Round(time.Second), rss/1024, hwm/1024, anon/1024, file/1024, m["go_memstats_heap_inuse_bytes"]/(1<<20), cpu,
					100*cpu/el.Seconds(), rooms, m["sglang_watchdog_tracked_rooms"],
					1000*m["sglang_watchdog_last_cycle_duration_seconds"], m[`sglang_watchdog_force_fails_total{result="released",trigger="auto"}`])
				fmt.Println(row)
			}
			if !now.Before(end) {
				summary(sim, lastRSS, lastHWM, maxRSS, lastCPU, duration, logPath)
				return 0
			}
		}
	}
}

func summary(sim *sglangsim.Sim, rss, hwm, maxRSS, cpu float64, d time.Duration, logPath string) {
	pins, released, forcedProgressing := 0, 0, 0
	for _, r := range sim.Records() {
		if r.Kind.Pin() {
			pins++
			if r.Outcome == sglangsim.OutcomeFailedForced {
				released++
			}
		}
		if r.ProgressingWhenForced {
			forcedProgressing++
		}
	}
	calls, confirmed := countLog(logPath)
	const target = 20.0
	verdict := func(kib float64) string {
		if kib/1024 > target {
			return "MISSED"
		}
		return "met"
	}
	fmt.Printf("\nsummary after %s: VmRSS %.1f MiB (max sampled %.1f MiB), VmHWM %.1f MiB; target <= %.0f MiB: VmRSS at the end %s, VmHWM %s\n",
		d, rss/1024, maxRSS/1024, hwm/1024, target, verdict(rss), verdict(hwm))
	fmt.Printf("CPU: %.2f s over %s = %.2f%% of one core\n", cpu, d, 100*cpu/d.Seconds())
	fmt.Printf("pins injected %d, released by the watchdog %d (older pins may still be inside their 60 s deadline); force-fail calls %d, confirmed releases %d; progressing requests force-failed: %d\n",
		pins, released, calls, confirmed, forcedProgressing)
}

func countLog(path string) (calls, confirmed int) {
	f, err := os.Open(path)
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if strings.Contains(l, `msg="force-fail call"`) {
			calls++
		}
		if strings.Contains(l, `msg="release confirmed"`) {
			confirmed++
		}
	}
	return calls, confirmed
}

func keepLog(path string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	fmt.Printf("--- last lines of the watchdog's log ---\n%s\n", b)
}

func injectPins(ctx context.Context, sim *sglangsim.Sim, every time.Duration, kinds []sglangsim.PinKind) {
	t := time.NewTicker(every)
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			sim.Inject(i%sim.Ranks(), kinds[i%len(kinds)])
		}
	}
}

// cleanEnv drops the watchdog's own environment variables, which would
// otherwise set its flags.
func cleanEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SGLANG_WATCHDOG_") && !strings.HasPrefix(kv, "GOGC=") && !strings.HasPrefix(kv, "GOMEMLIMIT=") {
			out = append(out, kv)
		}
	}
	return out
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// procStatus returns VmRSS and VmHWM in KiB, and the VmRSS split into
// anonymous memory (heap, stacks, runtime) and file-backed pages (mostly the
// binary's own text and data).
func procStatus(pid int) (rss, hwm, anon, file float64, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, 0, 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		v, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "VmRSS:":
			rss = v
		case "VmHWM:":
			hwm = v
		case "RssAnon:":
			anon = v
		case "RssFile:":
			file = v
		}
	}
	return rss, hwm, anon, file, nil
}

// procCPU returns utime+stime in seconds.
func procCPU(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("bad stat")
	}
	f := strings.Fields(s[i+1:])
	// Fields after the command: state is f[0]; utime is field 14, stime 15
	// (1-based over the whole line), i.e. f[11] and f[12].
	if len(f) < 13 {
		return 0, fmt.Errorf("short stat")
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100, nil // USER_HZ is 100 on Linux
}

// scrape reads unlabelled (or exactly labelled) sample values from a text
// exposition, keyed by the series as written.
func scrape(c *http.Client, url string) map[string]float64 {
	out := map[string]float64{}
	resp, err := c.Get(url)
	if err != nil {
		return out
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, l := range strings.Split(string(b), "\n") {
		if l == "" || l[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(l, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(l[i+1:], 64)
		if err != nil {
			continue
		}
		out[l[:i]] = v
	}
	return out
}

func nproc() int {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return 0
	}
	return strings.Count(string(b), "\nprocessor") + 1
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "?"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "model name") {
			if _, v, ok := strings.Cut(l, ":"); ok {
				return strings.TrimSpace(v)
			}
		}
	}
	return "?"
}
