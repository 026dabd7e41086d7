package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// TestRealCodeTP2Verdict runs the watchdog binary against a TP2 prefill of
// SGLang's own code (the real-code server with --attn-tp 2: two real
// prefill KV managers, engine ranks 0 and 1, each sending its share of a
// room to its decode peer; the plugin's leader on rank 0 and its publisher
// on rank 1; conformance/tp2.py says what stands in for torch.distributed).
// Every room goes to one transfer queue per rank, served one chunk at a
// time, so three rooms make three cases:
//
//   - wedge: rank 0 sends its share, rank 1's hangs (a non-leader wedge,
//     which the leader sees only through rank 1's published count). The
//     release happens with rank 1's chunk in flight: the verdict must be
//     "live" (decode holds its pages) and stay so;
//   - pinned: hangs on both ranks, wedging rank 0's queue: "live";
//   - queued: behind pinned on rank 0 and behind wedge on rank 1, so no
//     chunk of it is in flight on any rank; released with both ranks
//     watched and quiet, it is the one room decode may free: "stopped".
//     SGLang's own pass clears its status and transfer info on both ranks,
//     so its queued chunks are never written when the wedges clear
//     (test_tp2.py proves that on SGLang's objects).
func TestRealCodeTP2Verdict(t *testing.T) {
	src := sglangSource(t, realCodeRelease)
	for i, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			realCodeTP2Scene(t, src, backend, uint64(9101+100*i))
		})
	}
}

type tp2State struct {
	realCodeState
	Ranks []struct {
		Queued   []string `json:"queued"`
		Released []struct {
			RID    string `json:"rid"`
			Reason string `json:"finished_reason"`
		} `json:"released"`
		Outstanding map[string]int `json:"outstanding"`
	} `json:"ranks"`
}

func (s *realCodeServer) tp2State(t *testing.T) tp2State {
	t.Helper()
	resp, err := http.Get(s.control + "/scenario/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st tp2State
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st
}

func (s *realCodeServer) admitTP2(t *testing.T, rid string, room uint64, behaviour, rank1 string) {
	t.Helper()
	body := fmt.Sprintf(`{"rid":%q,"room":%d,"behaviour":%q}`, rid, room, behaviour)
	if rank1 != "" {
		body = fmt.Sprintf(`{"rid":%q,"room":%d,"behaviour":%q,"rank_behaviour":{"1":%q}}`, rid, room, behaviour, rank1)
	}
	resp, err := http.Post(s.control+"/scenario/admit", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("admit %s: %d", rid, resp.StatusCode)
	}
}

// verdict asks the watchdog's read-only endpoint, as a decode-side
// watchdog does, for a decode request first seen ten minutes ago.
func (p *watchdogProc) verdict(t *testing.T, room uint64, rid string) pluginapi.RoomVerdict {
	t.Helper()
	url := fmt.Sprintf("%s%s%d?%s=%s&%s=600", p.base, pluginapi.PathRoomVerdict, room, pluginapi.VerdictParamRID, rid, pluginapi.VerdictParamAge)
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v pluginapi.RoomVerdict
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

func realCodeTP2Scene(t *testing.T, src, backend string, room uint64) {
	started := time.Now()
	tok := tokenFile(t, "realcode-tp2-token")
	srv := startRealCodeServer(t, src, backend, tok, "--attn-tp", "2")
	wd := startWatchdog(t, "--plugin.url="+srv.pluginURL, "--plugin.token-file="+tok,
		"--sglang.metrics-url="+srv.control+"/metrics", "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
		"--watchdog.deadline=5s", "--watchdog.stall-window=2s", "--force-fail.mode=auto",
		"--force-fail.confirm-timeout=20s")

	wedge, pinned, queued := fmt.Sprintf("wedge-%d", room), fmt.Sprintf("pinned-%d", room+1), fmt.Sprintf("queued-%d", room+2)
	srv.admitTP2(t, wedge, room, "complete", "hang")
	srv.admitTP2(t, pinned, room+1, "hang", "")
	srv.admitTP2(t, queued, room+2, "complete", "")

	// Before any release: the non-leader's hung chunk is what the leader
	// reports for the wedge room, with both ranks watched, once rank 1 has
	// published it (every 0.25 s).
	client := pluginapi.NewClient(srv.pluginURL, pluginapi.ClientOptions{Timeout: 2 * time.Second})
	// Within the watchdog's 5 s deadline, after which the room is released.
	waitFor(t, "the leader to list the wedge room in flight with both ranks watched", 4*time.Second, func() bool {
		l, err := client.Inflight(context.Background())
		if err != nil {
			return false
		}
		if l.Server.TransferRanks == nil || *l.Server.TransferRanks != 2 || l.Server.TransferRanksWatched == nil || *l.Server.TransferRanksWatched != 2 {
			return false
		}
		for _, r := range l.Inflight {
			if r.RID == wedge && r.TransferInFlight != nil && *r.TransferInFlight {
				return true
			}
		}
		return false
	})

	all := []string{wedge, pinned, queued}
	waitFor(t, "SGLang to release every request on both ranks", 60*time.Second, func() bool {
		st := srv.tp2State(t)
		for _, rk := range st.Ranks {
			if len(rk.Released) < len(all) {
				return false
			}
		}
		return true
	})
	// A release is recorded in the ledger once confirmed.
	waitFor(t, "the watchdog to confirm three releases", 30*time.Second, func() bool {
		return sumSamples(t, grepLines(wd.metrics(t), `result="released"`), "sglang_watchdog_force_fails_total") >= 3
	})

	st := srv.tp2State(t)
	if len(st.Errors) > 0 {
		t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", st.Errors)
	}
	for i, rk := range st.Ranks {
		for _, r := range rk.Released {
			if r.Reason != "FINISH_ABORT" {
				t.Errorf("rank %d released %s with %s, want FINISH_ABORT", i, r.RID, r.Reason)
			}
		}
	}
	// Rank 1 still holds the wedge room's chunk: decode must not free it.
	if n := st.Ranks[1].Outstanding[fmt.Sprint(room)]; n < 1 {
		t.Errorf("rank 1 counts %d outstanding chunks of the wedge room, want >= 1: %+v", n, st.Ranks[1])
	}

	want := map[string]string{wedge: pluginapi.VerdictLive, pinned: pluginapi.VerdictLive, queued: pluginapi.VerdictStopped}
	rooms := map[string]uint64{wedge: room, pinned: room + 1, queued: room + 2}
	for _, rid := range all {
		v := wd.verdict(t, rooms[rid], rid)
		if v.Verdict != want[rid] {
			t.Errorf("verdict on %s (room %d): %s (%s), want %s", rid, rooms[rid], v.Verdict, v.Reason, want[rid])
		} else {
			t.Logf("verdict on %s: %s (%s)", rid, v.Verdict, v.Reason)
		}
	}
	t.Logf("%s: TP2 scene in %s", backend, time.Since(started).Round(10*time.Millisecond))
}

// TestRealCodeTP2SlowNonLeaderChunk: rank 0 sends its share of a room at
// once, rank 1's takes 9 s (a slow link, healthy), past the 6 s deadline
// plus the 2 s stall window. SGLang's MIN poll holds the room in both
// inflight queues meanwhile, with nothing of it on the leader's worker
// (whose transfer info for the room SGLang dropped: its queue is listed
// null). The watchdog judges rank 1's chunk by rank 1's worker as the
// leader publishes it (its speed unknown: twice the deadline), and SGLang
// releases the request as sent.
func TestRealCodeTP2SlowNonLeaderChunk(t *testing.T) {
	src := sglangSource(t, realCodeRelease)
	tok := tokenFile(t, "realcode-tp2-slow-token")
	srv := startRealCodeServer(t, src, sglangsim.BackendNIXL, tok, "--attn-tp", "2")
	wd := startWatchdog(t, "--plugin.url="+srv.pluginURL, "--plugin.token-file="+tok,
		"--sglang.metrics-url="+srv.control+"/metrics", "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
		"--watchdog.deadline=6s", "--watchdog.stall-window=2s", "--force-fail.mode=auto",
		"--force-fail.confirm-timeout=20s")

	const room = 9401
	rid := fmt.Sprintf("slow-%d", room)
	srv.admitTP2(t, rid, room, "complete", "slow:9")
	waitFor(t, "SGLang to release the request on both ranks", 60*time.Second, func() bool {
		for _, rk := range srv.tp2State(t).Ranks {
			if len(rk.Released) < 1 {
				return false
			}
		}
		return true
	})
	st := srv.tp2State(t)
	if len(st.Errors) > 0 {
		t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", st.Errors)
	}
	for i, rk := range st.Ranks {
		for _, r := range rk.Released {
			if r.Reason == "FINISH_ABORT" {
				t.Errorf("rank %d released %s with %s: a healthy slow chunk of the non-leader rank was failed", i, r.RID, r.Reason)
			}
		}
	}
	if n := sumSamples(t, wd.metrics(t), "sglang_watchdog_force_fails_total"); n != 0 {
		t.Errorf("the watchdog made %v force-fail attempts, want none: the transfer was live", n)
	}
}
