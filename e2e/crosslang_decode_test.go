package e2e

import (
	"bufio"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// The decode stand-in's scene (sglang_plugin/tests/standin_decode_server.py).
const (
	decodeWaitingRID = "waiting-0001"
	decodeLiveRID    = "live-0002"
	decodeHealthyRID = "healthy-0003"
	decodeHealthRID  = "HEALTH_CHECK_1764403200.0"
	decodeWarmupRID  = "warmup-0005"
	// pinnedRoom and pinnedRID are pinned-0001's room and rid in the
	// prefill parity scene; the decode stand-in gives them to its live
	// request (--live-room, --live-rid), as a router that gives both legs
	// one rid, so that the prefill watchdog's ledger speaks of the request
	// decode waits on (verdicts are bound to the rid).
	pinnedRoom = 9223372036854775001
	pinnedRID  = "pinned-0001"
)

// counterValue reads one unlabelled-by-rank family of a stand-in's /metrics.
func counterValue(t *testing.T, metricsURL, family string) string {
	t.Helper()
	resp, err := http.Get(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, family+"{") {
			_, value, _ := strings.Cut(line, "} ")
			return value
		}
	}
	t.Fatalf("%s lacks %s", metricsURL, family)
	return ""
}

func decodeRIDs(l *pluginapi.Listing) []string {
	var out []string
	for _, r := range l.DecodeRequests {
		out = append(out, r.RID)
	}
	return out
}

// verdictPeer serves the prefill watchdog's verdict handler on loopback and
// gives the decode watchdog the real verdict client for it: the client
// derives the peer from the decode request's bootstrap_addr (10.0.0.x, an
// allowed network) and its dialer carries every connection to the loopback
// listener, recording the address the client meant to reach.
type verdictPeer struct {
	mu    sync.Mutex
	asked []string
}

func (p *verdictPeer) client(t *testing.T, prefill *watchdog.Watchdog) *pluginapi.VerdictClient {
	t.Helper()
	srv := httptest.NewServer(prefill.VerdictHandler())
	t.Cleanup(srv.Close)
	_, port, _ := net.SplitHostPort(srv.Listener.Addr().String())
	var d net.Dialer
	transport := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		p.mu.Lock()
		p.asked = append(p.asked, addr)
		p.mu.Unlock()
		return d.DialContext(ctx, network, srv.Listener.Addr().String())
	}}
	t.Cleanup(transport.CloseIdleConnections)
	vc, err := pluginapi.NewVerdictClient(pluginapi.VerdictClientOptions{
		URLTemplate: "http://{host}:" + port, Networks: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		Client: &http.Client{Transport: transport}, Timeout: 2 * time.Second, CacheTTL: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	return vc
}

func (p *verdictPeer) addresses() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.asked...)
}

// TestPythonDecodePluginWithTheWatchdog is issue 11's "Done means" with the
// real plugin on both sides: a decode stand-in watched by a decode-side
// watchdog, and the prefill parity stand-in watched by a prefill-side
// watchdog whose verdict endpoint the decode side asks over HTTP. The
// request that never reached prefill is released at once; the request whose
// transfer started is held (transfer_live, no call) while prefill still
// holds its room, and released with prefill_stopped only after the prefill
// watchdog released the room with no chunk in flight; the progressing
// request, the health check and the warm-up are never called.
func TestPythonDecodePluginWithTheWatchdog(t *testing.T) {
	for _, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			tok := tokenFile(t, parityToken)
			decodeURL, decodeMetrics := startStandinScript(t, "standin_decode_server.py", backend, tok,
				"--live-room", "9223372036854775001", "--live-rid", pinnedRID)
			prefillURL, prefillMetrics := startStandin(t, backend, tok)

			l := listingOf(t, decodeURL)
			if l.Server.DisaggregationMode != pluginapi.ModeDecode || len(l.Inflight) != 0 || l.Server.TransferBackend != backend ||
				strings.Join(decodeRIDs(l), " ") != strings.Join([]string{decodeWaitingRID, decodeHealthRID, decodeWarmupRID, pinnedRID, decodeHealthyRID}, " ") {
				t.Fatalf("decode listing: server %+v, inflight %d, decode requests %v", l.Server, len(l.Inflight), decodeRIDs(l))
			}
			for _, r := range l.DecodeRequests {
				if r.RID == pinnedRID && (r.BootstrapRoom != pinnedRoom || r.Queue != pluginapi.DecodeQueueTransfer ||
					r.TransferStarted == nil || !*r.TransferStarted) {
					t.Fatalf("live request %+v", r)
				}
			}
			if pl := listingOf(t, prefillURL); pl.Server.TransferTracking == nil || !*pl.Server.TransferTracking {
				t.Fatalf("prefill server %+v: without transfer_tracking no verdict can be stopped", pl.Server)
			}
			// Called directly, without prefill_stopped, the live transfer is refused.
			client := pluginapi.NewClient(decodeURL, pluginapi.ClientOptions{Timeout: 5 * time.Second, AdminTimeout: 5 * time.Second, Token: parityToken})
			st, resp, err := client.ForceFail(context.Background(), pluginapi.ForceFailRequest{RID: pinnedRID})
			if err != nil || st != http.StatusConflict || resp.Result != pluginapi.ResultTransferLive {
				t.Fatalf("direct force-fail of the live transfer: %d %+v %v, want 409 transfer_live", st, resp, err)
			}

			// Prefill: releases pinned-0001 after a stall window longer than
			// decode's, so that decode first finds the room still queued.
			prefill := runWatchdog(t, watchdog.Config{
				Clock: clock.Real{}, Logger: nopLogger{}, Interval: 200 * time.Millisecond, MetricsInterval: 200 * time.Millisecond,
				Deadline: 60 * time.Second, StallWindow: 4 * time.Second, PinWindow: 2 * time.Minute, MaxRooms: 1000,
				Mode: watchdog.ModeAuto, MaxPerMinute: 6, ConfirmTimeout: 30 * time.Second, MaxAttempts: 3, RetryBackoff: time.Second,
				Metrics: collector.NewMetricsScraper(prefillMetrics, 2*time.Second),
			}, parityToken, []string{prefillURL}, newAdminRecorder(false))
			var peer verdictPeer
			admin := newAdminRecorder(false)
			dec := runWatchdog(t, watchdog.Config{
				Clock: clock.Real{}, Logger: nopLogger{}, Interval: 200 * time.Millisecond, MetricsInterval: 200 * time.Millisecond,
				Deadline: 60 * time.Second, DecodeDeadline: time.Second, StallWindow: time.Second, PinWindow: 2 * time.Minute, MaxRooms: 1000,
				Mode: watchdog.ModeAuto, MaxPerMinute: 6, ConfirmTimeout: 30 * time.Second, MaxAttempts: 3, RetryBackoff: time.Second,
				Metrics:  collector.NewMetricsScraper(decodeMetrics, 2*time.Second),
				Verdicts: peer.client(t, prefill),
			}, parityToken, []string{decodeURL}, admin)

			held := [2]string{watchdog.SkipTransferLive, watchdog.RoleDecode}
			// Mooncake receivers show no progress (-1): healthy-0003 looks
			// stuck until its transfer completes, and is held too (prefill's
			// verdict on its room: unknown), never called.
			wantHeld := uint64(1)
			if backend == sglangsim.BackendMooncake {
				wantHeld = 2
			}
			releasedDecode := [3]string{watchdog.ResultReleased, watchdog.TriggerAuto, watchdog.RoleDecode}
			waitFor(t, "the live transfer held while prefill holds its room", 30*time.Second, func() bool {
				s := dec.Snapshot()
				// Only live-0002's room is in prefill's queue.
				return s.RoleSkips[held] > 0 && s.VerdictLookups[pluginapi.VerdictInQueue] > 0
			})
			if s := prefill.Snapshot(); s.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}] != 0 {
				t.Fatal("prefill released the room before decode asked: the hold was not tested")
			}
			for _, c := range admin.recorded() {
				if c.order.RID == pinnedRID {
					t.Fatalf("called the live transfer while prefill held its room: %+v", c)
				}
			}
			waitFor(t, "both decode requests released and confirmed", 60*time.Second, func() bool {
				return dec.Snapshot().RoleForceFails[releasedDecode] == 2
			})

			l = listingOf(t, decodeURL)
			left := strings.Join(decodeRIDs(l), " ")
			if left != decodeHealthRID+" "+decodeWarmupRID {
				t.Errorf("decode requests after the releases: %s, want the health check and the warm-up (healthy-0003 decodes)", left)
			}
			if b, f := counterValue(t, decodeMetrics, watchdog.BootstrapFailedFamily), counterValue(t, decodeMetrics, "sglang:num_transfer_failed_reqs_total"); b != "1.0" || f != "1.0" {
				t.Errorf("decode counters: bootstrap failed %s, transfer failed %s; want 1.0 each", b, f)
			}
			calls := admin.recorded()
			byRID := map[string]adminCall{}
			for _, c := range calls {
				byRID[c.order.RID] = c
			}
			if len(calls) != 2 || len(byRID) != 2 {
				t.Fatalf("decode admin calls %+v, want one for %s and one for %s", calls, decodeWaitingRID, pinnedRID)
			}
			if c := byRID[decodeWaitingRID]; c.order.PrefillStopped || c.status != http.StatusOK || c.result != pluginapi.ResultFlipped {
				t.Errorf("call for the request that never reached prefill: %+v", c)
			}
			if c := byRID[pinnedRID]; !c.order.PrefillStopped || c.order.BootstrapRoom == nil || *c.order.BootstrapRoom != pinnedRoom ||
				c.status != http.StatusOK || c.result != pluginapi.ResultFlipped {
				t.Errorf("call for the live transfer: %+v, want flipped with prefill_stopped", c)
			}
			s := dec.Snapshot()
			if s.VerdictLookups[pluginapi.VerdictStopped] == 0 || s.RoleSkips[held] != wantHeld {
				t.Errorf("verdict lookups %v, transfer_live skips %d, want %d", s.VerdictLookups, s.RoleSkips[held], wantHeld)
			}
			if others := otherForceFails(s, [2]string{watchdog.ResultReleased, watchdog.TriggerAuto}); len(others) != 0 {
				t.Errorf("other decode force-fails: %v", others)
			}
			// The peer is the host of the held request's bootstrap_addr:
			// live-0002's 10.0.0.8, and healthy-0003's 10.0.0.7 on Mooncake.
			// waiting-0001 (10.0.0.7, no transfer) is never asked.
			asked := map[string]bool{}
			for _, addr := range peer.addresses() {
				host, _, _ := net.SplitHostPort(addr)
				asked[host] = true
			}
			if !asked["10.0.0.8"] || asked["10.0.0.7"] != (backend == sglangsim.BackendMooncake) || len(asked) > 2 {
				t.Errorf("the verdict client asked the peers %v", asked)
			}
			if ps := prefill.Snapshot(); ps.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}] != 1 || ps.LedgerRooms != 1 {
				t.Errorf("prefill: force-fails %v, ledger %d rooms", ps.ForceFails, ps.LedgerRooms)
			}
		})
	}
}

// sceneFree keeps the parts of a decode listing that do not depend on the
// scene: the server, the api version, the prefill fields that are empty on
// decode and the types of the loop fields.
func sceneFree(a answerShape) answerShape {
	out := answerShape{Status: a.Status, Text: a.Text, Fields: map[string]string{}, Values: map[string]interface{}{}}
	for k, typ := range a.Fields {
		if strings.HasPrefix(k, ".decode_requests") || k == ".queues.prealloc" || k == ".queues.transfer" {
			continue
		}
		out.Fields[k] = typ
		if v, ok := a.Values[k]; ok {
			out.Values[k] = v
		}
	}
	return out
}

// TestGoSimulatorAndPythonDecodePluginAnswerAlike compares the simulator's
// decode listener with the real plugin on the decode stand-in where their
// scenes cannot differ: the listing's server block and the fields a decode
// listing keeps empty, and every answer decided before a request is looked
// up (token, body, prefill_stopped's type, an unknown rid). The scenes
// themselves are not comparable: the simulator's decode queues fill from
// its prefill traffic (none in its parity scene), the stand-in's hold a
// fixed set of requests.
func TestGoSimulatorAndPythonDecodePluginAnswerAlike(t *testing.T) {
	for _, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			pyURL, _ := startStandinScript(t, "standin_decode_server.py", backend, tokenFile(t, parityToken))
			sim, ctx := startSim(t, sglangsim.Options{Clock: clock.Real{}, Backend: backend, Token: parityToken, Scenario: sglangsim.ScenarioParity,
				// The stand-in's scene runs with deferred release on (its default);
				// the simulator's default is SGLang's up to v0.5.18: absent.
				DeferredRelease: true})
			_, goURLs, err := sim.ListenDecode(ctx)
			if err != nil {
				t.Fatal(err)
			}
			listing := exchange{name: "listing", method: http.MethodGet, path: pluginapi.PathInflight}
			py, gs := sceneFree(do(t, pyURL, listing)), sceneFree(do(t, goURLs[0], listing))
			if py.Values[".server.disaggregation_mode"] != pluginapi.ModeDecode || !sameAnswer(py, gs) {
				t.Errorf("decode listings differ\n python:    %s\n simulator: %s", dump(py), dump(gs))
			}
			ff := func(name, auth, body string) exchange {
				return exchange{name: name, method: http.MethodPost, path: pluginapi.PathForceFail, auth: auth, body: body}
			}
			bearer := "Bearer " + parityToken
			compare(t, pyURL, goURLs[0], []exchange{
				{name: "healthz", method: http.MethodGet, path: pluginapi.PathHealthz},
				ff("no token", "", `{"rid":"`+decodeLiveRID+`"}`),
				ff("wrong token", "Bearer nope", `{"rid":"`+decodeLiveRID+`"}`),
				ff("not json", bearer, `not json`),
				ff("no rid", bearer, `{}`),
				ff("prefill_stopped not a bool", bearer, `{"rid":"`+decodeLiveRID+`","prefill_stopped":"yes"}`),
				ff("prefill_stopped null", bearer, `{"rid":"`+decodeLiveRID+`","prefill_stopped":null}`),
				ff("unknown rid", bearer, `{"rid":"nobody"}`),
				ff("unknown rid, prefill stopped", bearer, `{"rid":"nobody","prefill_stopped":true}`),
			})
		})
	}
}
