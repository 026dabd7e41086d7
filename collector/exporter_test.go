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
	ff := map[[3]string]uint64{}
	skips := map[[2]string]uint64{}
	for _, role := range watchdog.Roles {
		for _, r := range watchdog.Results {
			for _, tr := range watchdog.Triggers {
				ff[[3]string{r, tr, role}] = 0
			}
		}
		for _, r := range watchdog.SkipReasons {
			skips[[2]string{r, role}] = 0
		}
	}
	ff[[3]string{watchdog.ResultReleased, watchdog.TriggerAuto, watchdog.RolePrefill}] = 3
	ff[[3]string{watchdog.ResultWouldFlip, watchdog.TriggerAuto, watchdog.RolePrefill}] = 1
	ff[[3]string{watchdog.ResultReleased, watchdog.TriggerAuto, watchdog.RoleDecode}] = 2
	ff[[3]string{watchdog.ResultRejected, watchdog.TriggerAuto, watchdog.RoleDecode}] = 1
	skips[[2]string{watchdog.SkipRateLimited, watchdog.RolePrefill}] = 2
	skips[[2]string{watchdog.SkipTransferLive, watchdog.RoleDecode}] = 4
	decodePoll := map[string]int{}
	for _, p := range pluginapi.PollStates {
		decodePoll[p] = 0
	}
	decodePoll[pluginapi.PollTransferring] = 1
	byPoll := map[string]int{}
	for _, p := range pluginapi.PollStates {
		byPoll[p] = 0
	}
	byPoll[pluginapi.PollTransferring] = 2
	byPoll[pluginapi.PollWaitingForInput] = 1
	return watchdog.Snapshot{
		Mode: watchdog.ModeAuto, RestartMode: watchdog.ModeDryRun, ModeChanges: 2, ModeFileErrors: 1,
		Sources: []watchdog.SourceStatus{
			{Source: "metrics", Target: "http://127.0.0.1:30000/metrics", Up: true, Duration: 12 * time.Millisecond, Failures: 1},
			{Source: "plugin", Target: "http://127.0.0.1:28100", Up: true, Duration: 2 * time.Millisecond},
			{Source: "plugin", Target: "http://127.0.0.1:28101", Up: false, Duration: 800 * time.Millisecond, Failures: 4},
		},
		Ranks: []watchdog.RankSnapshot{{
			Target: "http://127.0.0.1:28100", Role: watchdog.RolePrefill, TransferWedged: true, TransferWedges: 1,
			Unactionable: map[string]int{watchdog.SkipSourceDown: 1, watchdog.SkipUnsupported: 0, watchdog.SkipTransferLive: 0},
			DPRank:       0, PPRank: 0, TPRank: 0,
			Queues: pluginapi.Queues{Bootstrap: 2, Waiting: 0, Inflight: 3},
			ByPoll: byPoll, OldestAge: 812.5, Stuck: 1, LoopStall: 250 * time.Millisecond,
			AgeBuckets: []uint64{1, 4, 9, 15, 18, 19, 19, 19, 19, 20, 20}, AgeCount: 21, AgeSum: 4000,
			DeadThreads: map[string]int{pluginapi.ThreadBootstrap: 0, pluginapi.ThreadTransferWorker: 1, pluginapi.ThreadDecodeListener: 0,
				pluginapi.ThreadHeartbeat: 0, pluginapi.ThreadOther: 0},
		}, {
			Target: "http://127.0.0.1:30200", Role: watchdog.RoleDecode,
			Unactionable: map[string]int{watchdog.SkipSourceDown: 0, watchdog.SkipUnsupported: 0, watchdog.SkipTransferLive: 1},
			Queues:       pluginapi.Queues{Prealloc: 1, Transfer: 1},
			ByPoll:       decodePoll, OldestAge: 240, Stuck: 1, LoopStall: 100 * time.Millisecond,
			AgeBuckets: []uint64{0, 0, 0, 0, 2, 3, 3, 3, 3, 3, 3}, AgeCount: 3, AgeSum: 95,
		}},
		Gauges: []watchdog.GaugeSnapshot{
			{Key: watchdog.GaugeKey{Queue: watchdog.QueuePrefillInflight, DP: "0", PP: "0", TP: "0"}, Value: 1, Unchanged: 600 * time.Second, Pinned: true},
		},
		MetricsSampled: true,
		SinceProgress:  610 * time.Second,
		RoleForceFails: ff,
		RoleSkips:      skips,
		VerdictLookups: map[string]uint64{pluginapi.VerdictStopped: 2, pluginapi.VerdictLive: 1, pluginapi.VerdictUnknown: 3, "error": 1},
		LedgerRooms:    5,
		Roles:          watchdog.Roles,
		Webhook:        map[string]uint64{watchdog.WebhookAccepted: 2},
		Restarts:       map[string]uint64{watchdog.RestartRestarted: 1},
		WedgeOrders:    map[string]uint64{watchdog.OrderPlaced: 2, watchdog.OrderRenewed: 40},
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
	snap.Ranks = snap.Ranks[:1]
	second := snap.Ranks[0]
	second.Target = "http://127.0.0.1:28101"
	second.Stuck, second.TransferWedged, second.OldestAge = 2, false, 900
	second.ByPoll = map[string]int{pluginapi.PollTransferring: 2}
	snap.Ranks[0].Stuck = 0
	snap.Ranks = append(snap.Ranks, second)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewExporter(func() watchdog.Snapshot { return snap }))
	want := `# HELP sglang_watchdog_stuck_requests Requests judged stuck: older than their role's deadline and, on a prefill rank with transfer_progress, holding a chunk in flight far past what its size needs at the link's measured speed, or with nothing in flight nor queued (or queued on a transfer worker that died) and no change for the stall window; elsewhere with no change of poll state and progress (and, on decode, queue) for the stall window while the scheduler loop kept running.
# TYPE sglang_watchdog_stuck_requests gauge
sglang_watchdog_stuck_requests{dp_rank="0",pp_rank="0",role="prefill"} 2
# HELP sglang_watchdog_rank_targets Plugin URLs whose last listing reported this dp_rank and pp_rank. Above 1 is a collision (a misconfigured --plugin.url or port mapping); the series of this rank then sum or take the worst of those targets.
# TYPE sglang_watchdog_rank_targets gauge
sglang_watchdog_rank_targets{dp_rank="0",pp_rank="0",role="prefill"} 2
# HELP sglang_watchdog_inflight_oldest_age_seconds Age of the oldest request waiting on a KV cache transfer (prefill inflight queue, or decode prealloc and transfer queues); 0 when there is none.
# TYPE sglang_watchdog_inflight_oldest_age_seconds gauge
sglang_watchdog_inflight_oldest_age_seconds{dp_rank="0",pp_rank="0",role="prefill"} 900
# HELP sglang_watchdog_transfer_wedged 1 while a KV transfer worker queue of this rank is wedged: a transfer that never completes blocks every room queued behind it (diagnosed from a chunk held far past what its size needs at the link's measured speed, or, with a plugin without transfer_progress, from its round-2 transfer fields or suspected from two or more stuck Transferring rooms; those are alerted on, never acted on). Only a restart clears it.
# TYPE sglang_watchdog_transfer_wedged gauge
sglang_watchdog_transfer_wedged{dp_rank="0",pp_rank="0",role="prefill"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "sglang_watchdog_stuck_requests", "sglang_watchdog_rank_targets",
		"sglang_watchdog_inflight_oldest_age_seconds", "sglang_watchdog_transfer_wedged"); err != nil {
		t.Fatal(err)
	}
	if snap.Ranks[0].ByPoll[pluginapi.PollTransferring] != 2 {
		t.Fatal("merging changed the snapshot it was given")
	}
}

// A watchdog that never listed a decode rank exports no decode counters,
// so that prefill-only deployments keep their series.
func TestExporterDecodeCountersOnlyOnceDecodeIsSeen(t *testing.T) {
	snap := goldenSnapshot()
	snap.Ranks = snap.Ranks[:1]
	snap.Roles = []string{watchdog.RolePrefill}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewExporter(func() watchdog.Snapshot { return snap }))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	prefill := 0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "role" && lp.GetValue() == watchdog.RoleDecode {
					t.Errorf("%s has a role=\"decode\" series without a decode rank", mf.GetName())
				}
				if lp.GetName() == "role" && lp.GetValue() == watchdog.RolePrefill && mf.GetName() == "sglang_watchdog_force_fails_total" {
					prefill++
				}
			}
		}
	}
	if prefill != len(watchdog.Results)*len(watchdog.Triggers) {
		t.Errorf("%d prefill force-fail series, want every result and trigger", prefill)
	}
}
