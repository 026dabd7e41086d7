package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// nodeHosts are the addresses of the simulated nodes: loopback addresses,
// so that every node can use the same ports, as real nodes do.
var nodeHosts = []string{"127.0.0.1", "127.0.0.2", "127.0.0.3"}

// listenNodes serves each node's ranks on its host (ranksOf(node)), the
// same metrics and plugin base port on every host; it retries with other
// ports while one is taken on some host.
func listenNodes(t *testing.T, sim *sglangsim.Sim, ranksOf func(node int) []int) (metricsPort, basePort int) {
	t.Helper()
	var last error
	for attempt := 0; attempt < 5; attempt++ {
		ctx, cancel := context.WithCancel(context.Background())
		metricsPort, basePort = freePort(t), freePort(t)
		last = nil
		for node, host := range nodeHosts {
			if _, err := sim.ListenNode(ctx, host, metricsPort, basePort, ranksOf(node)); err != nil {
				last = err
				break
			}
		}
		if last == nil {
			t.Cleanup(cancel)
			return metricsPort, basePort
		}
		cancel()
	}
	t.Fatalf("cannot serve the nodes on the same ports: %v", last)
	return 0, 0
}

var dpRankLabel = regexp.MustCompile(`dp_rank="(\d+)"`)

// dpRanksOf returns the dp_rank labels of the exposition's samples of name
// whose labels contain every one of with.
func dpRanksOf(exposition, name string, with ...string) []int {
	var out []int
	for _, line := range strings.Split(exposition, "\n") {
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		keep := true
		for _, w := range with {
			keep = keep && strings.Contains(line, w)
		}
		if m := dpRankLabel.FindStringSubmatch(line); keep && m != nil {
			dp, _ := strconv.Atoi(m[1])
			if !slices.Contains(out, dp) {
				out = append(out, dp)
			}
		}
	}
	slices.Sort(out)
	return out
}

func getVerdict(t *testing.T, base string, room uint64, rid string) pluginapi.RoomVerdict {
	t.Helper()
	v, err := pluginapi.FetchVerdict(context.Background(), http.DefaultClient, base,
		pluginapi.VerdictQuery{Room: room, RID: rid, AgeSeconds: 1000})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestMultiNodeInstanceOneSidecarPerNode runs one prefill instance on three
// simulated nodes (SGLang --nnodes 3 --tp 6 --dp 6 --enable-dp-attention:
// DP ranks 2k and 2k+1 on node k), each node's ranks and /metrics on its
// own loopback address at the same ports, with one sidecar per node started
// with the topology flags alone. Each sidecar watches exactly its node's
// ranks and /metrics and force-fails a stuck request only on its node; the
// decode sidecar's verdict lookup for a room whose prefill rank is on node
// 1 reaches node 1's sidecar, the one that released it.
func TestMultiNodeInstanceOneSidecarPerNode(t *testing.T) {
	for _, host := range nodeHosts[1:] {
		ln, err := net.Listen("tcp", host+":0")
		if err != nil {
			t.Skipf("cannot listen on %s (loopback beyond 127.0.0.1): %v", host, err)
		}
		ln.Close()
	}
	const nnodes, dpSize = 3, 6
	ranksOf := func(node int) []int { return []int{2 * node, 2*node + 1} }
	rankHosts := make([]string, dpSize)
	for r := range rankHosts {
		rankHosts[r] = nodeHosts[r/2]
	}
	sim, ctx := startSim(t, sglangsim.Options{Clock: clock.Real{}, DPSize: dpSize, Era: sglangsim.EraNewest, Seed: 11,
		HookRunsWhenEmpty: true, RankHosts: rankHosts})
	metricsPort, basePort := listenNodes(t, sim, ranksOf)
	decodeMetricsURL, decodeURLs, err := sim.ListenDecode(ctx)
	if err != nil {
		t.Fatal(err)
	}
	timing := []string{"--sglang.metrics-interval=1s", "--watchdog.interval=200ms", "--watchdog.deadline=2s",
		"--watchdog.stall-window=1s", "--force-fail.mode=auto"}
	// Every node's sidecar listens on the same port of its own address.
	sidecarPort := freePort(t)
	sidecars := make([]*watchdogProc, nnodes)
	for node, host := range nodeHosts {
		sidecars[node] = startWatchdogAt(t, host, sidecarPort, append([]string{
			"--sglang.nnodes=" + strconv.Itoa(nnodes), "--sglang.node-rank=" + strconv.Itoa(node),
			"--sglang.tp-size=6", "--sglang.dp-size=6", "--sglang.enable-dp-attention",
			"--plugin.base-port=" + strconv.Itoa(basePort), "--plugin.host=" + host,
			fmt.Sprintf("--sglang.metrics-url=http://%s/metrics", net.JoinHostPort(host, strconv.Itoa(metricsPort)))},
			timing...)...)
	}
	decodeSidecar := startWatchdog(t, append([]string{"--plugin.url=" + decodeURLs[0], "--sglang.metrics-url=" + decodeMetricsURL,
		"--watchdog.decode-deadline=3s", "--decode.prefill-watchdog-url=http://{host}:" + strconv.Itoa(sidecarPort)}, timing...)...)

	for node, s := range sidecars {
		want := ranksOf(node)
		waitFor(t, fmt.Sprintf("node %d's sidecar watching its ranks and reading its /metrics", node), 20*time.Second, func() bool {
			m := s.metrics(t)
			return slices.Equal(dpRanksOf(m, "sglang_watchdog_rank_targets", `role="prefill"`), want) &&
				slices.Equal(dpRanksOf(m, "sglang_watchdog_queue_requests", `source="metrics"`), want)
		})
		m := s.metrics(t)
		if got := dpRanksOf(m, "sglang_watchdog_rank_targets"); !slices.Equal(got, want) {
			t.Errorf("node %d's sidecar watches the plugins of DP ranks %v, want %v", node, got, want)
		}
		if got := dpRanksOf(m, "sglang_watchdog_queue_requests", `source="metrics"`); !slices.Equal(got, want) {
			t.Errorf("node %d's sidecar reads the /metrics of DP ranks %v, want %v", node, got, want)
		}
	}

	// A stuck request on DP rank 3, on node 1.
	rid, room := sim.Inject(3, sglangsim.PinResurrection)
	record := func() sglangsim.Record {
		for _, r := range sim.Records() {
			if r.RID == rid {
				return r
			}
		}
		return sglangsim.Record{}
	}
	waitFor(t, "the stuck request on node 1 force-failed", 30*time.Second, func() bool {
		return record().Outcome == sglangsim.OutcomeFailedForced
	})
	released := `sglang_watchdog_force_fails_total{result="released",role="prefill",trigger="auto"} 1`
	waitFor(t, "node 1's sidecar counting its release", 10*time.Second, func() bool { return sidecars[1].has(t, released) })
	for _, node := range []int{0, 2} {
		if m := sidecars[node].metrics(t); strings.Contains(m, `result="released",role="prefill"`) && !strings.Contains(m, `result="released",role="prefill",trigger="auto"} 0`) {
			t.Errorf("node %d's sidecar released a request of another node:\n%s", node, grep(m, "force_fails_total"))
		}
	}
	if v := getVerdict(t, sidecars[1].base, room, rid); v.Verdict != pluginapi.VerdictStopped {
		t.Errorf("node 1's sidecar answers %+v for the room it released, want stopped", v)
	}
	if v := getVerdict(t, sidecars[0].base, room, rid); v.Verdict != pluginapi.VerdictUnknown {
		t.Errorf("node 0's sidecar answers %+v for a room of node 1, want unknown", v)
	}

	// Decode names node 1's rank; its sidecar's "stopped" releases the
	// decode request, which waited with its transfer started.
	waitFor(t, "the decode request released on node 1's verdict", 30*time.Second, func() bool {
		return !record().DecodeForcedAt.IsZero()
	})
	if r := record(); r.UnsafeFree != "" {
		t.Errorf("decode freed the pages under a live transfer: %s", r.UnsafeFree)
	}
	if m := decodeSidecar.metrics(t); !strings.Contains(m, `sglang_watchdog_prefill_verdict_lookups_total{verdict="stopped"}`) {
		t.Errorf("decode's lookups never answered stopped:\n%s", grep(m, "prefill_verdict_lookups_total"))
	}
}

// grep returns the lines of s that contain sub.
func grep(s, sub string) string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, sub) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}
