package sglangsim

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

type httpAnswer struct {
	status int
	body   map[string]any
	typed  pluginapi.ForceFailResponse
}

func post(t *testing.T, url, token, body string) httpAnswer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+pluginapi.PathForceFail, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("content type %q for %s", ct, raw)
	}
	a := httpAnswer{status: resp.StatusCode}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&a.body); err != nil {
		t.Fatalf("body %q: %v", raw, err)
	}
	if err := json.Unmarshal(raw, &a.typed); err != nil {
		t.Fatal(err)
	}
	return a
}

// fields checks that the body has exactly these keys.
func fields(t *testing.T, a httpAnswer, keys ...string) {
	t.Helper()
	if len(a.body) != len(keys) {
		t.Fatalf("body %v, want keys %v", a.body, keys)
	}
	for _, k := range keys {
		if _, ok := a.body[k]; !ok {
			t.Fatalf("body %v lacks %q", a.body, k)
		}
	}
}

func getListing(t *testing.T, url string) pluginapi.Listing {
	t.Helper()
	resp, err := http.Get(url + pluginapi.PathInflight)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("listing: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var l pluginapi.Listing
	if err := json.NewDecoder(resp.Body).Decode(&l); err != nil {
		t.Fatal(err)
	}
	return l
}

func TestForceFailHTTPStatuses(t *testing.T) {
	s, c := newSim(t, Options{Token: "s3cret", DPSize: 2})
	srv := httptest.NewServer(s.PluginHandler(1))
	defer srv.Close()
	if !strings.HasPrefix(srv.URL, "http://127.0.0.1:") {
		t.Fatalf("test server on %s", srv.URL)
	}
	const auth = "Bearer s3cret"
	rid, rm := s.Inject(1, PinAbortBeforeRegister)
	hcRID, _ := s.Submit(RequestSpec{Rank: 1, Behavior: BehaviorStuckHealthCheck})
	run(s, c, time.Minute, time.Second)

	// /healthz
	resp, err := http.Get(srv.URL + pluginapi.PathHealthz)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "ok" {
		t.Fatalf("healthz: %d %q", resp.StatusCode, b)
	}

	// 401: missing, wrong, wrong scheme. Decided before the body is read.
	for _, tok := range []string{"", "Bearer nope", "Basic s3cret", "s3cret", "Bearer s3cret2"} {
		a := post(t, srv.URL, tok, `{"rid":"`+rid+`"}`)
		if a.status != 401 || a.typed.Result != pluginapi.ResultUnauthorized {
			t.Fatalf("token %q: %+v", tok, a)
		}
		fields(t, a, "result", "error")
	}
	if a := post(t, srv.URL, "", "not json"); a.status != 401 {
		t.Fatalf("401 must come before 400: %+v", a)
	}

	// 400 bodies.
	big := `{"rid":"x","reason":"` + strings.Repeat("a", MaxBodyBytes) + `"}`
	for _, body := range []string{
		"not json", "", "[1,2]", `"rid"`, "null", `{}`, `{"rid":null}`, `{"rid":""}`, `{"rid":5}`,
		`{"rid":"x","bootstrap_room":-1}`, `{"rid":"x","bootstrap_room":1.5}`, `{"rid":"x","bootstrap_room":1e3}`,
		`{"rid":"x","bootstrap_room":18446744073709551616}`, `{"rid":"x","bootstrap_room":"12"}`,
		`{"rid":"x","bootstrap_room":true}`, `{"rid":"x","dry_run":"yes"}`, `{"rid":"x","dry_run":1}`,
		`{"rid":"x"} {"rid":"y"}`, `{"rid":"x"}]`, big,
	} {
		a := post(t, srv.URL, auth, body)
		if a.status != 400 || a.typed.Result != pluginapi.ResultBadRequest {
			t.Fatalf("body %.60q: %+v", body, a)
		}
		fields(t, a, "result", "error")
	}
	// Exactly 64 KiB is accepted (and then not found).
	exact := `{"rid":"x","reason":"`
	exact += strings.Repeat("a", MaxBodyBytes-len(exact)-2) + `"}`
	if a := post(t, srv.URL, auth, exact); a.status != 404 {
		t.Fatalf("64 KiB body: %+v", a)
	}

	// 404 and 409.
	a := post(t, srv.URL, auth, `{"rid":"nope","bootstrap_room":1}`)
	if a.status != 404 || a.typed.Result != pluginapi.ResultNotFound || a.typed.RID != "nope" {
		t.Fatalf("404: %+v", a)
	}
	fields(t, a, "result", "rid", "error")
	a = post(t, srv.URL, auth, `{"rid":"`+rid+`","bootstrap_room":12345}`)
	if a.status != 409 || a.typed.Result != pluginapi.ResultRoomMismatch || *a.typed.BootstrapRoom != rm {
		t.Fatalf("409: %+v", a)
	}
	fields(t, a, "result", "rid", "bootstrap_room", "error")
	// The rid is on rank 1 only.
	srv0 := httptest.NewServer(s.PluginHandler(0))
	defer srv0.Close()
	if a := post(t, srv0.URL, auth, `{"rid":"`+rid+`"}`); a.status != 404 {
		t.Fatalf("other rank: %+v", a)
	}

	// 200: would_flip changes nothing, flipped, then already_failed.
	roomJSON := `,"bootstrap_room":` + json.Number(u64(rm)).String()
	a = post(t, srv.URL, auth, `{"rid":"`+rid+`"`+roomJSON+`,"dry_run":true,"reason":"test"}`)
	if a.status != 200 || a.typed.Result != pluginapi.ResultWouldFlip || a.typed.Lever != pluginapi.LeverSendFailed ||
		*a.typed.BootstrapRoom != rm || a.typed.AppliedUnix != unixSeconds(c.Now()) {
		t.Fatalf("dry run: %+v", a)
	}
	fields(t, a, "result", "rid", "bootstrap_room", "lever", "levers", "applied_unix")
	if !slices.Equal(a.typed.Levers, []string{pluginapi.LeverAbort, pluginapi.LeverSendFailed}) {
		t.Fatalf("dry run levers %v", a.typed.Levers)
	}
	if rq, _ := room(getListing(t, srv.URL), rid); rq.SendFailed {
		t.Fatal("dry run set the lever")
	}
	a = post(t, srv.URL, "bearer s3cret", `{"rid":"`+rid+`"`+roomJSON+`,"dry_run":false}`)
	if a.status != 200 || a.typed.Result != pluginapi.ResultFlipped {
		t.Fatalf("flip: %+v", a)
	}
	fields(t, a, "result", "rid", "bootstrap_room", "lever", "levers", "applied_unix")
	if rq, _ := room(getListing(t, srv.URL), rid); !rq.SendFailed {
		t.Fatal("lever not visible in the listing")
	}
	for _, dry := range []string{"false", "true"} {
		a = post(t, srv.URL, auth, `{"rid":"`+rid+`","dry_run":`+dry+`}`)
		if a.status != 200 || a.typed.Result != pluginapi.ResultAlreadyFailed {
			t.Fatalf("already failed (dry_run %s): %+v", dry, a)
		}
	}
	// A health check is refused, dry runs too; room 0 is present.
	for _, dry := range []string{"true", "false"} {
		a = post(t, srv.URL, auth, `{"rid":"`+hcRID+`","bootstrap_room":0,"dry_run":`+dry+`}`)
		if a.status != 409 || a.typed.Result != pluginapi.ResultHealthCheck || a.body["bootstrap_room"] != json.Number("0") {
			t.Fatalf("health check: %+v", a)
		}
		fields(t, a, "result", "rid", "bootstrap_room", "error")
	}
	c.Advance(100 * time.Millisecond)
	s.Step()
	if _, ok := room(getListing(t, srv.URL), rid); ok {
		t.Fatal("not released")
	}
	if a := post(t, srv.URL, auth, `{"rid":"`+rid+`"}`); a.status != 404 {
		t.Fatalf("after release: %+v", a)
	}

	// Methods.
	resp, err = http.Get(srv.URL + pluginapi.PathForceFail)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("GET force_fail: %d", resp.StatusCode)
	}
}

func u64(v uint64) string { return strings.TrimSpace(string(must(json.Marshal(v)))) }

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestForceFailWithStartAndPause covers the goroutine path: a flip picked up
// by the scheduler goroutine, and a 503 whose withdrawn order is never
// applied after the loop resumes.
func TestForceFailWithStartAndPause(t *testing.T) {
	s, c := newSim(t, Options{OrderTimeout: 300 * time.Millisecond, Backend: BackendMooncake})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pinA, _ := s.Inject(0, PinResurrection)
	pinB, roomB := s.Inject(0, PinStuckHandle)
	s.Start(ctx)
	waitFor(t, "pins inflight", func() bool { return len(s.Listing(0).Inflight) == 2 })
	c.Advance(10 * time.Second)
	waitFor(t, "pins frozen", func() bool {
		l := s.Listing(0)
		a, okA := room(l, pinA)
		b, okB := room(l, pinB)
		// The listing's progress stands still; the resurrected room has no
		// chunk in flight, the stuck handle one for ever (WaitingForInput:
		// Mooncake's manager never writes Transferring).
		return okA && okB && a.Poll == pluginapi.PollTransferring && !*a.TransferInFlight &&
			b.Poll == pluginapi.PollWaitingForInput && *b.TransferInFlight
	})
	srv := httptest.NewServer(s.PluginHandler(0))
	defer srv.Close()

	a := post(t, srv.URL, "", `{"rid":"`+pinA+`"}`)
	if a.status != 200 || a.typed.Result != pluginapi.ResultFlipped || a.typed.Lever != pluginapi.LeverConcludeState {
		t.Fatalf("flip with Start: %+v", a)
	}
	// Applied at the start of a pass, which then released it.
	waitFor(t, "release", func() bool {
		_, ok := room(s.Listing(0), pinA)
		return !ok
	})
	if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", nil); v != 1 {
		t.Fatalf("failed counter %v", v)
	}

	s.PauseLoop(0, true)
	before := s.Listing(0).Loop.Iterations
	start := time.Now()
	a = post(t, srv.URL, "", `{"rid":"`+pinB+`","bootstrap_room":`+u64(roomB)+`}`)
	if a.status != 503 || a.typed.Result != pluginapi.ResultSchedulerUnresponsive || a.typed.RID != pinB {
		t.Fatalf("paused: %+v", a)
	}
	fields(t, a, "result", "rid", "error")
	if d := time.Since(start); d < 300*time.Millisecond || d > 3*time.Second {
		t.Fatalf("503 after %v", d)
	}
	// Dry runs take the same path.
	if a := post(t, srv.URL, "", `{"rid":"`+pinB+`","dry_run":true}`); a.status != 503 {
		t.Fatalf("paused dry run: %+v", a)
	}
	if got := s.Listing(0).Loop.Iterations; got != before {
		t.Fatalf("iterations moved while paused: %d -> %d", before, got)
	}
	s.PauseLoop(0, false)
	c.Advance(time.Second)
	waitFor(t, "loop resumed", func() bool { return s.Listing(0).Loop.Iterations > before+20 })
	rq, ok := room(s.Listing(0), pinB)
	if !ok || rq.SendFailed || rq.Poll != pluginapi.PollWaitingForInput {
		t.Fatalf("withdrawn order was applied: %+v %v", rq, ok)
	}
	if r := recordOf(t, s, pinB); !r.ForcedAt.IsZero() || r.Outcome != OutcomeInflight {
		t.Fatalf("record %+v", r)
	}
	if v := mustMetric(t, s, "sglang:num_transfer_failed_reqs_total", nil); v != 1 {
		t.Fatalf("failed counter %v", v)
	}
}

// TestForceFailStepPausedTimesOut: without Start, a paused rank also answers 503.
func TestForceFailStepPausedTimesOut(t *testing.T) {
	s, c := newSim(t, Options{OrderTimeout: 100 * time.Millisecond})
	rid, _ := s.Inject(0, PinAbortBeforeRegister)
	run(s, c, time.Second, 100*time.Millisecond)
	s.PauseLoop(0, true)
	st, resp := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid}, "")
	if st != 503 || resp.Result != pluginapi.ResultSchedulerUnresponsive {
		t.Fatalf("%d %+v", st, resp)
	}
	s.PauseLoop(0, false)
	run(s, c, time.Second, 100*time.Millisecond)
	if rq, ok := room(s.Listing(0), rid); !ok || rq.SendFailed {
		t.Fatalf("withdrawn order applied: %+v", rq)
	}
	// A Step while an order waits on a paused-then-resumed rank picks it up.
	s.PauseLoop(0, true)
	done := make(chan int, 1)
	go func() {
		st, _ := s.ForceFail(context.Background(), 0, pluginapi.ForceFailRequest{RID: rid}, "")
		done <- st
	}()
	waitFor(t, "order queued", func() bool {
		r := s.ranks[0]
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.pending) == 1
	})
	s.PauseLoop(0, false)
	s.Step()
	if st := <-done; st != 200 {
		t.Fatalf("order picked up by Step: %d", st)
	}
	if _, ok := room(s.Listing(0), rid); ok {
		t.Fatal("not released by the pass that applied the order")
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestRoomsSurviveJSON(t *testing.T) {
	s, c := newSim(t, Options{ArrivalRate: 50, TransferMedian: time.Hour, Seed: 9})
	big := []uint64{math.MaxUint64, 18446744073709551557, 1<<63 + 1, 1<<53 + 1}
	var rids []string
	for _, rm := range big {
		rid, _ := s.Submit(RequestSpec{Room: rm, Behavior: BehaviorPinAbortBeforeRegister})
		rids = append(rids, rid)
	}
	run(s, c, 5*time.Second, 100*time.Millisecond)
	srv := httptest.NewServer(s.PluginHandler(0))
	defer srv.Close()
	l := getListing(t, srv.URL)
	for i, rid := range rids {
		rq, ok := room(l, rid)
		if !ok || rq.BootstrapRoom != big[i] {
			t.Fatalf("room %d came back as %d", big[i], rq.BootstrapRoom)
		}
		a := post(t, srv.URL, "", `{"rid":"`+rid+`","bootstrap_room":`+u64(big[i])+`,"dry_run":true}`)
		if a.status != 200 || *a.typed.BootstrapRoom != big[i] || a.body["bootstrap_room"] != json.Number(u64(big[i])) {
			t.Fatalf("force-fail room %d: %+v", big[i], a)
		}
	}
	high := 0
	for _, rq := range l.Inflight {
		if rq.BootstrapRoom == 0 {
			t.Fatal("room 0 on a normal request")
		}
		if rq.BootstrapRoom > 1<<63 {
			high++
		}
	}
	if len(l.Inflight) < 200 || high < 50 {
		t.Fatalf("%d rooms, %d above 2^63", len(l.Inflight), high)
	}
}

func TestListenServesLoopback(t *testing.T) {
	s, _ := newSim(t, Options{DPSize: 2, PPSize: 2})
	ctx, cancel := context.WithCancel(context.Background())
	metricsURL, plugins, err := s.Listen(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(metricsURL, "http://127.0.0.1:") || !strings.HasSuffix(metricsURL, "/metrics") || len(plugins) != 4 {
		t.Fatalf("%s %v", metricsURL, plugins)
	}
	resp, err := http.Get(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.Header.Get("Content-Type") != ContentType || !bytes.Contains(b, []byte("sglang:num_prefill_inflight_queue_reqs{")) {
		t.Fatalf("metrics: %s", resp.Header.Get("Content-Type"))
	}
	for i, u := range plugins {
		l := getListing(t, u)
		if l.Server.DPRank != i/2 || l.Server.PPRank != i%2 {
			t.Fatalf("plugin %d serves %+v", i, l.Server)
		}
	}
	cancel()
	waitFor(t, "shutdown", func() bool {
		_, err := http.Get(plugins[0] + pluginapi.PathHealthz)
		return err != nil
	})
}

// TestConcurrentUse runs the goroutine mode with readers and orders in
// parallel; meant for -race.
func TestConcurrentUse(t *testing.T) {
	s, c := newSim(t, Options{DPSize: 2, Era: EraNewest, ArrivalRate: 500, SlowFraction: 0.1,
		HealthCheckEvery: time.Second, OrderTimeout: 200 * time.Millisecond, HookRunsWhenEmpty: true})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s.Start(ctx)
	s.Start(ctx) // no-op
	srv := httptest.NewServer(s.PluginHandler(1))
	defer srv.Close()
	msrv := httptest.NewServer(s.MetricsHandler())
	defer msrv.Close()
	var wg sync.WaitGroup
	var errs atomic.Int64
	stop := time.Now().Add(400 * time.Millisecond)
	wg.Add(4)
	go func() {
		defer wg.Done()
		for time.Now().Before(stop) {
			c.Advance(10 * time.Millisecond)
			time.Sleep(time.Millisecond)
		}
	}()
	go func() {
		defer wg.Done()
		for time.Now().Before(stop) {
			resp, err := http.Get(msrv.URL)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}
	}()
	go func() {
		defer wg.Done()
		// No t.Fatal off the test goroutine: errors are counted instead.
		for time.Now().Before(stop) {
			resp, err := http.Get(srv.URL + pluginapi.PathInflight)
			if err != nil {
				errs.Add(1)
				continue
			}
			var l pluginapi.Listing
			if json.NewDecoder(resp.Body).Decode(&l) != nil {
				errs.Add(1)
			}
			resp.Body.Close()
			if len(l.Inflight) > 0 {
				rq := l.Inflight[len(l.Inflight)/2]
				body := `{"rid":"` + rq.RID + `","bootstrap_room":` + u64(rq.BootstrapRoom) + `}`
				resp, err := http.Post(srv.URL+pluginapi.PathForceFail, "application/json", strings.NewReader(body))
				if err != nil {
					errs.Add(1)
					continue
				}
				switch resp.StatusCode {
				case 200, 404, 503, 409: // 409: a health check, or a transfer that just succeeded
				default:
					errs.Add(1)
				}
				resp.Body.Close()
			}
		}
	}()
	go func() {
		defer wg.Done()
		for time.Now().Before(stop) {
			s.Inject(0, PinStuckHandle)
			_ = s.Records()
			s.PauseLoop(0, true)
			time.Sleep(time.Millisecond)
			s.PauseLoop(0, false)
			time.Sleep(20 * time.Millisecond)
		}
	}()
	wg.Wait()
	if n := errs.Load(); n > 0 {
		t.Fatalf("%d failed plugin calls", n)
	}
	s.Restart()
	if len(s.Records()) == 0 {
		t.Fatal("no traffic")
	}
}
