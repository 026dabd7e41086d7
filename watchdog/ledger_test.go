package watchdog

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func TestLedgerTTLAndCap(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	l := newLedger(15*time.Minute, 3)
	k := func(room uint64) roomKey { return roomKey{rid: "r", room: room} }
	l.add(k(1), t0, true)
	l.add(k(2), t0.Add(time.Minute), true)
	l.add(k(1), t0.Add(2*time.Minute), false) // released again: the newer entry wins
	l.add(k(3), t0.Add(3*time.Minute), true)
	if e := l.get(1, t0.Add(3*time.Minute))["r"]; e == nil || e.stopped {
		t.Fatalf("room 1 = %+v, want its newer entry (not stopped)", e)
	}
	l.add(k(4), t0.Add(4*time.Minute), true)
	if l.get(2, t0.Add(4*time.Minute)) != nil || l.len() != 3 {
		t.Fatalf("cap 3: room 2 (oldest) should be gone, %d kept", l.len())
	}
	if l.get(1, t0.Add(17*time.Minute-time.Second)) == nil {
		t.Fatal("room 1 forgotten before its TTL")
	}
	if l.get(1, t0.Add(17*time.Minute)) != nil || l.get(3, t0.Add(18*time.Minute)) != nil {
		t.Fatal("rooms kept past their TTL")
	}
	if l.get(4, t0.Add(18*time.Minute)) == nil {
		t.Fatal("room 4 forgotten before its TTL")
	}
}

// Two requests released with the same room are two entries: neither
// overwrites nor expires the other, and an orphan of the room marks both.
func TestLedgerKeyedByRIDAndRoom(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	l := newLedger(15*time.Minute, 10)
	l.add(roomKey{rid: "old", room: 77}, t0, true)
	l.add(roomKey{rid: "new", room: 77}, t0.Add(8*time.Minute), false)
	got := l.get(77, t0.Add(8*time.Minute))
	if len(got) != 2 || !got["old"].stopped || got["new"].stopped || l.len() != 2 {
		t.Fatalf("room 77 = %v (%d kept), want both requests with their own verdicts", got, l.len())
	}
	l.orphaned(77)
	if !got["old"].orphaned || !got["new"].orphaned {
		t.Fatal("an orphan of room 77 must mark every request released with it")
	}
	if got := l.get(77, t0.Add(15*time.Minute)); len(got) != 1 || got["new"] == nil || l.len() != 1 {
		t.Fatalf("after the first one's TTL: %v, want only the newer request", got)
	}
}

// askA asks for the verdict on room for decode request "a", seen on decode
// long before any release in these tests.
func askA(room uint64) pluginapi.VerdictQuery {
	return pluginapi.VerdictQuery{Room: room, RID: "a", AgeSeconds: 1e6}
}

// combined watches a prefill and a decode rank, as the demo does: the
// decode side asks its own ledger.
func combined(t *testing.T, prefillRoom pluginapi.Room) (*decodeHarness, *fakePlugin, *fakeDecode) {
	t.Helper()
	p, d := newFakePlugin("http://127.0.0.1:28100", 0), newFakeDecode("http://127.0.0.1:30200", 0)
	p.seesEveryWriter(1, 1)
	p.set(prefillRoom)
	d.set(dreq(prefillRoom.RID, prefillRoom.BootstrapRoom, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(true)))
	return newDecodeHarness(t, []*fakePlugin{p}, []*fakeDecode{d}, nil), p, d
}

// releasePrefill runs cycles until the prefill room is released, and
// returns when.
func releasePrefill(t *testing.T, h *decodeHarness, p *fakePlugin) time.Time {
	t.Helper()
	for range 120 {
		if p.callCount() > 0 {
			break
		}
		h.tick(1)
	}
	if p.callCount() != 1 {
		t.Fatalf("prefill calls %d, want 1", p.callCount())
	}
	return h.clk.Now()
}

// wantHeldLive checks that room 11 was released on prefill once, that its
// verdict is live, and that its decode request was held.
func wantHeldLive(t *testing.T, h *decodeHarness, p *fakePlugin, d *fakeDecode) {
	t.Helper()
	if p.callCount() != 1 {
		t.Fatalf("prefill calls %d, want 1", p.callCount())
	}
	if v := h.wd.PrefillVerdict(askA(11)); v.Verdict != pluginapi.VerdictLive {
		t.Fatalf("verdict %+v, want live", v)
	}
	if n := len(d.orders()); n != 0 {
		t.Fatalf("%d decode calls, want the request held", n)
	}
}

func TestLedgerVerdicts(t *testing.T) {
	t.Run("released with nothing in flight: stopped, decode released", func(t *testing.T) {
		h, p, d := combined(t, r2room("a", 11, 0, 0, false))
		released := releasePrefill(t, h, p)
		if len(d.orders()) != 0 {
			t.Fatalf("decode calls %d; want the prefill room released first", len(d.orders()))
		}
		h.tick(1)
		if v := h.wd.PrefillVerdict(askA(11)); v.Verdict != pluginapi.VerdictStopped || v.Room != "11" || v.ReleasedSecondsAgo < 1 {
			t.Fatalf("verdict %+v, want stopped", v)
		}
		for len(d.orders()) == 0 && h.clk.Now().Sub(released) < time.Minute {
			h.tick(1)
		}
		if o := d.orders(); len(o) != 1 || !o[0].PrefillStopped {
			t.Fatalf("decode orders %+v, want one with prefill_stopped", o)
		}
		if after := h.clk.Now().Sub(released); after < earlySettle || after > earlySettle+2*time.Second {
			t.Fatalf("decode released %s after prefill, want once the verdict settled (%s), long before the decode deadline", after, earlySettle)
		}
	})
	t.Run("an orphan listed after the release turns it live", func(t *testing.T) {
		h, p, d := combined(t, r2room("a", 11, 0, 0, false))
		releasePrefill(t, h, p)
		h.tick(int(earlySettle/time.Second) - 1) // the orphan shows before the verdict settled
		p.mu.Lock()
		p.orphans = []pluginapi.OrphanedTransfer{{BootstrapRoom: 11, TransferQueue: intp(0), OutstandingChunks: 1}}
		p.mu.Unlock()
		h.tick(1)
		p.mu.Lock()
		p.orphans = nil
		p.mu.Unlock()
		h.tick(40)
		if v := h.wd.PrefillVerdict(askA(11)); v.Verdict != pluginapi.VerdictLive {
			t.Fatalf("verdict %+v after an orphan came and went, want live", v)
		}
		if n := len(d.orders()); n != 0 || h.skips(SkipTransferLive) != 1 {
			t.Fatalf("%d decode calls, %d held; want the decode request held", n, h.skips(SkipTransferLive))
		}
	})
	t.Run("not in flight, but the backend exposes nothing: live", func(t *testing.T) {
		// transfer_in_flight false without transfer_tracking (Mooncake, an
		// older plugin) proves nothing: its worker may still write.
		h, p, d := combined(t, r2room("a", 11, 0, 0, false))
		p.server.TransferTracking = nil
		h.tick(110)
		wantHeldLive(t, h, p, d)
	})
	t.Run("TP2, only the leader's rank watched: live", func(t *testing.T) {
		// Issue 18: the other rank's own transfer worker may still write
		// into its decode peer's pages.
		h, p, d := combined(t, r2room("a", 11, 0, 0, false))
		p.seesEveryWriter(2, 1)
		h.tick(110)
		wantHeldLive(t, h, p, d)
	})
	t.Run("a plugin that does not say how many ranks send: live", func(t *testing.T) {
		h, p, d := combined(t, r2room("a", 11, 0, 0, false))
		p.server.TransferRanks, p.server.TransferRanksWatched = nil, nil
		h.tick(110)
		wantHeldLive(t, h, p, d)
	})
	t.Run("in flight at release: live", func(t *testing.T) {
		h, p, d := combined(t, r2room("a", 11, 0, 0, true))
		h.tick(110)
		wantHeldLive(t, h, p, d)
	})
	t.Run("still in the prefill queue: in_queue", func(t *testing.T) {
		r := r2room("a", 11, 0, 0, false)
		h, p, d := combined(t, r)
		p.answer = func(req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
			return http.StatusConflict, &pluginapi.ForceFailResponse{Result: pluginapi.ResultTransferSucceeded, RID: req.RID}, nil
		}
		h.tick(110)
		if v := h.wd.PrefillVerdict(askA(11)); v.Verdict != pluginapi.VerdictInQueue {
			t.Fatalf("verdict %+v, want in_queue", v)
		}
		if n := len(d.orders()); n != 0 {
			t.Fatalf("%d decode calls, want the request held", n)
		}
	})
	t.Run("a configured rank that never listed", func(t *testing.T) {
		// Issue 18: it may be the prefill rank still sending for the room.
		p, d := newFakePlugin("http://127.0.0.1:28100", 0), newFakeDecode("http://127.0.0.1:30200", 0)
		p.seesEveryWriter(1, 1)
		p.set(r2room("a", 11, 0, 0, false))
		d.set(dreq("a", 11, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(true)))
		silent := newFakePlugin("http://127.0.0.1:28101", 1)
		silent.listErr = errors.New("connection refused")
		h := newDecodeHarness(t, []*fakePlugin{p, silent}, []*fakeDecode{d}, nil)
		h.tick(80)
		if p.callCount() != 1 {
			t.Fatalf("prefill calls %d, want the room released", p.callCount())
		}
		wantUnread(t, h.wd.PrefillVerdict(askA(11)))
	})
	t.Run("a PP stage the listing names is not configured", func(t *testing.T) {
		h, p, _ := combined(t, r2room("a", 11, 0, 0, false))
		p.mu.Lock()
		p.server.PPSize = 2
		p.mu.Unlock()
		h.tick(80)
		wantUnread(t, h.wd.PrefillVerdict(askA(11)))
	})
	t.Run("unknown room and health-check room", func(t *testing.T) {
		h, _, _ := combined(t, r2room("a", 11, 0, 0, false))
		h.tick(1)
		for _, room := range []uint64{12, 0} {
			if v := h.wd.PrefillVerdict(askA(room)); v.Verdict != pluginapi.VerdictUnknown {
				t.Fatalf("room %d: verdict %+v, want unknown", room, v)
			}
		}
	})
}

// wantUnread checks that a verdict is unknown because a rank is not read.
func wantUnread(t *testing.T, v pluginapi.RoomVerdict) {
	t.Helper()
	if v.Verdict != pluginapi.VerdictUnknown || !strings.Contains(v.Reason, "is not read") || strings.Contains(v.Reason, "127.0.0.1") {
		t.Errorf("verdict %+v, want unknown: a rank is not read (and no address named)", v)
	}
}

// The verdict API answers any decode-side caller: its reasons name the
// rank, never the plugin's URL (an internal address).
func TestVerdictReasonsNameNoAddress(t *testing.T) {
	check := func(t *testing.T, v pluginapi.RoomVerdict, verdict string) {
		t.Helper()
		if v.Verdict != verdict || !strings.Contains(v.Reason, "prefill rank dp0/pp0") || strings.Contains(v.Reason, "127.0.0.1") || strings.Contains(v.Reason, "http") {
			t.Errorf("verdict %+v, want %s with a reason naming the rank and no address", v, verdict)
		}
	}
	t.Run("in_queue", func(t *testing.T) {
		h, _, _ := combined(t, r2room("a", 11, 0, 0, false))
		h.tick(1)
		check(t, h.wd.PrefillVerdict(askA(11)), pluginapi.VerdictInQueue)
	})
	t.Run("orphaned", func(t *testing.T) {
		h, p, _ := combined(t, r2room("a", 11, 0, 0, false))
		p.mu.Lock()
		p.rooms = nil
		p.orphans = []pluginapi.OrphanedTransfer{{BootstrapRoom: 11, TransferQueue: intp(0), OutstandingChunks: 1}}
		p.mu.Unlock()
		h.tick(1)
		check(t, h.wd.PrefillVerdict(askA(11)), pluginapi.VerdictLive)
	})
	t.Run("listing failed", func(t *testing.T) {
		h, p, _ := combined(t, r2room("a", 11, 0, 0, false))
		h.tick(79)
		p.mu.Lock()
		p.listErr = errors.New("connection refused")
		p.mu.Unlock()
		h.tick(1)
		check(t, h.wd.PrefillVerdict(askA(11)), pluginapi.VerdictUnknown)
	})
}

// The prefill watchdog serves its verdicts over HTTP; a separate decode
// watchdog asks it through the real client.
func TestVerdictOverHTTP(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	p.seesEveryWriter(1, 1)
	p.set(r2room("a", 1<<64-1, 0, 0, false))
	pre := newDecodeHarness(t, []*fakePlugin{p}, nil, nil)
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		pre.wd.VerdictHandler().ServeHTTP(w, r)
	}))
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	client := func(networks ...string) *pluginapi.VerdictClient {
		var nets []netip.Prefix
		for _, n := range networks {
			nets = append(nets, netip.MustParsePrefix(n))
		}
		c, err := pluginapi.NewVerdictClient(pluginapi.VerdictClientOptions{URLTemplate: "http://{host}:" + u.Port(), Networks: nets,
			Client: &http.Client{}, Timeout: time.Second, CacheTTL: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	loop := client("127.0.0.0/8")
	ctx := context.Background()

	pre.tick(1)
	if v, err := loop.Verdict(ctx, pluginapi.VerdictQuery{BootstrapAddr: "127.0.0.1:8998", Room: 1<<64 - 1, RID: "a", AgeSeconds: 1}); err != nil || v.Verdict != pluginapi.VerdictInQueue || v.Room != "18446744073709551615" {
		t.Fatalf("verdict %+v, %v; want in_queue for the full 64-bit room", v, err)
	}
	pre.tick(70)
	if p.callCount() != 1 {
		t.Fatalf("prefill calls %d, want the room released", p.callCount())
	}
	// loop cached in_queue for room 1<<64-1; a fresh client asks again.
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.set(dreq("a", 1<<64-1, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 100, boolp(true)))
	fresh := client("127.0.0.0/8")
	dec := newDecodeHarness(t, nil, []*fakeDecode{d}, func(c *Config) { c.Verdicts = fresh })
	dec.tick(80)
	if o := d.orders(); len(o) != 1 || !o[0].PrefillStopped {
		t.Fatalf("decode orders %+v, want one with prefill_stopped after a stopped verdict over HTTP", o)
	}
	if got := dec.wd.Snapshot().VerdictLookups[pluginapi.VerdictStopped]; got != 1 {
		t.Fatalf("stopped lookups %d, want 1", got)
	}

	// Networks: a host outside them, or a name, is never asked.
	before := hits.Load()
	for _, c := range []struct {
		client *pluginapi.VerdictClient
		addr   string
	}{
		{client("10.0.0.0/8"), "127.0.0.1:8998"},
		{loop, "localhost:8998"},
		{loop, "[::1]:8998"},
		{loop, "127.0.0.1"},
	} {
		if v, err := c.client.Verdict(ctx, pluginapi.VerdictQuery{BootstrapAddr: c.addr, Room: 1<<64 - 1, RID: "a", AgeSeconds: 1}); err == nil {
			t.Fatalf("%s: verdict %+v, want a refusal", c.addr, v)
		}
	}
	if n := hits.Load() - before; n != 0 {
		t.Fatalf("%d requests reached the server for refused hosts", n)
	}

	// The endpoint refuses what it cannot answer.
	for path, want := range map[string]int{"/api/v1/rooms/x": 400, "/api/v1/rooms/18446744073709551616": 400, "/api/v1/rooms/5": 200} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		var body map[string]any
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil {
			t.Fatalf("%s: the answer is not JSON: %v", path, err)
		}
		if resp.StatusCode != want {
			t.Fatalf("%s: HTTP %d %v, want %d", path, resp.StatusCode, body, want)
		}
	}
	resp, err := http.Post(srv.URL+"/api/v1/rooms/5", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("POST: HTTP %d, want 405", resp.StatusCode)
	}
}

// Issue 18: prefill released room 77 with "stopped"; minutes later a new
// request got room 77, and its decode side, 190 s old with its transfer
// started, was told "stopped" (released_seconds_ago=483). A verdict is
// bound to the request: another rid, or a release from before the decode
// request was first seen, answers unknown and the request is held.
func TestLedgerVerdictNeverAnswersForALaterRequest(t *testing.T) {
	for _, tc := range []struct {
		name, rid, reason string
	}{
		{"a new request with the room", "new", "another rid"},
		{"the same rid again (a client's own rid reused)", "old", "before this decode request was first seen"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, d := newFakePlugin("http://127.0.0.1:28100", 0), newFakeDecode("http://127.0.0.1:30200", 0)
			p.seesEveryWriter(1, 1)
			p.set(r2room("old", 77, 0, 0, false))
			h := newDecodeHarness(t, []*fakePlugin{p}, []*fakeDecode{d}, nil)
			h.tick(79)
			if p.callCount() != 1 {
				t.Fatalf("prefill calls %d, want room 77 released", p.callCount())
			}
			if v := h.wd.PrefillVerdict(pluginapi.VerdictQuery{Room: 77, RID: "old", AgeSeconds: 100}); v.Verdict != pluginapi.VerdictStopped {
				t.Fatalf("verdict for the released request %+v, want stopped", v)
			}
			h.tick(300)
			d.set(dreq(tc.rid, 77, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 160, boolp(true)))
			h.tick(31)
			q := pluginapi.VerdictQuery{Room: 77, RID: tc.rid, AgeSeconds: 191}
			if v := h.wd.PrefillVerdict(q); v.Verdict != pluginapi.VerdictUnknown || !strings.Contains(v.Reason, tc.reason) || v.RID != tc.rid {
				t.Fatalf("verdict %+v, want unknown (%s)", v, tc.reason)
			}
			if o := d.orders(); len(o) != 0 || h.skips(SkipTransferLive) != 1 {
				t.Fatalf("decode orders %+v, %d held; want the later request held", o, h.skips(SkipTransferLive))
			}
		})
	}
}

// The verdict endpoint binds to the rid and age it is given, and refuses
// what it cannot read; without them (an older decode-side watchdog) it never
// answers stopped.
func TestVerdictHandlerBindsToTheQuery(t *testing.T) {
	p := newFakePlugin("http://127.0.0.1:28100", 0)
	p.seesEveryWriter(1, 1)
	p.set(r2room("a", 5, 0, 0, false))
	h := newDecodeHarness(t, []*fakePlugin{p}, nil, nil)
	h.tick(80)
	srv := httptest.NewServer(h.wd.VerdictHandler())
	defer srv.Close()
	for query, want := range map[string]string{
		"?rid=a&age_seconds=100":  pluginapi.VerdictStopped,
		"?rid=a&age_seconds=1":    pluginapi.VerdictUnknown,
		"?rid=b&age_seconds=100":  pluginapi.VerdictUnknown,
		"":                        pluginapi.VerdictUnknown,
		"?age_seconds=100":        pluginapi.VerdictUnknown,
		"?rid=a&age_seconds=-1":   "400",
		"?rid=a&age_seconds=NaN":  "400",
		"?rid=a&age_seconds=soon": "400",
		"?rid=" + strings.Repeat("x", 257) + "&age_seconds=100": "400",
	} {
		resp, err := http.Get(srv.URL + pluginapi.PathRoomVerdict + "5" + query)
		if err != nil {
			t.Fatal(err)
		}
		var v pluginapi.RoomVerdict
		err = json.NewDecoder(resp.Body).Decode(&v)
		resp.Body.Close()
		switch {
		case err != nil:
			t.Errorf("%q: the answer is not JSON: %v", query, err)
		case want == "400" && resp.StatusCode != http.StatusBadRequest:
			t.Errorf("%q: HTTP %d %+v, want 400", query, resp.StatusCode, v)
		case want != "400" && (resp.StatusCode != http.StatusOK || v.Verdict != want):
			t.Errorf("%q: HTTP %d %+v, want %s", query, resp.StatusCode, v, want)
		}
	}
}
