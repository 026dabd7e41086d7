package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
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

// adminCall is one POST /admin/force_fail the watchdog sent to a stage.
type adminCall struct {
	stage  int
	order  pluginapi.ForceFailRequest
	status int
	result string
}

// adminRecorder carries the watchdog's admin calls to the real plugin and
// records them. With hold set, the second call (whichever stage it goes
// to) waits until release is closed, so that the test can look at both
// stages between the two flips of one request.
type adminRecorder struct {
	mu      sync.Mutex
	calls   []adminCall
	hold    bool
	held    chan int // the stage of the held call
	release chan struct{}
}

func newAdminRecorder(hold bool) *adminRecorder {
	return &adminRecorder{hold: hold, held: make(chan int, 1), release: make(chan struct{})}
}

func (a *adminRecorder) transport(stage int) http.RoundTripper {
	direct := &http.Transport{} // no proxy from the environment: loopback only
	return roundTripper(func(req *http.Request) (*http.Response, error) {
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return nil, err
		}
		req.Body = io.NopCloser(bytes.NewReader(body))
		var order pluginapi.ForceFailRequest
		_ = json.Unmarshal(body, &order)
		a.mu.Lock()
		n := len(a.calls)
		a.calls = append(a.calls, adminCall{stage: stage, order: order})
		a.mu.Unlock()
		if a.hold && n == 1 {
			a.held <- stage
			select {
			case <-a.release:
			case <-req.Context().Done():
				return nil, req.Context().Err()
			}
		}
		resp, err := direct.RoundTrip(req)
		if err != nil {
			return nil, err
		}
		answer, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return nil, err
		}
		resp.Body = io.NopCloser(bytes.NewReader(answer))
		var r pluginapi.ForceFailResponse
		_ = json.Unmarshal(answer, &r)
		a.mu.Lock()
		a.calls[n].status, a.calls[n].result = resp.StatusCode, r.Result
		a.mu.Unlock()
		return resp, nil
	})
}

func (a *adminRecorder) recorded() []adminCall {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]adminCall(nil), a.calls...)
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// realClockWatchdog runs the watchdog's packages on the real clock with
// short windows against stand-in plugin URLs (one per PP stage), in auto
// mode, until the test ends.
func realClockWatchdog(t *testing.T, metricsURL, token string, pluginURLs []string, admin *adminRecorder) *watchdog.Watchdog {
	t.Helper()
	cfg := watchdog.Config{
		Clock: clock.Real{}, Logger: nopLogger{}, Interval: 300 * time.Millisecond, MetricsInterval: 300 * time.Millisecond,
		Deadline: 60 * time.Second, StallWindow: time.Second, PinWindow: 2 * time.Minute, MaxRooms: 1000,
		Mode: watchdog.ModeAuto, MaxPerMinute: 6, ConfirmTimeout: 30 * time.Second, MaxAttempts: 3, RetryBackoff: time.Second,
		FailFast: true, FailFastPerMinute: 180,
		// Generous timeouts: the Python scheduler loops share two cores
		// with the rest of the test suite.
		Metrics: collector.NewMetricsScraper(metricsURL, 2*time.Second),
	}
	return runWatchdog(t, cfg, token, pluginURLs, admin)
}

// runWatchdog points cfg at the plugin URLs (admin calls through admin)
// and runs the watchdog until the test ends.
func runWatchdog(t *testing.T, cfg watchdog.Config, token string, pluginURLs []string, admin *adminRecorder) *watchdog.Watchdog {
	t.Helper()
	for i, u := range pluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{
			Timeout: 2 * time.Second, AdminTimeout: 10 * time.Second, Token: token, AdminTransport: admin.transport(i)}))
	}
	wd, err := watchdog.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { wd.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		// A held call must not outlive the test.
		select {
		case <-admin.release:
		default:
			close(admin.release)
		}
		<-done
	})
	return wd
}

// nextStage is the URL of the stand-in's second PP stage (the port after
// the first's).
func nextStage(t *testing.T, first string) string {
	t.Helper()
	u, err := url.Parse(first)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://%s:%d", u.Hostname(), port+1)
}

func listingOf(t *testing.T, base string) *pluginapi.Listing {
	t.Helper()
	l, err := pluginapi.NewClient(base, pluginapi.ClientOptions{Timeout: 5 * time.Second}).Inflight(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func listedRoom(l *pluginapi.Listing, rid string) *pluginapi.Room {
	for i := range l.Inflight {
		if l.Inflight[i].RID == rid {
			return &l.Inflight[i]
		}
	}
	return nil
}

// failedCounters reads the stand-in's num_transfer_failed_reqs_total per
// pp_rank label ("" without one).
func failedCounters(t *testing.T, metricsURL string) map[string]string {
	t.Helper()
	resp, err := http.Get(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "sglang:num_transfer_failed_reqs_total{") {
			continue
		}
		labels, value, _ := strings.Cut(line, "} ")
		pp := ""
		if _, after, ok := strings.Cut(labels, `pp_rank="`); ok {
			pp, _, _ = strings.Cut(after, `"`)
		}
		out[pp] = value
	}
	return out
}

// otherForceFails lists every non-zero force-fail count but the one wanted.
func otherForceFails(s watchdog.Snapshot, want [2]string) []string {
	var out []string
	for k, v := range s.ForceFails {
		if k != want && v != 0 {
			out = append(out, fmt.Sprintf("%s/%s=%d", k[0], k[1], v))
		}
	}
	return out
}

// TestPythonPluginPP2WithTheWatchdog is issue 10's "Done means": the real
// plugin on two PP stages of one DP rank (standin_server.py --pp-size 2,
// which releases a request only once both stages poll it terminal, as
// SGLang's PP prefill loop does), and the watchdog pointed at both stages.
// The stuck request is failed once on each stage, counted once, and
// released only after both flips; nothing else is touched.
func TestPythonPluginPP2WithTheWatchdog(t *testing.T) {
	tok := tokenFile(t, parityToken)
	stage0, metricsURL := startStandin(t, sglangsim.BackendNIXL, tok, "--pp-size", "2")
	stage1 := nextStage(t, stage0)
	stages := []string{stage0, stage1}
	for i, u := range stages {
		if l := listingOf(t, u); l.Server.PPRank != i || l.Server.PPSize != 2 || l.Server.DPRank != 0 || len(l.Inflight) != 4 {
			t.Fatalf("stage %d: server %+v, %d rooms", i, l.Server, len(l.Inflight))
		}
	}
	admin := newAdminRecorder(true)
	wd := realClockWatchdog(t, metricsURL, parityToken, stages, admin)

	var heldStage int
	select {
	case heldStage = <-admin.held:
	case <-time.After(60 * time.Second):
		t.Fatalf("the watchdog never called the second stage; calls %+v", admin.recorded())
	}
	first := admin.recorded()[0]
	if first.stage == heldStage || first.order.RID != "pinned-0001" || first.order.DryRun ||
		first.status != http.StatusOK || first.result != pluginapi.ResultFlipped {
		t.Fatalf("first call %+v, then stage %d held", first, heldStage)
	}
	// Between the two flips: many passes of both loops, and the request is
	// still listed on both stages (Failed on the flipped one), and nothing
	// was counted as failed.
	var base [2]uint64
	for i, u := range stages {
		base[i] = listingOf(t, u).Loop.Iterations
	}
	waitFor(t, "20 passes of both stage loops", 30*time.Second, func() bool {
		return listingOf(t, stage0).Loop.Iterations >= base[0]+20 && listingOf(t, stage1).Loop.Iterations >= base[1]+20
	})
	for i, u := range stages {
		r := listedRoom(listingOf(t, u), "pinned-0001")
		wantPoll := pluginapi.PollTransferring
		if i == first.stage {
			wantPoll = pluginapi.PollFailed
		}
		if r == nil || r.Poll != wantPoll {
			t.Fatalf("stage %d after the first flip: pinned-0001 %+v, want listed in %s", i, r, wantPoll)
		}
	}
	if c := failedCounters(t, metricsURL); c["0"] != "0.0" || c["1"] != "0.0" {
		t.Fatalf("transfer-failed counters after one flip: %v", c)
	}
	released := [2]string{watchdog.ResultReleased, watchdog.TriggerAuto}
	if s := wd.Snapshot(); s.ForceFails[released] != 0 {
		t.Fatal("released before the second stage was called")
	}

	close(admin.release)
	waitFor(t, "the release confirmed", 60*time.Second, func() bool { return wd.Snapshot().ForceFails[released] == 1 })
	for i, u := range stages {
		var left []string
		for _, r := range listingOf(t, u).Inflight {
			left = append(left, r.RID)
		}
		if want := []string{"healthy-0002", "HEALTH_CHECK_1764403200.0", sglangsim.ParityWarmupRID}; strings.Join(left, " ") != strings.Join(want, " ") {
			t.Errorf("stage %d lists %v after the release, want %v", i, left, want)
		}
	}
	if c := failedCounters(t, metricsURL); c["0"] != "1.0" || c["1"] != "1.0" {
		t.Errorf("transfer-failed counters after the release: %v, want 1.0 on each stage", c)
	}
	// A few more cycles: no other call, and the request counted once.
	time.Sleep(time.Second)
	calls := admin.recorded()
	if len(calls) != 2 || calls[0].stage == calls[1].stage {
		t.Fatalf("admin calls %+v, want one per stage", calls)
	}
	for _, c := range calls {
		if c.order.RID != "pinned-0001" || c.order.BootstrapRoom == nil || *c.order.BootstrapRoom != 9223372036854775001 ||
			c.order.DryRun || c.status != http.StatusOK || c.result != pluginapi.ResultFlipped {
			t.Errorf("admin call %+v", c)
		}
	}
	s := wd.Snapshot()
	if s.ForceFails[released] != 1 || len(otherForceFails(s, released)) != 0 {
		t.Errorf("force-fail counts: released %d, others %v", s.ForceFails[released], otherForceFails(s, released))
	}
}

// TestPythonPluginOlderErasWithTheWatchdog: on the mid-2025 NIXL era the
// real plugin lists no lever, and the watchdog sees the stuck request but
// never calls force-fail on it (skip reason unsupported).
func TestPythonPluginOlderErasWithTheWatchdog(t *testing.T) {
	tok := tokenFile(t, parityToken)
	pluginURL, metricsURL := startStandin(t, sglangsim.BackendNIXL, tok, "--era", "mid2025")
	if l := listingOf(t, pluginURL); l.Server.Levers == nil || len(l.Server.Levers) != 0 || l.Server.LeverNote == "" {
		t.Fatalf("mid-2025 server %+v", l.Server)
	}
	admin := newAdminRecorder(false)
	wd := realClockWatchdog(t, metricsURL, parityToken, []string{pluginURL}, admin)
	waitFor(t, "the stuck request skipped as unsupported", 30*time.Second, func() bool {
		s := wd.Snapshot()
		return s.Skips[watchdog.SkipUnsupported] == 1 && len(s.Ranks) == 1 && s.Ranks[0].Unactionable[watchdog.SkipUnsupported] == 1
	})
	time.Sleep(time.Second) // more cycles: still no call
	if calls := admin.recorded(); len(calls) != 0 {
		t.Fatalf("admin calls on an SGLang without a lever: %+v", calls)
	}
	s := wd.Snapshot()
	if others := otherForceFails(s, [2]string{}); len(others) != 0 || s.Skips[watchdog.SkipUnsupported] != 1 {
		t.Fatalf("force-fails %v, skips %v", others, s.Skips)
	}
	if r := listedRoom(listingOf(t, pluginURL), "pinned-0001"); r == nil || r.Poll != pluginapi.PollTransferring {
		t.Fatalf("pinned-0001 %+v", r)
	}
}

// TestPythonPluginWedgeWithTheWatchdog: on the wedge scene the real
// plugin reports pinned-0001's chunk in flight for ever on transfer queue
// 2, and the watchdog diagnoses that queue wedged; once the request is
// released, the orphaned transfer keeps the diagnosis.
func TestPythonPluginWedgeWithTheWatchdog(t *testing.T) {
	tok := tokenFile(t, parityToken)
	pluginURL, metricsURL := startStandin(t, sglangsim.BackendNIXL, tok, "--scenario", "wedge")
	admin := newAdminRecorder(false)
	wd := realClockWatchdog(t, metricsURL, parityToken, []string{pluginURL}, admin)
	wedged := func() bool {
		s := wd.Snapshot()
		return len(s.Ranks) == 1 && s.Ranks[0].TransferWedged
	}
	waitFor(t, "the transfer wedge diagnosed", 30*time.Second, wedged)
	released := [2]string{watchdog.ResultReleased, watchdog.TriggerAuto}
	waitFor(t, "the wedged request released", 60*time.Second, func() bool { return wd.Snapshot().ForceFails[released] == 1 })
	l := listingOf(t, pluginURL)
	if len(l.OrphanedTransfers) != 1 || l.OrphanedTransfers[0].BootstrapRoom != 9223372036854775001 ||
		l.OrphanedTransfers[0].TransferQueue == nil || *l.OrphanedTransfers[0].TransferQueue != 2 {
		t.Fatalf("orphaned transfers %+v", l.OrphanedTransfers)
	}
	time.Sleep(time.Second)
	s := wd.Snapshot()
	if !wedged() || s.Ranks[0].TransferWedges != 1 {
		t.Fatalf("after the release: wedged %v, wedges %d", s.Ranks[0].TransferWedged, s.Ranks[0].TransferWedges)
	}
	calls := admin.recorded()
	if len(calls) != 1 || calls[0].order.RID != "pinned-0001" || len(otherForceFails(s, released)) != 0 {
		t.Fatalf("admin calls %+v, force-fails %v", calls, otherForceFails(s, released))
	}
}
