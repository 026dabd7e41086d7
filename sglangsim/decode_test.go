package sglangsim

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func decodeReq(l pluginapi.Listing, rid string) (pluginapi.DecodeRequest, bool) {
	for _, d := range l.DecodeRequests {
		if d.RID == rid {
			return d, true
		}
	}
	return pluginapi.DecodeRequest{}, false
}

func mustDecodeReq(t *testing.T, l pluginapi.Listing, rid string) pluginapi.DecodeRequest {
	t.Helper()
	d, ok := decodeReq(l, rid)
	if !ok {
		t.Fatalf("%s is not in decode's queues: %+v", rid, l.DecodeRequests)
	}
	return d
}

func decodeFF(s *Sim, rid string, stopped, dry bool) (int, pluginapi.ForceFailResponse) {
	return s.DecodeForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid, PrefillStopped: stopped, DryRun: dry},
		"Bearer "+s.opts.Token)
}

func mustDecodeFlip(t *testing.T, s *Sim, rid string, stopped bool, levers ...string) {
	t.Helper()
	st, resp := decodeFF(s, rid, stopped, false)
	if st != 200 || resp.Result != pluginapi.ResultFlipped || !slices.Equal(resp.Levers, levers) {
		t.Fatalf("decode force-fail %s: %d %+v, want flipped %v", rid, st, resp, levers)
	}
}

func decodeMetric(t *testing.T, s *Sim, name string) float64 {
	t.Helper()
	for _, smp := range parseSamples(t, s.DecodeMetricsText()) {
		if smp.name == name {
			return smp.value
		}
	}
	t.Fatalf("no decode series %s", name)
	return 0
}

// TestDecodeListing: both queues, the prefill-fed requests and decode's own
// health checks and warm-ups, per backend, and the JSON on the wire.
func TestDecodeListing(t *testing.T) {
	for _, backend := range []string{BackendNIXL, BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			nixl := backend == BackendNIXL
			s, c := newSim(t, Options{Backend: backend, Era: EraNewest})
			boot, bootRoom := s.Submit(RequestSpec{Bootstrap: time.Minute})
			endless, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: time.Second})
			hc := s.SubmitDecodeHealthCheck(0, false, true)
			warm := s.SubmitDecodeHealthCheck(0, true, true)
			run(s, c, 5*time.Second, 100*time.Millisecond)
			l := s.DecodeListing(0)
			if l.Server.DisaggregationMode != pluginapi.ModeDecode || l.Inflight == nil || len(l.Inflight) != 0 ||
				!slices.Equal(l.Server.Levers, []string{pluginapi.LeverAbort}) || l.Server.DeferredRelease != nil ||
				l.Loop.Iterations != 50 || l.Queues.Prealloc != 1 || l.Queues.Transfer != 3 ||
				l.Queues.Inflight != 0 || l.Server.PID == s.Listing(0).Server.PID {
				t.Fatalf("listing %+v", l)
			}
			b := mustDecodeReq(t, l, boot)
			if b.Queue != pluginapi.DecodeQueuePrealloc || b.Poll != pluginapi.PollBootstrapping || b.BootstrapRoom != bootRoom ||
				b.HealthCheck || *b.TransferStarted || b.AgeSeconds != 5 {
				t.Fatalf("bootstrapping %+v", b)
			}
			e := mustDecodeReq(t, l, endless)
			wantPoll, wantProgress := pluginapi.PollWaitingForInput, int64(4)
			if !nixl {
				wantProgress = -1
			}
			if e.Queue != pluginapi.DecodeQueueTransfer || e.Poll != wantPoll || !*e.TransferStarted ||
				e.Progress != wantProgress || e.ChunksExpected != nil || e.HealthCheck {
				t.Fatalf("transferring %+v", e)
			}
			for _, rid := range []string{hc, warm} {
				d := mustDecodeReq(t, l, rid)
				if d.Queue != pluginapi.DecodeQueueTransfer || !d.HealthCheck || d.BootstrapRoom != 0 ||
					d.BootstrapAddr != FakeBootstrapHost || d.Progress != -1 || *d.TransferStarted {
					t.Fatalf("health check %+v", d)
				}
			}
			if strings.HasPrefix(warm, HealthCheckPrefix) || !strings.HasPrefix(hc, HealthCheckPrefix) {
				t.Fatalf("rids %q %q", hc, warm)
			}
		})
	}

	// A healthy transfer lists its chunks; a health check that succeeds
	// shows once in each queue and leaves.
	s, c := newSim(t, Options{})
	rid, _ := s.Submit(RequestSpec{Transfer: 2 * time.Second, PromptTokens: 4096})
	run(s, c, time.Second, 100*time.Millisecond)
	d := mustDecodeReq(t, s.DecodeListing(0), rid)
	// NIXL's receiver knows the chunk count only from the last chunk.
	if d.ChunksExpected != nil || d.Progress < 1 || d.Progress >= 4 {
		t.Fatalf("healthy %+v", d)
	}
	hc := s.SubmitDecodeHealthCheck(0, false, false)
	var queues []string
	for i := 0; i < 4; i++ {
		c.Advance(100 * time.Millisecond)
		s.Step()
		if d, ok := decodeReq(s.DecodeListing(0), hc); ok {
			queues = append(queues, d.Queue)
		}
	}
	if !slices.Equal(queues, []string{pluginapi.DecodeQueuePrealloc, pluginapi.DecodeQueueTransfer}) {
		t.Fatalf("health check went through %v", queues)
	}
	run(s, c, 2*time.Second, 100*time.Millisecond)
	if r := recordOf(t, s, rid); r.DecodeEnd != DecodeSuccess || r.DecodeReleased.Sub(r.Left) != decodeSuccessLag ||
		r.UnsafeFree != "" || r.DecodeAdmitted.IsZero() {
		t.Fatalf("healthy record %+v", r)
	}

	// On the wire: decode_requests, the decode queues and deferred_release
	// are present even when empty, zero or unknown.
	for _, era := range []string{LeversNewest, LeversEarly} {
		s, _ := newSim(t, Options{LeverEra: era})
		srv := httptest.NewServer(s.DecodePluginHandler(0))
		resp, err := http.Get(srv.URL + pluginapi.PathInflight)
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		srv.Close()
		var m map[string]json.RawMessage
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		var srvm, qm map[string]json.RawMessage
		_ = json.Unmarshal(m["server"], &srvm)
		_ = json.Unmarshal(m["queues"], &qm)
		// No release up to v0.5.18 has deferred release: null in both eras.
		want := "null"
		if string(m["decode_requests"]) != "[]" || string(m["inflight"]) != "[]" || string(qm["prealloc"]) != "0" ||
			string(qm["transfer"]) != "0" || string(srvm["deferred_release"]) != want ||
			string(srvm["disaggregation_mode"]) != `"decode"` {
			t.Fatalf("%s: %s", era, raw)
		}
	}
}

// TestDecodeForceFailAnswers: every answer of the round 3 decode rules.
func TestDecodeForceFailAnswers(t *testing.T) {
	s, c := newSim(t, Options{Token: "tok", OrderTimeout: 50 * time.Millisecond})
	boot, bootRoom := s.Submit(RequestSpec{Bootstrap: time.Minute})
	live, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: time.Second})
	done, _ := s.Submit(RequestSpec{Transfer: time.Second})
	hc := s.SubmitDecodeHealthCheck(0, false, true)
	warm := s.SubmitDecodeHealthCheck(0, true, true)
	run(s, c, 500*time.Millisecond, 100*time.Millisecond)

	ctx := context.Background()
	if st, resp := s.DecodeForceFail(ctx, 0, pluginapi.ForceFailRequest{RID: live}, "Bearer nope"); st != 401 ||
		resp.Result != pluginapi.ResultUnauthorized {
		t.Fatalf("wrong token: %d %+v", st, resp)
	}
	if st, resp := decodeFF(s, "nope", false, false); st != 404 || resp.Result != pluginapi.ResultNotFound {
		t.Fatalf("unknown rid: %d %+v", st, resp)
	}
	other := bootRoom + 1
	if st, resp := s.DecodeForceFail(ctx, 0, pluginapi.ForceFailRequest{RID: boot, BootstrapRoom: &other}, "Bearer tok"); st != 409 ||
		resp.Result != pluginapi.ResultRoomMismatch || *resp.BootstrapRoom != bootRoom {
		t.Fatalf("room mismatch: %d %+v", st, resp)
	}
	for _, rid := range []string{hc, warm} {
		for _, dry := range []bool{false, true} {
			if st, resp := decodeFF(s, rid, true, dry); st != 409 || resp.Result != pluginapi.ResultHealthCheck {
				t.Fatalf("health check %s: %d %+v", rid, st, resp)
			}
		}
	}
	for _, dry := range []bool{false, true} {
		if st, resp := decodeFF(s, live, false, dry); st != 409 || resp.Result != pluginapi.ResultTransferLive {
			t.Fatalf("live transfer (dry run %v): %d %+v", dry, st, resp)
		}
	}
	if st, resp := decodeFF(s, live, true, true); st != 200 || resp.Result != pluginapi.ResultWouldFlip ||
		!slices.Equal(resp.Levers, []string{pluginapi.LeverAbort}) ||
		resp.Lever != pluginapi.LeverConcludeState {
		t.Fatalf("dry run: %d %+v", st, resp)
	}
	// Prefill delivered every chunk, decode has not polled yet.
	s.PauseDecodeLoop(0, true)
	run(s, c, 2*time.Second, 100*time.Millisecond)
	s.PauseDecodeLoop(0, false)
	if st, resp := decodeFF(s, done, true, false); st != 409 || resp.Result != pluginapi.ResultTransferSucceeded {
		t.Fatalf("succeeded: %d %+v", st, resp)
	}
	// The prealloc request: abort only; its next pass counts a bootstrap failure.
	mustDecodeFlip(t, s, boot, false, pluginapi.LeverAbort)
	if st, resp := decodeFF(s, boot, false, false); st != 200 || resp.Result != pluginapi.ResultAlreadyFailed {
		t.Fatalf("again: %d %+v", st, resp)
	}
	s.Step()
	if _, ok := decodeReq(s.DecodeListing(0), boot); ok || decodeMetric(t, s, "sglang:num_bootstrap_failed_reqs_total") != 1 ||
		decodeMetric(t, s, "sglang:num_transfer_failed_reqs_total") != 0 {
		t.Fatalf("after the flip: %+v", s.DecodeListing(0))
	}
	if r := recordOf(t, s, boot); r.DecodeEnd != DecodeForceFail || r.DecodeForcedAt.IsZero() || r.DecodeReleased.IsZero() {
		t.Fatalf("record %+v", r)
	}
	// A paused loop never picks the order up.
	s.PauseDecodeLoop(0, true)
	if st, resp := decodeFF(s, live, true, true); st != 503 || resp.Result != pluginapi.ResultSchedulerUnresponsive {
		t.Fatalf("paused: %d %+v", st, resp)
	}
	s.PauseDecodeLoop(0, false)
	s.RestartDecode()
	if st, _ := decodeFF(s, live, true, true); st != 503 {
		t.Fatalf("booting: %d", st)
	}

	s, c = newSim(t, Options{LeverEra: LeversEarly})
	rid, _ := s.Submit(RequestSpec{Bootstrap: time.Minute})
	run(s, c, time.Second, 100*time.Millisecond)
	if l := s.DecodeListing(0); len(l.Server.Levers) != 0 || l.Server.LeverNote == "" || l.Server.DeferredRelease != nil {
		t.Fatalf("early: %+v", l.Server)
	}
	if st, resp := decodeFF(s, rid, true, true); st != 501 || resp.Result != pluginapi.ResultUnsupported {
		t.Fatalf("early: %d %+v", st, resp)
	}

	// Mid-2025 NIXL's receiver has the lever its sender lacks.
	s, c = newSim(t, Options{LeverEra: LeversNIXLMid2025})
	rid, _ = s.Submit(RequestSpec{Bootstrap: time.Minute})
	run(s, c, time.Second, 100*time.Millisecond)
	if l := s.DecodeListing(0); !slices.Equal(l.Server.Levers, []string{pluginapi.LeverAbort}) || l.Server.DeferredRelease != nil {
		t.Fatalf("mid-2025 NIXL: %+v", l.Server)
	}
	mustDecodeFlip(t, s, rid, true, pluginapi.LeverAbort)
	run(s, c, 100*time.Millisecond, 100*time.Millisecond)
	if r := recordOf(t, s, rid); r.DecodeEnd != DecodeForceFail {
		t.Fatalf("mid-2025 NIXL, after the lever: %+v", r)
	}
}

// TestDecodeForceFailHTTP: the decode listener parses prefill_stopped and
// answers as the API says.
func TestDecodeForceFailHTTP(t *testing.T) {
	s, c := newSim(t, Options{})
	live, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: time.Second})
	run(s, c, 2*time.Second, 100*time.Millisecond)
	srv := httptest.NewServer(s.DecodePluginHandler(0))
	defer srv.Close()
	post := func(body string) (int, pluginapi.ForceFailResponse) {
		resp, err := http.Post(srv.URL+pluginapi.PathForceFail, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var ff pluginapi.ForceFailResponse
		_ = json.NewDecoder(resp.Body).Decode(&ff)
		return resp.StatusCode, ff
	}
	if st, ff := post(`{"rid":"` + live + `","prefill_stopped":"yes"}`); st != 400 || ff.Result != pluginapi.ResultBadRequest {
		t.Fatalf("bad prefill_stopped: %d %+v", st, ff)
	}
	if st, ff := post(`{"rid":"` + live + `"}`); st != 409 || ff.Result != pluginapi.ResultTransferLive {
		t.Fatalf("live: %d %+v", st, ff)
	}
	if st, ff := post(`{"rid":"` + live + `","prefill_stopped":true,"dry_run":true}`); st != 200 || ff.Result != pluginapi.ResultWouldFlip {
		t.Fatalf("dry run: %d %+v", st, ff)
	}
}

// TestDecodeLeverDeferred: the lever frees pages through SGLang's path:
// with deferred release, at once when prefill acknowledges the abort (it
// holds no chunk of the room), after 30 s when it never does (a wedged
// worker); without deferred release, at once either way.
func TestDecodeLeverDeferred(t *testing.T) {
	// Deferred release as later upstream code has it when turned on.
	s, c := newSim(t, Options{DeferredRelease: true})
	absent, _ := s.Inject(0, PinAbortBeforeRegister)
	wedged, _ := s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, DecodePort: 17001})
	run(s, c, 5*time.Second, 100*time.Millisecond)
	if d := mustDecodeReq(t, s.DecodeListing(0), absent); !*d.TransferStarted || d.Progress != 0 {
		t.Fatalf("absent room %+v", d)
	}
	// Its metadata went out: prefill_stopped is needed (prefill dropped
	// the room).
	mustDecodeFlip(t, s, absent, true, pluginapi.LeverAbort, pluginapi.LeverDeferredAbort)
	mustDecodeFlip(t, s, wedged, true, pluginapi.LeverAbort, pluginapi.LeverDeferredAbort)
	flipAt := c.Now()
	run(s, c, 100*time.Millisecond, 100*time.Millisecond)
	l := s.DecodeListing(0)
	if len(l.DecodeRequests) != 0 || decodeMetric(t, s, "sglang:num_transfer_failed_reqs_total") != 2 {
		t.Fatalf("after the flips: %+v", l)
	}
	if r := recordOf(t, s, absent); r.DecodeEnd != DecodeForceFail || !r.DecodeReleased.Equal(flipAt.Add(100*time.Millisecond)) ||
		r.UnsafeFree != "" {
		t.Fatalf("acknowledged: %+v", r)
	}
	if r := recordOf(t, s, wedged); !r.DecodeReleased.IsZero() {
		t.Fatalf("the wedged room's pages were freed before 30 s: %+v", r)
	}
	run(s, c, DeferredReleaseTimeout, 100*time.Millisecond)
	if r := recordOf(t, s, wedged); !r.DecodeReleased.Equal(flipAt.Add(100*time.Millisecond+DeferredReleaseTimeout)) ||
		r.UnsafeFree != DecodeForceFail {
		t.Fatalf("deferred: %+v", r)
	}

	s2, c2 := newSim(t, Options{})
	w2, _ := s2.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle})
	run(s2, c2, 5*time.Second, 100*time.Millisecond)
	mustDecodeFlip(t, s2, w2, true, pluginapi.LeverAbort)
	s2.Step()
	if r := recordOf(t, s2, w2); r.DecodeReleased.IsZero() || r.UnsafeFree != DecodeForceFail {
		t.Fatalf("without deferred release: %+v", r)
	}
}

// TestDecodeWaitingTimeout: both backends time out a room that never
// started and a started incomplete one (the wedged handle: an unsafe free
// by SGLang's own timeout, at once: no release up to v0.5.18 defers it),
// since no decode receiver reads Transferring.
func TestDecodeWaitingTimeout(t *testing.T) {
	for _, backend := range []string{BackendNIXL, BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			s, c := newSim(t, Options{Backend: backend})
			start := c.Now()
			absent, _ := s.Inject(0, PinAbortBeforeRegister)
			wedged, _ := s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, DecodePort: 17001})
			behind, _ := s.Submit(RequestSpec{DecodePort: 17005, Transfer: time.Second})
			run(s, c, DefaultDecodeWaitingTimeout-time.Second, time.Second)
			if l := s.DecodeListing(0); len(l.DecodeRequests) != 3 {
				t.Fatalf("before the timeout: %+v", l.DecodeRequests)
			}
			run(s, c, 2*time.Second, 100*time.Millisecond)
			for _, rid := range []string{absent, behind} {
				if r := recordOf(t, s, rid); r.DecodeEnd != DecodeTimeout || !r.DecodeReleased.Equal(start.Add(DefaultDecodeWaitingTimeout)) ||
					r.UnsafeFree != "" {
					t.Fatalf("%s: %+v", rid, r)
				}
			}
			run(s, c, 5*time.Minute, time.Second)
			r := recordOf(t, s, wedged)
			if r.DecodeEnd != DecodeTimeout || r.UnsafeFree != DecodeTimeout ||
				!r.DecodeReleased.Equal(start.Add(DefaultDecodeWaitingTimeout)) {
				// No deferred release up to v0.5.18: the timeout frees the
				// pages at once, under the wedged handle's live write.
				t.Fatalf("wedged: %+v", r)
			}
			if v := decodeMetric(t, s, "sglang:num_transfer_failed_reqs_total"); v != 3 {
				t.Fatalf("transfer failures %v", v)
			}
		})
	}
}

// TestDecodeHeartbeat: after a prefill restart decode fails the dead
// prefill's rooms within HeartbeatDetection, in both queues, safely (a
// dead prefill writes no more).
func TestDecodeHeartbeat(t *testing.T) {
	s, c := newSim(t, Options{Backend: BackendMooncake})
	boot, _ := s.Submit(RequestSpec{Bootstrap: time.Hour})
	wedged, _ := s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle})
	run(s, c, 10*time.Second, 100*time.Millisecond)
	restartAt := c.Now()
	s.Restart()
	run(s, c, HeartbeatDetection-time.Second, 100*time.Millisecond)
	if l := s.DecodeListing(0); len(l.DecodeRequests) != 2 {
		t.Fatalf("decode let go before its heartbeat: %+v", l.DecodeRequests)
	}
	run(s, c, 2*time.Second, 100*time.Millisecond)
	for _, rid := range []string{boot, wedged} {
		if r := recordOf(t, s, rid); r.DecodeEnd != DecodeHeartbeat || !r.DecodeReleased.Equal(restartAt.Add(HeartbeatDetection)) ||
			r.UnsafeFree != "" {
			t.Fatalf("%s: %+v", rid, r)
		}
	}
	if decodeMetric(t, s, "sglang:num_bootstrap_failed_reqs_total") != 1 || decodeMetric(t, s, "sglang:num_transfer_failed_reqs_total") != 1 {
		t.Fatalf("counters:\n%s", s.DecodeMetricsText())
	}
}

// TestDecodeCorruption is the key test: freeing the pages of a decode
// request whose prefill chunk is still outstanding (the stuck handle, with
// prefill_stopped asserted wrongly) records an unsafe free, and the late
// write lands in the request that reuses the pages. Freeing one whose
// prefill has no chunk in flight (the resurrection and ABORT-before-register
// pins, a room queued behind the wedge) records nothing.
func TestDecodeCorruption(t *testing.T) {
	for _, tc := range []struct {
		name            string
		spec            RequestSpec
		started, unsafe bool
	}{
		{"stuck handle", RequestSpec{Behavior: BehaviorPinStuckHandle, DecodePort: 17002}, true, true},
		{"resurrection", RequestSpec{Behavior: BehaviorPinResurrection, DecodePort: 17002}, true, false},
		{"abort before register", RequestSpec{Behavior: BehaviorPinAbortBeforeRegister, DecodePort: 17002}, true, false},
		{"behind the wedge", RequestSpec{DecodePort: 17005, Transfer: time.Second}, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, c := newSim(t, Options{})
			s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, DecodePort: 17001, Bootstrap: time.Millisecond})
			run(s, c, time.Second, 100*time.Millisecond)
			rid, _ := s.Submit(tc.spec)
			run(s, c, 5*time.Second, 100*time.Millisecond)
			if d := mustDecodeReq(t, s.DecodeListing(0), rid); *d.TransferStarted != tc.started {
				t.Fatalf("decode's view: %+v", d)
			}
			mustDecodeFlip(t, s, rid, true, pluginapi.LeverAbort)
			run(s, c, DeferredReleaseTimeout+time.Second, 100*time.Millisecond)
			r := recordOf(t, s, rid)
			if r.DecodeReleased.IsZero() || r.DecodeEnd != DecodeForceFail {
				t.Fatalf("not freed: %+v", r)
			}
			if d, ok := decodeReq(s.DecodeListing(0), rid); ok {
				t.Fatalf("still listed after the flip: %+v", d)
			}
			// The next request gets the freed pages.
			next, _ := s.Submit(RequestSpec{DecodePort: 17003, Transfer: 10 * time.Second})
			run(s, c, 3*time.Second, 100*time.Millisecond)
			victim := recordOf(t, s, next)
			cs := s.Corruptions()
			if !tc.unsafe {
				if r.UnsafeFree != "" || victim.CorruptedBy != "" || len(cs) != 0 {
					t.Fatalf("a safe release corrupted: %+v %+v %+v", r, victim, cs)
				}
				return
			}
			if r.UnsafeFree != DecodeForceFail || victim.CorruptedBy != rid || len(cs) != 1 || cs[0].Writer != rid ||
				cs[0].Victim != next || cs[0].Cause != DecodeForceFail {
				t.Fatalf("no corruption recorded: %+v %+v %+v", r, victim, cs)
			}
		})
	}
}

// TestDecodeHoldTimes: what the benchmarks compare. Stock SGLang holds the
// decode slot of a request prefill failed for the waiting timeout; an early
// decode release frees it at once.
func TestDecodeHoldTimes(t *testing.T) {
	hold := func(early bool) time.Duration {
		s, c := newSim(t, Options{})
		rid, _ := s.Inject(0, PinResurrection)
		run(s, c, 5*time.Second, 100*time.Millisecond)
		flip(t, s, 0, rid)
		if early {
			mustDecodeFlip(t, s, rid, true, pluginapi.LeverAbort)
		}
		run(s, c, DefaultDecodeWaitingTimeout, time.Second)
		r := recordOf(t, s, rid)
		if r.DecodeReleased.IsZero() || r.UnsafeFree != "" {
			t.Fatalf("%+v", r)
		}
		return r.DecodeHold()
	}
	if stock, early := hold(false), hold(true); stock != DefaultDecodeWaitingTimeout || early > 6*time.Second {
		t.Fatalf("hold times: stock %v, early %v", stock, early)
	}
}

// TestDecodeMetricsLabels: decode series follow the prefill side's label
// eras, with engine_type="decode" in the newest.
func TestDecodeMetricsLabels(t *testing.T) {
	for _, tc := range []struct {
		era    string
		labels string
	}{
		{EraNewest, `dp_rank="1",engine_type="decode",model_name="m",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"`},
		{EraV05, `dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"`},
		{EraName, `name="m"`},
	} {
		s, c := newSim(t, Options{Era: tc.era, DecodeDPSize: 2, ModelName: "m", DecodePorts: []int{17000, 17001}})
		s.Submit(RequestSpec{DecodePort: 17000, Bootstrap: time.Hour})
		s.Submit(RequestSpec{DecodePort: 17001, Bootstrap: time.Hour})
		// With nothing decoding, only the idle refresh writes the gauges.
		run(s, c, 31*time.Second, 100*time.Millisecond)
		body := string(s.DecodeMetricsText())
		if !strings.Contains(body, "sglang:num_decode_prealloc_queue_reqs{"+tc.labels+"} 1.0\n") ||
			!strings.Contains(body, "# TYPE sglang:num_transfer_failed_reqs_total counter") {
			t.Fatalf("%s:\n%s", tc.era, body)
		}
	}
}

// TestListenDecode: the decode pod's listeners; they close while the
// decode server boots.
func TestListenDecode(t *testing.T) {
	s, _ := newSim(t, Options{DecodeDPSize: 2})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	metricsURL, urls, err := s.ListenDecode(ctx)
	if err != nil || len(urls) != 2 {
		t.Fatal(urls, err)
	}
	if l := getListing(t, urls[1]); l.Server.DPRank != 1 || l.Server.DisaggregationMode != pluginapi.ModeDecode {
		t.Fatalf("%+v", l.Server)
	}
	resp, err := http.Get(metricsURL)
	if err != nil || resp.StatusCode != 200 {
		t.Fatal(resp, err)
	}
	resp.Body.Close()
	s.RestartDecode()
	if resp, err := http.Get(metricsURL); err == nil {
		resp.Body.Close()
		t.Fatal("decode /metrics answered while booting")
	}
}

// TestDecodeLive: with Start running, a decode order is picked up by the
// decode rank's own loop and the request leaves on its next pass.
func TestDecodeLive(t *testing.T) {
	s, c := newSim(t, Options{})
	rid, _ := s.Inject(0, PinAbortBeforeRegister)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s.Start(ctx)
	c.Advance(time.Second)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if d, ok := decodeReq(s.DecodeListing(0), rid); ok && d.Queue == pluginapi.DecodeQueueTransfer {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("never reached the transfer queue: %+v", s.DecodeListing(0))
		}
		time.Sleep(time.Millisecond)
	}
	mustDecodeFlip(t, s, rid, true, pluginapi.LeverAbort)
	for {
		if r := recordOf(t, s, rid); r.DecodeEnd == DecodeForceFail && !r.DecodeReleased.IsZero() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not released: %+v", recordOf(t, s, rid))
		}
		time.Sleep(time.Millisecond)
	}
}

// TestDecodeRestart: POST /admin/restart on a decode listener restarts the
// decode server only; its requests are lost, and a request that arrives
// while it boots is seen once it is back.
func TestDecodeRestart(t *testing.T) {
	s, c := newSim(t, Options{Token: "tok", AllowRestart: true})
	lost, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1})
	run(s, c, time.Second, 100*time.Millisecond)
	pid, prefillPID := s.DecodeListing(0).Server.PID, s.Listing(0).Server.PID
	if st, rr := s.DecodeAdminRestart(0, pluginapi.RestartRequest{PID: prefillPID}, "Bearer tok"); st != 409 || rr.PID != pid {
		t.Fatalf("prefill's pid: %d %+v", st, rr)
	}
	if st, rr := s.DecodeAdminRestart(0, pluginapi.RestartRequest{PID: pid}, "Bearer tok"); st != 202 || rr.Result != pluginapi.ResultRestarting {
		t.Fatalf("restart: %d %+v", st, rr)
	}
	restartAt := c.Now()
	if !s.DecodeBooting() || s.Booting() {
		t.Fatal("the wrong server went down")
	}
	if r := recordOf(t, s, lost); r.DecodeEnd != DecodeRestarted || !r.DecodeReleased.Equal(restartAt) {
		t.Fatalf("lost: %+v", r)
	}
	late, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1})
	run(s, c, DefaultBootTime+time.Second, 100*time.Millisecond)
	l := s.DecodeListing(0)
	if l.Server.PID == pid || s.Listing(0).Server.PID != prefillPID {
		t.Fatalf("pids after the restart: decode %d, prefill %d", l.Server.PID, s.Listing(0).Server.PID)
	}
	if d := mustDecodeReq(t, l, late); d.AgeSeconds != 1 {
		t.Fatalf("late arrival %+v", d)
	}
	if _, ok := decodeReq(l, lost); ok {
		t.Fatal("a request survived the decode restart")
	}
}

// TestDecodePP: decode hears from every prefill PP stage: progress sums
// the stages' chunks, and the request succeeds only when every stage
// delivered; a pin on one stage keeps it waiting.
func TestDecodePP(t *testing.T) {
	s, c := newSim(t, Options{PPSize: 2})
	rid, _ := s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, PinStages: []int{1}, PromptTokens: 4096,
		Transfer: 2 * time.Second, FreezeAt: 2})
	run(s, c, 5*time.Second, 100*time.Millisecond)
	d := mustDecodeReq(t, s.DecodeListing(0), rid)
	// Stage 0's last chunk arrived, stage 1's never will: the count stays
	// unknown, as NIXL sums it only once every stage's last chunk is in.
	if d.ChunksExpected != nil || d.Progress != 4+2 || !*d.TransferStarted {
		t.Fatalf("PP2 %+v", d)
	}
	if st, resp := decodeFF(s, rid, false, true); st != 409 || resp.Result != pluginapi.ResultTransferLive {
		t.Fatalf("%d %+v", st, resp)
	}
}

// TestDecodeSuccessLeavesPrealloc: SGLang's prefill writes nothing before
// decode preallocated and sent its metadata, so no request sits in the
// prealloc queue with a receiver reading Success. When the simulator's
// prefill finishes first (decode's loop was paused), decode moves the
// request on: the transfer queue's next poll reads Success and the request
// decodes and frees its pages, as every finished transfer does.
func TestDecodeSuccessLeavesPrealloc(t *testing.T) {
	s, c := newSim(t, Options{})
	s.PauseDecodeLoop(0, true)
	rid, _ := s.Submit(RequestSpec{Transfer: time.Second})
	run(s, c, 3*time.Second, 100*time.Millisecond)
	if r := recordOf(t, s, rid); r.Outcome != OutcomeSuccess {
		t.Fatalf("prefill should have finished while decode was paused: %+v", r)
	}
	s.PauseDecodeLoop(0, false)
	s.Step() // admits it to the prealloc queue
	if d := mustDecodeReq(t, s.DecodeListing(0), rid); d.Queue != pluginapi.DecodeQueuePrealloc {
		t.Fatalf("after admission: %+v", d)
	}
	c.Advance(10 * time.Millisecond)
	s.Step()
	if d := mustDecodeReq(t, s.DecodeListing(0), rid); d.Queue != pluginapi.DecodeQueueTransfer || d.Poll != "Success" {
		t.Fatalf("a receiver reading Success must leave the prealloc queue: %+v", d)
	}
	run(s, c, time.Second, 10*time.Millisecond)
	if _, ok := decodeReq(s.DecodeListing(0), rid); ok {
		t.Fatalf("still queued: %+v", s.DecodeListing(0))
	}
	if r := recordOf(t, s, rid); r.DecodeEnd != DecodeSuccess || r.DecodeReleased.IsZero() {
		t.Fatalf("record %+v", r)
	}
}

// TestDecodeWaitingForMemory (issue 18): with every page slot taken, a
// handshaken request waits in the prealloc queue, listed as waiting for
// memory; it moves on once a slot frees, and SGLang's waiting timeout
// counts from then (send_metadata), not from its arrival.
func TestDecodeWaitingForMemory(t *testing.T) {
	s, c := newSim(t, Options{Backend: BackendMooncake, DecodeSlots: 1})
	holder, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: time.Second})
	run(s, c, 2*time.Second, 100*time.Millisecond)
	waiting, _ := s.Submit(RequestSpec{Behavior: BehaviorSlow, Transfer: -1, ChunkEvery: time.Second})
	run(s, c, 5*time.Second, 100*time.Millisecond)
	l := s.DecodeListing(0)
	if h := mustDecodeReq(t, l, holder); h.Queue != pluginapi.DecodeQueueTransfer || h.WaitingForMemory {
		t.Fatalf("the holder of the only slot: %+v", h)
	}
	if w := mustDecodeReq(t, l, waiting); w.Queue != pluginapi.DecodeQueuePrealloc || w.Poll != pluginapi.PollWaitingForInput || !w.WaitingForMemory {
		t.Fatalf("want it waiting for memory in the prealloc queue: %+v", w)
	}
	run(s, c, 240*time.Second, time.Second)
	if w := mustDecodeReq(t, s.DecodeListing(0), waiting); !w.WaitingForMemory {
		t.Fatalf("the only slot is still held, but: %+v", w)
	}
	mustDecodeFlip(t, s, holder, true, pluginapi.LeverAbort)
	run(s, c, 3*time.Second, 100*time.Millisecond)
	if w := mustDecodeReq(t, s.DecodeListing(0), waiting); w.Queue != pluginapi.DecodeQueueTransfer || w.WaitingForMemory {
		t.Fatalf("a slot freed, but: %+v", w)
	}
	run(s, c, 150*time.Second, time.Second)
	if w := mustDecodeReq(t, s.DecodeListing(0), waiting); w.AgeSeconds < 390 {
		t.Fatalf("past SGLang's waiting timeout from its arrival: %+v, want it still transferring", w)
	}
}

// TestDecodeStartedOnceMetadataSent: a decode request in the transfer queue
// has sent its destination metadata, so prefill may write into its pages at
// any moment even though prefill's worker has posted no chunk yet (a healthy
// room queued behind a wedged one): SGLang's receiver says so (NIXL
// started_transfer, Mooncake init_time, both set in send_metadata in
// v0.5.18), the plugin lists transfer_started true and refuses an order
// without prefill_stopped. One still in the prealloc queue sent nothing.
// Before the fix the simulator listed the queued room as not started, and
// the watchdog freed its pages with prefill's write about to start.
func TestDecodeStartedOnceMetadataSent(t *testing.T) {
	for _, backend := range []string{BackendNIXL, BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			s, c := newSim(t, Options{Backend: backend, DecodeSlots: 2})
			s.Submit(RequestSpec{Behavior: BehaviorPinStuckHandle, DecodePort: 17001, Bootstrap: time.Millisecond})
			run(s, c, time.Second, 100*time.Millisecond)
			queued, _ := s.Submit(RequestSpec{DecodePort: 17001, Transfer: time.Second})
			run(s, c, 2*time.Second, 100*time.Millisecond)
			waiting, _ := s.Submit(RequestSpec{DecodePort: 17002, Transfer: time.Second})
			run(s, c, 3*time.Second, 100*time.Millisecond)
			l := s.DecodeListing(0)
			d := mustDecodeReq(t, l, queued)
			if d.Queue != pluginapi.DecodeQueueTransfer || d.Poll != pluginapi.PollWaitingForInput || d.Progress > 0 || !*d.TransferStarted {
				t.Fatalf("queued behind the wedge: %+v started %v, want transfer_started", d, *d.TransferStarted)
			}
			if w := mustDecodeReq(t, l, waiting); w.Queue != pluginapi.DecodeQueuePrealloc || *w.TransferStarted {
				t.Fatalf("waiting for memory: %+v started %v, want not started", w, *w.TransferStarted)
			}
			if st, ff := decodeFF(s, queued, false, false); st != 409 || ff.Result != pluginapi.ResultTransferLive {
				t.Fatalf("an order without prefill_stopped: %d %+v, want transfer_live", st, ff)
			}
			run(s, c, time.Second, 100*time.Millisecond)
			if r := recordOf(t, s, queued); !r.DecodeReleased.IsZero() {
				t.Fatalf("freed: %+v", r)
			}
		})
	}
}
