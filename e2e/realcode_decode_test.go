package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// Issue 18, point 7, on SGLang's own code at both ends: a client whose
// request is pinned on prefill gets its error within the prefill deadline
// + 10 s, because the decode side is freed as soon as prefill's verdict is
// "stopped", not at the decode deadline; and a request whose prefill write
// may still land is held.
//
// Two real-code servers of the same release: prefill (SGLang's inflight
// pass) and decode (SGLang's process_decode_queue), each with the plugin,
// and one watchdog binary watching both, which answers decode's verdict
// lookups from its own prefill ledger. The router's view: each request is
// admitted on decode first (its pages sent to prefill, its transfer
// started), then on prefill with the same rid and room; the client's answer
// is decode's, so it comes when SGLang's decode pass lets the request go.
//
// Prefill holds a hung handle with a room queued behind it on the same
// transfer worker. The watchdog's wedge order fails both; the room behind
// had no chunk in flight, so its verdict is "stopped" and its decode side
// is released 5 s later (earlySettle); the hung head's verdict is "live"
// (its write may still land), so its decode side is held for the decode
// deadline and SGLang's own timeout. On decode, the hung head and the room
// behind it wait for a prefill peer inside the decode server that never
// writes (its transfer hangs), as behind the pinned prefill.
func TestRealCodeClientAnswerAfterAPin(t *testing.T) {
	src := sglangSource(t, realCodeRelease)
	backend := sglangsim.BackendNIXL
	tok := tokenFile(t, "client-answer-token")
	prefill := &matrixScene{srv: startRealCodeServer(t, src, backend, tok), admitted: map[string]time.Time{},
		released: map[string]time.Time{}, reasons: map[string]string{}, stop: make(chan struct{}), done: make(chan struct{})}
	decode := &matrixScene{srv: startRealCodeServer(t, src, backend, tok, "--mode", "decode"), admitted: map[string]time.Time{},
		released: map[string]time.Time{}, reasons: map[string]string{}, stop: make(chan struct{}), done: make(chan struct{})}
	prefill.post(t, "/scenario/link", map[string]any{"seconds_per_page": fastPerPage})
	wd := startWatchdog(t, "--plugin.url="+prefill.srv.pluginURL, "--plugin.url="+decode.srv.pluginURL, "--plugin.token-file="+tok,
		"--sglang.metrics-url="+prefill.srv.control+"/metrics", "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
		"--watchdog.interval=500ms", "--watchdog.deadline="+matrixDeadline.String(), "--watchdog.stall-window=1s",
		"--force-fail.mode=auto", "--force-fail.confirm-timeout=20s", "--restart.mode=dry-run", "--restart.min-interval=1m")
	for _, s := range []*matrixScene{prefill, decode} {
		go s.watch(t)
		t.Cleanup(func() { close(s.stop); <-s.done })
	}
	prefill.warmUp(t, 50000)

	for _, rid := range []string{"hung", "behind"} {
		var out struct {
			Queue string `json:"queue"`
		}
		room := map[string]uint64{"hung": 50100, "behind": 50101}[rid]
		if err := json.Unmarshal(decode.post(t, "/scenario/admit", map[string]any{"rid": rid, "room": room, "behaviour": "hang"}), &out); err != nil {
			t.Fatal(err)
		}
		if out.Queue != "transfer" {
			t.Fatalf("%s admitted to decode's %q queue, want transfer", rid, out.Queue)
		}
	}
	prefill.admit(t, "hung", 50100, 1, "hang")
	prefill.admit(t, "behind", 50101, 1, "complete")
	prefill.mu.Lock()
	pinned := prefill.admitted["behind"]
	prefill.mu.Unlock()

	waitFor(t, "the client's answer for the room behind the hung handle", 30*time.Second, func() bool {
		decode.mu.Lock()
		defer decode.mu.Unlock()
		_, ok := decode.released["behind"]
		return ok
	})
	decode.mu.Lock()
	answered, reason := decode.released["behind"], decode.reasons["behind"]
	_, headFreed := decode.released["hung"]
	decode.mu.Unlock()
	if reason != "FINISH_ABORT" {
		t.Errorf("decode let the room behind go as %q, want FINISH_ABORT (SGLang's own abort)", reason)
	}
	if d := answered.Sub(pinned); d > matrixDeadline+10*time.Second {
		t.Errorf("the client's answer came %s after the request entered prefill's inflight queue, want within the prefill deadline + 10 s", d.Round(10*time.Millisecond))
	}
	if headFreed {
		t.Errorf("decode freed the hung head's pages: its prefill write may still land")
	}
	if prefill.reason("hung") != "FINISH_ABORT" || prefill.reason("behind") != "FINISH_ABORT" {
		t.Errorf("prefill let go hung=%q behind=%q, want both FINISH_ABORT (the wedge order)", prefill.reason("hung"), prefill.reason("behind"))
	}
	// Two more cycles: the hung head's decode side stays held.
	time.Sleep(1500 * time.Millisecond)
	decode.mu.Lock()
	_, headFreed = decode.released["hung"]
	decode.mu.Unlock()
	if headFreed {
		t.Errorf("decode freed the hung head's pages after the room behind: its prefill write may still land")
	}
	verdict := func(rid string, room uint64) string {
		resp, err := http.Get(fmt.Sprintf("%s%s%d?rid=%s&age_seconds=1000", wd.base, pluginapi.PathRoomVerdict, room, rid))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v pluginapi.RoomVerdict
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			t.Fatal(err)
		}
		return v.Verdict
	}
	if v := verdict("hung", 50100); v != "live" {
		t.Errorf("the hung head's verdict: %q, want live", v)
	}
	if v := verdict("behind", 50101); v != "stopped" {
		t.Errorf("the room behind's verdict: %q, want stopped", v)
	}
	if logs := wd.logs.String(); !strings.Contains(logs, "released early: its prefill side was released with its transfer stopped") {
		t.Errorf("the watchdog's log does not say why it released the room behind early:\n%s", grepLines(logs, "decode"))
	}
	for _, s := range []*matrixScene{prefill, decode} {
		if st := s.srv.state(t); len(st.Errors) > 0 {
			t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", st.Errors)
		}
	}
	prefill.mu.Lock()
	released := prefill.released["behind"]
	prefill.mu.Unlock()
	t.Logf("client answered %s after its request entered prefill's inflight queue (prefill deadline %s); prefill released it %s after",
		answered.Sub(pinned).Round(10*time.Millisecond), matrixDeadline, released.Sub(pinned).Round(10*time.Millisecond))
}
