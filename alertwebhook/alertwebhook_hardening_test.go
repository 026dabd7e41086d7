package alertwebhook

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// hardTrigger records what the receiver asks of the watchdog.
type hardTrigger struct {
	mu       sync.Mutex
	triggers []rank
	counts   map[string]int
}

func (h *hardTrigger) TriggerRank(_ context.Context, dp, pp int) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.triggers = append(h.triggers, rank{dp, pp})
	return 0, nil
}

func (h *hardTrigger) CountWebhook(result string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.counts == nil {
		h.counts = map[string]int{}
	}
	h.counts[result]++
}

func hardFiring(labels string) string {
	return `{"status":"firing","labels":{"alertname":"` + AlertName + `","pod":"prefill-0"` + labels + `}}`
}

func hardMessage(alerts ...string) string {
	return `{"version":"4","status":"firing","alerts":[` + strings.Join(alerts, ",") + `]}`
}

// post delivers body to a receiver that has no worker running, so that
// nothing queued is ever acted on, and returns the answer and what was
// queued.
func hardPost(t *testing.T, method, body string) (*httptest.ResponseRecorder, *hardTrigger, *Receiver) {
	t.Helper()
	trig := &hardTrigger{}
	r := testReceiver(t, trig)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(method, Path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+testToken)
	r.ServeHTTP(rec, req)
	return rec, trig, r
}

// TestMalformedPayloadsGetAClear400: every unusable payload is answered
// 400 with a JSON body whose error names what is wrong (and for a bad
// alert, which one), is counted as bad_request, and queues nothing.
func TestMalformedPayloadsGetAClear400(t *testing.T) {
	for _, tc := range []struct{ name, body, want string }{
		{"not JSON", "hello", "not an Alertmanager webhook message"},
		{"empty body", "", "not an Alertmanager webhook message"},
		{"JSON array", "[]", "not an Alertmanager webhook message"},
		{"alerts not an array", `{"alerts":{}}`, "not an Alertmanager webhook message"},
		{"labels not an object", `{"alerts":[{"status":"firing","labels":["x"]}]}`, "not an Alertmanager webhook message"},
		{"no alerts", `{"version":"4","status":"firing"}`, "message has no alerts array"},
		{"null alerts", `{"alerts":null}`, "message has no alerts array"},
		{"missing dp_rank", hardMessage(hardFiring(`,"pp_rank":"0"`)), "alerts[0] (" + AlertName + "): label dp_rank is missing"},
		{"missing pp_rank", hardMessage(hardFiring(`,"dp_rank":"0"`)), "alerts[0] (" + AlertName + "): label pp_rank is missing"},
		{"dp_rank not a number", hardMessage(hardFiring(`,"dp_rank":"zero","pp_rank":"0"`)), `label dp_rank="zero" is not a rank number`},
		{"negative rank", hardMessage(hardFiring(`,"dp_rank":"-1","pp_rank":"0"`)), `label dp_rank="-1" is not a rank number`},
		{"rank overflows", hardMessage(hardFiring(`,"dp_rank":"99999999999999999999","pp_rank":"0"`)), `label dp_rank="99999999999999999999" is not a rank number`},
		{"second alert bad", hardMessage(hardFiring(`,"dp_rank":"0","pp_rank":"0"`), hardFiring(`,"dp_rank":"1.5","pp_rank":"0"`)), `alerts[1] (` + AlertName + `): label dp_rank="1.5"`},
		{"truncated", hardMessage(hardFiring(`,"dp_rank":"0","pp_rank":"0"`))[:40], "not an Alertmanager webhook message"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec, trig, r := hardPost(t, http.MethodPost, tc.body)
			if rec.Code != http.StatusBadRequest {
				t.Fatalf("status %d, want 400: %s", rec.Code, rec.Body.String())
			}
			var a answer
			if err := json.Unmarshal(rec.Body.Bytes(), &a); err != nil {
				t.Fatalf("the 400 body is not JSON: %q", rec.Body.String())
			}
			if a.Result != watchdog.WebhookBadRequest || !strings.Contains(a.Error, tc.want) {
				t.Errorf("answer %+v, want result bad_request and an error naming %q", a, tc.want)
			}
			if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q", ct)
			}
			if len(r.queue) != 0 || trig.counts[watchdog.WebhookBadRequest] != 1 {
				t.Errorf("queued %d, counted %v", len(r.queue), trig.counts)
			}
		})
	}
}

// TestOversizedBodyRefused: a body over 1 MiB is refused without being
// read further; a valid message of exactly 1 MiB is accepted.
func TestOversizedBodyRefused(t *testing.T) {
	valid := hardMessage(hardFiring(`,"dp_rank":"0","pp_rank":"0"`))
	padded := valid + strings.Repeat(" ", maxBody-len(valid))
	rec, _, r := hardPost(t, http.MethodPost, padded)
	if rec.Code != http.StatusAccepted || len(r.queue) != 1 {
		t.Errorf("a valid 1 MiB message: %d %s", rec.Code, rec.Body.String())
	}
	for _, body := range []string{padded + " ", valid + strings.Repeat(" ", 8*maxBody)} {
		rec, trig, r := hardPost(t, http.MethodPost, body)
		if rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), fmt.Sprintf("body exceeds %d bytes", maxBody)) {
			t.Errorf("%d-byte body: %d %s", len(body), rec.Code, rec.Body.String())
		}
		if len(r.queue) != 0 || trig.counts[watchdog.WebhookBadRequest] != 1 {
			t.Errorf("%d-byte body: queued %d, counted %v", len(body), len(r.queue), trig.counts)
		}
	}
}

// TestOnlyPostIsAccepted: any other method is 405 with Allow: POST, and
// queues nothing even when it carries a valid firing alert.
func TestOnlyPostIsAccepted(t *testing.T) {
	body := hardMessage(hardFiring(`,"dp_rank":"0","pp_rank":"0"`))
	for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions} {
		rec, _, r := hardPost(t, m, body)
		if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != http.MethodPost || len(r.queue) != 0 {
			t.Errorf("%s: %d Allow=%q queued=%d", m, rec.Code, rec.Header().Get("Allow"), len(r.queue))
		}
	}
}

// TestOnlyFiringStuckAlertsAct: resolved alerts, other alerts and an empty
// list are acknowledged and ignored; duplicates of one rank queue once.
func TestOnlyFiringStuckAlertsAct(t *testing.T) {
	for _, body := range []string{
		hardMessage(),
		hardMessage(`{"status":"resolved","labels":{"alertname":"` + AlertName + `","dp_rank":"0","pp_rank":"0"}}`),
		hardMessage(`{"status":"firing","labels":{"alertname":"SGLangWatchdogQueuePinned","dp_rank":"0","pp_rank":"0"}}`),
		hardMessage(`{"status":"firing","labels":{"alertname":"` + strings.ToLower(AlertName) + `","dp_rank":"0","pp_rank":"0"}}`),
	} {
		rec, trig, r := hardPost(t, http.MethodPost, body)
		if rec.Code != http.StatusOK || len(r.queue) != 0 || trig.counts[watchdog.WebhookIgnored] != 1 {
			t.Errorf("%s: %d queued=%d counts=%v", body, rec.Code, len(r.queue), trig.counts)
		}
	}
	dup := hardFiring(`,"dp_rank":"3","pp_rank":"1"`)
	rec, _, r := hardPost(t, http.MethodPost, hardMessage(dup, dup, dup))
	if rec.Code != http.StatusAccepted || len(r.queue) != 1 {
		t.Errorf("three alerts for one rank: %d queued=%d", rec.Code, len(r.queue))
	}
}

// TestTriggerQueueIsBounded: a message naming more ranks than the queue
// holds is answered 503 busy (Alertmanager retries) and the queue stays at
// its bound; the receiver's memory does not follow the payload.
func TestTriggerQueueIsBounded(t *testing.T) {
	var alerts []string
	for i := 0; i < 500; i++ {
		alerts = append(alerts, hardFiring(fmt.Sprintf(`,"dp_rank":"%d","pp_rank":"0"`, i)))
	}
	rec, trig, r := hardPost(t, http.MethodPost, hardMessage(alerts...))
	if rec.Code != http.StatusServiceUnavailable || trig.counts[watchdog.WebhookBusy] != 1 {
		t.Errorf("500 ranks: %d %s counts=%v", rec.Code, rec.Body.String(), trig.counts)
	}
	if len(r.queue) != cap(r.queue) {
		t.Errorf("queue holds %d of %d", len(r.queue), cap(r.queue))
	}
}
