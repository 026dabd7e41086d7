package e2e

import (
	"encoding/json"
	"net"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// Issue 24, item 6, decode side: the simulator's decode plugin against
// SGLang's own process_decode_queue (TP1) with the plugin loaded, field by
// field, for the releases and backends of fieldCases. Each side holds a
// request in decode's transfer queue whose prefill never writes (a hung
// prefill handle) and one whose transfer completes; the scenes compare the
// listing, the decode lever's answers without and with prefill_stopped,
// and the listing after SGLang's next pass.
func TestSimulatorParityDecodeFieldByField(t *testing.T) { eachFieldCase(t, decodeFieldScenes) }

// sameHost replaces a decode row's prefill_rank_addrs by whether each
// address is on the host of its bootstrap_addr: the ports are the
// harness's (drawn at start on SGLang's side), the hosts the rule (one
// node: the bootstrap server's).
func sameHost(row map[string]any) {
	addrs, ok := row["prefill_rank_addrs"].([]any)
	if !ok {
		return
	}
	boot, _ := row["bootstrap_addr"].(string)
	bootHost, _, _ := net.SplitHostPort(boot)
	same := make([]any, len(addrs))
	for i, a := range addrs {
		s, _ := a.(string)
		host, _, err := net.SplitHostPort(s)
		same[i] = err == nil && host == bootHost
	}
	row["prefill_rank_addrs"] = same
}

// decodeServerFields are the decode listing's server fields the scenes
// compare.
var decodeServerFields = []string{"transfer_backend", "disaggregation_mode", "levers", "lever_note", "deferred_release",
	"tp_rank", "dp_rank", "pp_rank"}

func decodeFieldScenes(t *testing.T, src string, d *fieldDiffs) {
	const token = "decode-fields-token"
	srv := startRealCodeServer(t, src, d.c.backend, tokenFile(t, token), "--mode", "decode", "--pass-interval", "0.02")
	opts := pluginapi.ClientOptions{Timeout: 2 * time.Second, AdminTimeout: 10 * time.Second, Token: token}
	real := &fieldSide{name: "SGLang " + d.c.release, client: pluginapi.NewClient(srv.pluginURL, opts), plugin: srv.pluginURL}
	real.admit = func(t *testing.T, rid string, room uint64, behaviour string) {
		t.Helper()
		var a struct {
			Queue string `json:"queue"`
		}
		if err := json.Unmarshal(srv.post(t, "/scenario/admit", map[string]any{"rid": rid, "room": room, "behaviour": behaviour}), &a); err != nil {
			t.Fatal(err)
		}
		if a.Queue != "transfer" {
			t.Fatalf("SGLang's decode put %s in its %q queue, want transfer", rid, a.Queue)
		}
	}
	sim, _ := startSim(t, sglangsim.Options{Clock: clock.Real{}, Backend: d.c.backend, LeverEra: d.c.leverEra,
		UntrackedTransfers: d.c.untracked, Token: token})
	plugin := httptest.NewServer(sim.DecodePluginHandler(0))
	t.Cleanup(plugin.Close)
	simSide := &fieldSide{name: "simulator", client: pluginapi.NewClient(plugin.URL, opts), plugin: plugin.URL}
	specs := map[string]sglangsim.RequestSpec{
		"hang":     {Behavior: sglangsim.BehaviorPinStuckHandle, FreezeAt: -1},
		"complete": {Behavior: sglangsim.BehaviorHealthy, Transfer: 10 * time.Millisecond, Chunks: 1},
	}
	simSide.admit = simAdmit(sim, specs, 0)
	decodeRow := func(l map[string]any, rid string) map[string]any { return entry(l, "decode_requests", "rid", rid) }
	listed := func(s *fieldSide, rid string) bool { return decodeRow(s.listing(t), rid) != nil }
	compare := func(scene string, rids ...string) {
		t.Helper()
		rl, sl := real.listing(t), simSide.listing(t)
		rs, _ := rl["server"].(map[string]any)
		ss, _ := sl["server"].(map[string]any)
		for _, k := range decodeServerFields {
			d.diff(scene, "server."+k, rs[k], ss[k])
		}
		rq, _ := rl["queues"].(map[string]any)
		sq, _ := sl["queues"].(map[string]any)
		for _, k := range []string{"prealloc", "transfer"} {
			d.diff(scene, "queues."+k, rq[k], sq[k])
		}
		for _, rid := range rids {
			r, s := decodeRow(rl, rid), decodeRow(sl, rid)
			sameHost(r)
			sameHost(s)
			if (r == nil) != (s == nil) {
				d.add(scene, "listed "+rid, r != nil, s != nil)
				continue
			}
			if r != nil {
				d.diff(scene, "decode row "+rid, r, s)
			}
		}
	}

	// Scene 1: a request whose transfer completes: SGLang's pass admits it.
	// (First: a hung prefill handle holds every later room of its
	// prefill's transfer queue, on both sides.)
	for _, s := range []*fieldSide{real, simSide} {
		s.admit(t, "done", 9102, "complete")
	}
	waitFor(t, "the completed request gone on both sides", 10*time.Second, func() bool {
		return !listed(real, "done") && !listed(simSide, "done")
	})
	compare("transfer done", "done")

	// Scene 2: a request whose prefill hangs, in the transfer queue.
	for _, s := range []*fieldSide{real, simSide} {
		s.admit(t, "hung", 9101, "hang")
	}
	waitFor(t, "the hung request in decode's transfer queue on the simulator", 10*time.Second, func() bool {
		r := decodeRow(simSide.listing(t), "hung")
		return r != nil && r["queue"] == "transfer"
	})
	time.Sleep(300 * time.Millisecond)
	compare("prefill hung, transfer queue", "hung", "done")

	// Scene 3: the decode lever on the hung request, first without
	// prefill_stopped (its transfer started: refused), then with it.
	// On SGLang's own code the scenes must show what they are for: a
	// started transfer refused without prefill_stopped, released with it.
	lever := func(scene string, req pluginapi.ForceFailRequest, wantStatus int, wantResult string) {
		t.Helper()
		status, answer := d.forceFail(t, scene, real, simSide, req)
		if wantStatus != 0 && (status != wantStatus || answer["result"] != wantResult) {
			t.Errorf("%s: SGLang's own code answered %d %v, want %d %s", scene, status, answer["result"], wantStatus, wantResult)
		}
	}
	room := uint64(9101)
	lever("decode lever, prefill not stopped", pluginapi.ForceFailRequest{RID: "hung", BootstrapRoom: &room, Reason: "parity"},
		409, pluginapi.ResultTransferLive)
	lever("decode lever, dry run, prefill stopped", pluginapi.ForceFailRequest{RID: "hung", BootstrapRoom: &room, Reason: "parity",
		PrefillStopped: true, DryRun: true}, 0, "")
	lever("decode lever, prefill stopped", pluginapi.ForceFailRequest{RID: "hung", BootstrapRoom: &room, Reason: "parity",
		PrefillStopped: true}, 200, pluginapi.ResultFlipped)
	time.Sleep(500 * time.Millisecond)
	compare("after the decode lever", "hung")
	if decodeRow(real.listing(t), "hung") != nil {
		t.Errorf("SGLang's own decode pass kept the released request")
	}
}
