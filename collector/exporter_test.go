package collector

import (
	"bytes"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

var update = flag.Bool("update", false, "rewrite golden files")

func goldenSnapshot() watchdog.Snapshot {
	ff := map[[2]string]uint64{}
	for _, r := range watchdog.Results {
		for _, tr := range watchdog.Triggers {
			ff[[2]string{r, tr}] = 0
		}
	}
	ff[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}] = 3
	ff[[2]string{watchdog.ResultWouldFlip, watchdog.TriggerAuto}] = 1
	skips := map[string]uint64{}
	for _, r := range watchdog.SkipReasons {
		skips[r] = 0
	}
	skips[watchdog.SkipRateLimited] = 2
	byPoll := map[string]int{}
	for _, p := range pluginapi.PollStates {
		byPoll[p] = 0
	}
	byPoll[pluginapi.PollTransferring] = 2
	byPoll[pluginapi.PollWaitingForInput] = 1
	return watchdog.Snapshot{
		Mode: watchdog.ModeAuto,
		Sources: []watchdog.SourceStatus{
			{Source: "metrics", Target: "http://127.0.0.1:30000/metrics", Up: true, Duration: 12 * time.Millisecond, Failures: 1},
			{Source: "plugin", Target: "http://127.0.0.1:30100", Up: true, Duration: 2 * time.Millisecond},
			{Source: "plugin", Target: "http://127.0.0.1:30101", Up: false, Duration: 800 * time.Millisecond, Failures: 4},
		},
		Ranks: []watchdog.RankSnapshot{{
			Target: "http://127.0.0.1:30100", TransferWedged: true, TransferWedges: 1,
			Unactionable: map[string]int{watchdog.SkipSourceDown: 1, watchdog.SkipUnsupported: 0},
			DPRank:       0, PPRank: 0, TPRank: 0,
			Queues: pluginapi.Queues{Bootstrap: 2, Waiting: 0, Inflight: 3},
			ByPoll: byPoll, OldestAge: 812.5, Stuck: 1, LoopStall: 250 * time.Millisecond,
			AgeBuckets: []uint64{1, 4, 9, 15, 18, 19, 19, 19, 19, 20, 20}, AgeCount: 21, AgeSum: 4000,
		}},
		Gauges: []watchdog.GaugeSnapshot{
			{Key: watchdog.GaugeKey{Queue: watchdog.QueuePrefillInflight, DP: "0", PP: "0", TP: "0"}, Value: 1, Unchanged: 600 * time.Second, Pinned: true},
		},
		MetricsSampled: true,
		SinceProgress:  610 * time.Second,
		ForceFails:     ff,
		Skips:          skips,
		Webhook:        map[string]uint64{watchdog.WebhookAccepted: 2},
		Restarts:       map[string]uint64{watchdog.RestartRestarted: 1},
		TrackedRooms:   3,
		RoomLimitHits:  0,
		LastCycle:      5 * time.Millisecond,
	}
}

func TestExporterGolden(t *testing.T) {
	snap := goldenSnapshot()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewExporter(func() watchdog.Snapshot { return snap }))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	for _, mf := range mfs {
		if _, err := expfmt.MetricFamilyToText(&buf, mf); err != nil {
			t.Fatal(err)
		}
	}
	golden := filepath.Join("testdata", "exporter.golden.prom")
	if *update {
		if err := os.WriteFile(golden, buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if err := testutil.GatherAndCompare(reg, bytes.NewReader(want)); err != nil {
		t.Fatalf("exposition differs from %s (run go test ./collector -update after checking the change): %v", golden, err)
	}

	// The exposition must pass the Prometheus linter.
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: install the Debian package prometheus (.ci/run does)")
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(want)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool check metrics: %v\n%s", err, out)
	}
}

// Two URLs that report the same dp_rank/pp_rank: the second one's stuck
// requests must show, and the collision too (docs/hardening.md).
func TestExporterNeverHidesACollidingRank(t *testing.T) {
	snap := goldenSnapshot()
	second := snap.Ranks[0]
	second.Target = "http://127.0.0.1:30101"
	second.Stuck, second.TransferWedged, second.OldestAge = 2, false, 900
	second.ByPoll = map[string]int{pluginapi.PollTransferring: 2}
	snap.Ranks[0].Stuck = 0
	snap.Ranks = append(snap.Ranks, second)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewExporter(func() watchdog.Snapshot { return snap }))
	want := `# HELP sglang_watchdog_stuck_requests Inflight requests older than the deadline whose poll state and progress have not changed for the stall window while the scheduler loop kept running.
# TYPE sglang_watchdog_stuck_requests gauge
sglang_watchdog_stuck_requests{dp_rank="0",pp_rank="0"} 2
# HELP sglang_watchdog_rank_targets Plugin URLs whose last listing reported this dp_rank and pp_rank. Above 1 is a collision (a misconfigured --plugin.url or port mapping); the series of this rank then sum or take the worst of those targets.
# TYPE sglang_watchdog_rank_targets gauge
sglang_watchdog_rank_targets{dp_rank="0",pp_rank="0"} 2
# HELP sglang_watchdog_inflight_oldest_age_seconds Age of the oldest request in the prefill inflight queue; 0 when the queue is empty.
# TYPE sglang_watchdog_inflight_oldest_age_seconds gauge
sglang_watchdog_inflight_oldest_age_seconds{dp_rank="0",pp_rank="0"} 900
# HELP sglang_watchdog_transfer_wedged 1 while a KV transfer worker queue of this rank is wedged: a transfer that never completes blocks every room queued behind it (diagnosed from the plugin's transfer fields, or suspected from two or more stuck Transferring rooms with an older plugin). Only a restart clears it.
# TYPE sglang_watchdog_transfer_wedged gauge
sglang_watchdog_transfer_wedged{dp_rank="0",pp_rank="0"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "sglang_watchdog_stuck_requests", "sglang_watchdog_rank_targets",
		"sglang_watchdog_inflight_oldest_age_seconds", "sglang_watchdog_transfer_wedged"); err != nil {
		t.Fatal(err)
	}
	if snap.Ranks[0].ByPoll[pluginapi.PollTransferring] != 2 {
		t.Fatal("merging changed the snapshot it was given")
	}
}
