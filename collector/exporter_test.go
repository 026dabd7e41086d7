package collector

import (
	"bytes"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
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
			DPRank: 0, PPRank: 0, TPRank: 0,
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
