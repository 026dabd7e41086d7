package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/internal/memlimit"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// sidecarMemoryLimit is a small sidecar's limits.memory: 64 MiB, what the
// sizing rule gives 16,384 rooms (memlimit.RoomsFor; the manifests give
// 228 MiB for the default 100,000). The bodies' caps must fit it too. The
// binary gives the Go runtime memlimit.Ratio of it.
const sidecarMemoryLimit = 64 << 20

// peakRSS reads VmHWM (peak resident set) of a process, in bytes.
func peakRSS(pid int) (uint64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}

// bigMetrics is a /metrics body just under the scraper's limit made only of
// lines its pre-filter keeps: the parser's worst case.
func bigMetrics() []byte {
	var b bytes.Buffer
	b.WriteString("# TYPE sglang:num_prefill_inflight_queue_reqs gauge\n")
	for i := 0; b.Len() < collector.DefaultMaxMetricsBytes-200; i++ {
		fmt.Fprintf(&b, "sglang:num_prefill_inflight_queue_reqs{dp_rank=\"%d\",tp_rank=\"0\",pp_rank=\"0\"} 1\n", i)
	}
	return b.Bytes()
}

// bigListing is a valid listing just under the client's limit.
func bigListing(dp int) []byte {
	l := pluginapi.Listing{APIVersion: pluginapi.APIVersion, Server: pluginapi.Server{DPRank: dp}, Loop: pluginapi.Loop{Iterations: 1}}
	room := pluginapi.Room{BootstrapAddr: "10.0.0.7:8998", Poll: pluginapi.PollTransferring, AgeSeconds: 1, PromptTokens: 4096, Progress: 3}
	size := 200
	for i := 0; size < pluginapi.DefaultMaxBodyBytes-400; i++ {
		room.RID = fmt.Sprintf("%032x", i)
		room.BootstrapRoom = uint64(i) * 0x9E3779B97F4A7C15
		l.Inflight = append(l.Inflight, room)
		size += 215
	}
	b, _ := json.Marshal(l)
	for len(b) > pluginapi.DefaultMaxBodyBytes {
		l.Inflight = l.Inflight[:len(l.Inflight)-100]
		b, _ = json.Marshal(l)
	}
	return b
}

// TestBinaryStaysUnderItsMemoryLimit runs the built binary with the Go
// memory limit it sets itself in the sidecar (GOMEMLIMIT stands in for the
// cgroup limit it would read there) against sources that answer with bodies just under
// the watchdog's own caps (collector.DefaultMaxMetricsBytes of /metrics
// made only of watched lines, pluginapi.DefaultMaxBodyBytes per listing,
// two ranks as in the manifests), and reads its peak RSS. With 32 MiB and
// 16 MiB the caps were far above a 64 MiB sidecar: such a body gets the
// sidecar OOM-killed, and a
// crash-looping watchdog watches nothing.
func TestBinaryStaysUnderItsMemoryLimit(t *testing.T) {
	bin := binary
	// As memlimit.Set computes it (from a variable: the constant product
	// is not an integer, which a constant conversion refuses).
	limit := int64(sidecarMemoryLimit)
	goMemLimit := int64(float64(limit) * memlimit.Ratio)
	serve := func(body []byte, contentType string) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", contentType)
			_, _ = w.Write(body)
		}))
		t.Cleanup(srv.Close)
		return srv.URL
	}
	small := serve([]byte("# TYPE sglang:num_requests_total counter\nsglang:num_requests_total 1\n"), "text/plain")
	listing0 := []byte(`{"api_version":1,"server":{},"loop":{"iterations":1},"queues":{},"inflight":[]}`)
	for _, tc := range []struct {
		name     string
		metrics  string
		listings []string
	}{
		{"baseline", small + "/metrics", []string{serve(listing0, "application/json"), serve(listing0, "application/json")}},
		{"a full /metrics of watched lines", serve(bigMetrics(), "text/plain") + "/metrics", nil},
		{"two full listings", small + "/metrics", []string{serve(bigListing(0), "application/json"), serve(bigListing(1), "application/json")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"--web.listen-address=127.0.0.1:0", "--sglang.metrics-url=" + tc.metrics,
				"--sglang.metrics-interval=3s", "--sglang.timeout=2500ms", "--plugin.timeout=900ms", "--force-fail.mode=off"}
			for _, u := range tc.listings {
				args = append(args, "--plugin.url="+u)
			}
			cmd := exec.Command(bin, args...)
			cmd.Env = append(os.Environ(), fmt.Sprintf("GOMEMLIMIT=%d", goMemLimit), "GOMAXPROCS=2")
			var logs bytes.Buffer
			cmd.Stdout, cmd.Stderr = &logs, &logs
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(12 * time.Second)
			peak, err := peakRSS(cmd.Process.Pid)
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: peak RSS %d MiB", tc.name, peak>>20)
			if peak > sidecarMemoryLimit {
				t.Errorf("%s: peak RSS %d MiB, over the sidecar's %d MiB limit", tc.name, peak>>20, sidecarMemoryLimit>>20)
			}
		})
	}
}
