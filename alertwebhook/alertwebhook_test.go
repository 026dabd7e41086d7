package alertwebhook

import (
	"context"
	"encoding/json"
	"github.com/go-kit/log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

type fakeTrigger struct {
	mu     sync.Mutex
	ranks  [][2]int
	counts map[string]int
	done   chan struct{}
}

func newFakeTrigger() *fakeTrigger {
	return &fakeTrigger{counts: map[string]int{}, done: make(chan struct{}, 16)}
}

func (f *fakeTrigger) TriggerRank(_ context.Context, dp, pp int) (int, error) {
	f.mu.Lock()
	f.ranks = append(f.ranks, [2]int{dp, pp})
	f.mu.Unlock()
	f.done <- struct{}{}
	return 1, nil
}

func (f *fakeTrigger) CountWebhook(result string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.counts[result]++
}

const firing = `{"version":"4","status":"firing","alerts":[
 {"status":"firing","labels":{"alertname":"SGLangWatchdogRequestStuck","dp_rank":"1","pp_rank":"0","severity":"critical","pod":"prefill-0"}},
 {"status":"firing","labels":{"alertname":"SGLangWatchdogRequestStuck","dp_rank":"1","pp_rank":"0","instance":"b","pod":"prefill-0"}},
 {"status":"resolved","labels":{"alertname":"SGLangWatchdogRequestStuck","dp_rank":"2","pp_rank":"0"}},
 {"status":"firing","labels":{"alertname":"SGLangWatchdogSchedulerWedged","dp_rank":"3","pp_rank":"0"}}]}`

func post(t *testing.T, h http.Handler, body string) (*httptest.ResponseRecorder, answer) {
	t.Helper()
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, Path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+testToken)
	h.ServeHTTP(rec, req)
	var a answer
	if err := json.Unmarshal(rec.Body.Bytes(), &a); err != nil {
		t.Fatalf("answer is not JSON: %q", rec.Body.String())
	}
	return rec, a
}

func TestFiringStuckAlertTriggersItsRankOnce(t *testing.T) {
	trig := newFakeTrigger()
	r := testReceiver(t, trig)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go r.Run(ctx)

	rec, a := post(t, r, firing)
	if rec.Code != http.StatusAccepted || a.Result != watchdog.WebhookAccepted || len(a.Ranks) != 1 || a.Ranks[0] != "dp1/pp0" {
		t.Fatalf("answer %d %+v, want 202 accepted for dp1/pp0 only", rec.Code, a)
	}
	select {
	case <-trig.done:
	case <-time.After(5 * time.Second):
		t.Fatal("trigger never ran")
	}
	trig.mu.Lock()
	defer trig.mu.Unlock()
	if len(trig.ranks) != 1 || trig.ranks[0] != [2]int{1, 0} {
		t.Fatalf("triggered %v, want [[1 0]]: resolved and other alerts must not act", trig.ranks)
	}
	if trig.counts[watchdog.WebhookAccepted] != 1 {
		t.Fatalf("counts %v", trig.counts)
	}
}

func TestUnusablePayloadsAreRefusedClearly(t *testing.T) {
	trig := newFakeTrigger()
	r := testReceiver(t, trig)
	for _, tc := range []struct {
		body, want string
	}{
		{`not json`, "not an Alertmanager webhook message"},
		{`{"status":"firing"}`, "no alerts array"},
		{`{"alerts":[{"status":"firing","labels":{"alertname":"SGLangWatchdogRequestStuck","pp_rank":"0","pod":"prefill-0"}}]}`, "alerts[0] (SGLangWatchdogRequestStuck): label dp_rank is missing"},
		{`{"alerts":[{"status":"firing","labels":{"alertname":"SGLangWatchdogRequestStuck","dp_rank":"x","pp_rank":"0","pod":"prefill-0"}}]}`, `label dp_rank="x" is not a rank number`},
		{`{"alerts":[` + strings.Repeat(" ", maxBody) + `]}`, "body exceeds"},
	} {
		rec, a := post(t, r, tc.body)
		if rec.Code != http.StatusBadRequest || a.Result != watchdog.WebhookBadRequest || !strings.Contains(a.Error, tc.want) {
			t.Errorf("%.60s: %d %+v, want 400 naming %q", tc.body, rec.Code, a, tc.want)
		}
	}
	if len(trig.ranks) != 0 {
		t.Fatalf("a bad payload triggered %v", trig.ranks)
	}
}

func TestNothingToDoIsIgnoredAndGetIsRefused(t *testing.T) {
	trig := newFakeTrigger()
	r := testReceiver(t, trig)
	rec, a := post(t, r, `{"alerts":[{"status":"firing","labels":{"alertname":"Other"}}]}`)
	if rec.Code != http.StatusOK || a.Result != watchdog.WebhookIgnored {
		t.Fatalf("%d %+v, want 200 ignored", rec.Code, a)
	}
	rec = httptest.NewRecorder()
	r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, Path, nil))
	if rec.Code != http.StatusMethodNotAllowed {
		t.Fatalf("GET answered %d", rec.Code)
	}
}

const testToken = "am-webhook-Tok_42"

// testReceiver is a receiver for the pod prefill-0 with a token file.
func testReceiver(t *testing.T, trig Trigger) *Receiver {
	t.Helper()
	r, err := New(trig, log.NewNopLogger(), Options{TokenFile: writeToken(t, testToken), Match: map[string]string{"pod": "prefill-0"}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func writeToken(t *testing.T, tok string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "webhook-token")
	if err := os.WriteFile(p, []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
