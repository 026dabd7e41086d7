package alertwebhook

import (
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/go-kit/log"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

func deliver(r *Receiver, auth, body string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, Path, strings.NewReader(body))
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	r.ServeHTTP(rec, req)
	return rec
}

func refusals(t *testing.T, r *Receiver, unauthorized, foreign int) {
	t.Helper()
	want := `# HELP sglang_watchdog_alert_webhook_refusals_total Alertmanager webhook refusals: deliveries without the webhook's bearer token (unauthorized), and firing stuck-request alerts whose labels name another watchdog (foreign_target, one per alert).
# TYPE sglang_watchdog_alert_webhook_refusals_total counter
sglang_watchdog_alert_webhook_refusals_total{reason="foreign_target"} ` + itoa(foreign) + `
sglang_watchdog_alert_webhook_refusals_total{reason="unauthorized"} ` + itoa(unauthorized) + `
`
	if err := testutil.CollectAndCompare(r, strings.NewReader(want)); err != nil {
		t.Error(err)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// TestWebhookNeedsItsOwnToken: a delivery without the webhook's bearer
// token (none, wrong, basic auth as a scraper would send, a prefix of the
// token) is refused 401, queues nothing and is counted as unauthorized; a
// rotated token file takes effect on the next delivery.
func TestWebhookNeedsItsOwnToken(t *testing.T) {
	trig := &hardTrigger{}
	r := testReceiver(t, trig)
	body := hardMessage(hardFiring(`,"dp_rank":"0","pp_rank":"0"`))
	bad := []string{"", "Bearer wrong", "Basic dXNlcjpwYXNz", "Bearer " + testToken[:5], "Bearer " + testToken + "x", "bearer" + testToken, testToken}
	for _, auth := range bad {
		rec := deliver(r, auth, body)
		if rec.Code != http.StatusUnauthorized || !strings.Contains(rec.Body.String(), `"result":"unauthorized"`) {
			t.Errorf("Authorization %q: %d %s", auth, rec.Code, rec.Body.String())
		}
	}
	if len(r.queue) != 0 || len(trig.counts) != 0 {
		t.Errorf("unauthorized deliveries queued %d, counted %v", len(r.queue), trig.counts)
	}
	refusals(t, r, len(bad), 0)

	if rec := deliver(r, "Bearer "+testToken, body); rec.Code != http.StatusAccepted {
		t.Fatalf("the right token: %d %s", rec.Code, rec.Body.String())
	}
	if err := os.WriteFile(r.opts.TokenFile, []byte("rotated-Tok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if rec := deliver(r, "Bearer "+testToken, body); rec.Code != http.StatusUnauthorized {
		t.Errorf("the old token after rotation: %d", rec.Code)
	}
	if rec := deliver(r, "Bearer rotated-Tok", body); rec.Code != http.StatusAccepted {
		t.Errorf("the new token after rotation: %d %s", rec.Code, rec.Body.String())
	}
	// A bad rotation of our own file fails closed with a retryable 503.
	if err := os.WriteFile(r.opts.TokenFile, []byte("rotated\nTok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if rec := deliver(r, "Bearer rotated\nTok", body); rec.Code != http.StatusServiceUnavailable {
		t.Errorf("an unusable token file: %d %s", rec.Code, rec.Body.String())
	}
}

// TestWebhookActsOnlyOnAlertsAboutItsOwnPod: an alert about another pod
// (or with no pod label) delivered here is refused and counted per alert;
// in a mixed delivery only this pod's rank is queued.
func TestWebhookActsOnlyOnAlertsAboutItsOwnPod(t *testing.T) {
	trig := &hardTrigger{}
	r := testReceiver(t, trig)
	other := `{"status":"firing","labels":{"alertname":"` + AlertName + `","pod":"prefill-1","dp_rank":"0","pp_rank":"0"}}`
	nolabel := `{"status":"firing","labels":{"alertname":"` + AlertName + `","dp_rank":"2","pp_rank":"0"}}`
	rec := deliver(r, "Bearer "+testToken, hardMessage(other, nolabel))
	if rec.Code != http.StatusForbidden || len(r.queue) != 0 || !strings.Contains(rec.Body.String(), `pod=\"prefill-0\"`) {
		t.Fatalf("alerts about other pods: %d %s queued=%d", rec.Code, rec.Body.String(), len(r.queue))
	}
	refusals(t, r, 0, 2)
	rec = deliver(r, "Bearer "+testToken, hardMessage(other, hardFiring(`,"dp_rank":"1","pp_rank":"0"`)))
	if rec.Code != http.StatusAccepted || len(r.queue) != 1 || !strings.Contains(rec.Body.String(), `"queued_ranks":["dp1/pp0"]`) {
		t.Fatalf("mixed delivery: %d %s queued=%d", rec.Code, rec.Body.String(), len(r.queue))
	}
	if got := <-r.queue; got != (rank{1, 0}) {
		t.Errorf("queued %v, want dp1/pp0", got)
	}
	refusals(t, r, 0, 3)
	if trig.counts[watchdog.WebhookIgnored] != 1 || trig.counts[watchdog.WebhookAccepted] != 1 {
		t.Errorf("counts %v", trig.counts)
	}
}

func TestNewNeedsATokenAndAnIdentity(t *testing.T) {
	tok := writeToken(t, testToken)
	for _, tc := range []struct {
		name string
		opts Options
		want string
	}{
		{"no token file", Options{Match: map[string]string{"pod": "p"}}, "bearer token file"},
		{"no identity", Options{TokenFile: tok}, "at least one label"},
		{"empty value", Options{TokenFile: tok, Match: map[string]string{"pod": ""}}, "must not be empty"},
		{"bad token", Options{TokenFile: writeToken(t, "a b"), Match: map[string]string{"pod": "p"}}, "whitespace"},
	} {
		if _, err := New(&hardTrigger{}, log.NewNopLogger(), tc.opts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want %q", tc.name, err, tc.want)
		}
	}
}
