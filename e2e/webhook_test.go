package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// TestAlertWebhookReleasesThroughTheRails posts Alertmanager notifications
// to the binary: without the webhook's token, and with an alert about
// another pod, nothing happens and the refusals are counted; the firing
// stuck-request alert about this pod, with the token, force-fails the
// stuck request of its rank while the watchdog stays in dry-run mode,
// counted under trigger "alert".
func TestAlertWebhookReleasesThroughTheRails(t *testing.T) {
	sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{Clock: clock.Real{}, DPSize: 2, Seed: 5})
	_, room := sim.Inject(1, sglangsim.PinResurrection)
	const token = "am-hook-Tok_7c1e"
	wd := startWatchdog(t, append([]string{"--sglang.metrics-url=" + metricsURL, "--sglang.metrics-interval=1s",
		"--watchdog.interval=200ms", "--watchdog.deadline=2s", "--watchdog.stall-window=1s", "--force-fail.mode=dry-run",
		"--alertmanager.webhook", "--alertmanager.webhook.token-file=" + tokenFile(t, token),
		"--alertmanager.webhook.match-label=pod=sglang-prefill-0", "--alertmanager.webhook.match-label=namespace=llm"},
		pluginArgs(pluginURLs)...)...)

	waitFor(t, "a dry-run call for the pin", 30*time.Second, func() bool {
		return wd.has(t, `sglang_watchdog_force_fails_total{result="would_flip",role="prefill",trigger="auto"} 1`)
	})
	alert := func(pod string) string {
		return fmt.Sprintf(`{"version":"4","status":"firing","alerts":[{"status":"firing","labels":{"alertname":"%s","dp_rank":"1","pp_rank":"0","pod":"%s","namespace":"llm"}}]}`,
			alertwebhook.AlertName, pod)
	}
	post := func(auth, body string) int {
		req, _ := http.NewRequest(http.MethodPost, wd.base+alertwebhook.Path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := post("", alert("sglang-prefill-0")); code != http.StatusUnauthorized {
		t.Errorf("no token: %d, want 401", code)
	}
	if code := post("Bearer wrong", alert("sglang-prefill-0")); code != http.StatusUnauthorized {
		t.Errorf("wrong token: %d, want 401", code)
	}
	if code := post("Bearer "+token, alert("sglang-prefill-1")); code != http.StatusForbidden {
		t.Errorf("an alert about another pod: %d, want 403", code)
	}
	time.Sleep(time.Second)
	for _, r := range sim.Records() {
		if !r.ForcedAt.IsZero() {
			t.Fatalf("a refused delivery force-failed %s", r.RID)
		}
	}
	for _, line := range []string{`sglang_watchdog_alert_webhook_refusals_total{reason="unauthorized"} 2`,
		`sglang_watchdog_alert_webhook_refusals_total{reason="foreign_target"} 1`} {
		if !wd.has(t, line) {
			t.Errorf("/metrics lacks %s", line)
		}
	}

	if code := post("Bearer "+token, alert("sglang-prefill-0")); code != http.StatusAccepted {
		t.Fatalf("the alert about this pod: %d, want 202", code)
	}
	waitFor(t, "the alert-triggered release", 15*time.Second, func() bool {
		for _, r := range sim.Records() {
			if r.Room == room {
				return r.Outcome == sglangsim.OutcomeFailedForced
			}
		}
		return false
	})
	waitFor(t, "the release confirmed under trigger alert", 20*time.Second, func() bool {
		return wd.has(t, `sglang_watchdog_force_fails_total{result="released",role="prefill",trigger="alert"} 1`)
	})
	if !wd.has(t, `sglang_watchdog_force_fail_mode{mode="dry-run"} 1`) {
		t.Error("the mode changed")
	}
	for _, r := range sim.Records() {
		if r.ProgressingWhenForced {
			t.Errorf("force-failed a progressing request: %+v", r)
		}
	}
}
