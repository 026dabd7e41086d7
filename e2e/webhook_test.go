package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// TestAlertWebhookReleasesThroughTheRails posts an Alertmanager
// notification to the watchdog's own HTTP server: a firing stuck-request
// alert force-fails the stuck request of its rank while the watchdog itself
// stays in dry-run mode, counted under trigger "alert".
func TestAlertWebhookReleasesThroughTheRails(t *testing.T) {
	clk := clock.NewFake(time.Now())
	sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{Clock: clk, DPSize: 2})
	_, room := sim.Inject(1, sglangsim.PinResurrection)

	port := freePort(t)
	wd, o := watchdogAndOptions(t, clk, append([]string{"--alertmanager.webhook", "--sglang.metrics-url=" + metricsURL,
		fmt.Sprintf("--web.listen-address=127.0.0.1:%d", port)}, pluginArgs(pluginURLs)...)...)
	receiver := alertwebhook.New(wd, log.NewNopLogger())
	srv, err := newServer(o, wd, receiver, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go receiver.Run(ctx)
	go srv.serve(ctx, o.web, log.NewNopLogger())

	for s := 1; s <= 70; s++ {
		step(clk, wd, s)
	}
	if got := wd.Snapshot().ForceFails[[2]string{watchdog.ResultWouldFlip, watchdog.TriggerAuto}]; got != 1 {
		t.Fatalf("dry-run mode made %d would_flip calls, want 1", got)
	}

	body := `{"version":"4","status":"firing","alerts":[{"status":"firing","labels":{"alertname":"SGLangWatchdogRequestStuck","dp_rank":"1","pp_rank":"0"}}]}`
	resp, err := http.Post(fmt.Sprintf("http://127.0.0.1:%d%s", port, alertwebhook.Path), "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("webhook answered %d, want 202", resp.StatusCode)
	}
	waitFor(t, "the alert-triggered release", 10*time.Second, func() bool {
		for _, r := range sim.Records() {
			if r.Room == room {
				return r.Outcome == sglangsim.OutcomeFailedForced
			}
		}
		return false
	})
	for s := 71; s <= 90; s++ {
		step(clk, wd, s)
	}
	snap := wd.Snapshot()
	if got := snap.ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAlert}]; got != 1 {
		t.Fatalf("released under trigger alert = %d, want 1", got)
	}
	if snap.Mode != watchdog.ModeDryRun {
		t.Fatalf("mode changed to %s", snap.Mode)
	}
}

// TestWebhookDisabledMutatesNothing checks that without the flag the
// endpoint refuses and counts the delivery.
func TestWebhookDisabledMutatesNothing(t *testing.T) {
	clk := clock.NewFake(time.Now())
	sim, _, pluginURLs := simServer(t, sglangsim.Options{Clock: clk})
	sim.Inject(0, sglangsim.PinResurrection)
	wd, o := watchdogAndOptions(t, clk, append([]string{"--sglang.metrics-url=", "--force-fail.mode=off",
		"--web.listen-address=127.0.0.1:0"}, pluginArgs(pluginURLs)...)...)
	srv, err := newServer(o, wd, nil, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	for s := 1; s <= 70; s++ {
		step(clk, wd, s)
	}
	req, _ := http.NewRequest(http.MethodPost, alertwebhook.Path, strings.NewReader(`{"alerts":[{"status":"firing","labels":{"alertname":"SGLangWatchdogRequestStuck","dp_rank":"0","pp_rank":"0"}}]}`))
	rec := httptest.NewRecorder()
	srv.handler.ServeHTTP(rec, req)
	if rec.Code != http.StatusForbidden {
		t.Fatalf("disabled webhook answered %d", rec.Code)
	}
	for _, r := range sim.Records() {
		if !r.ForcedAt.IsZero() {
			t.Fatalf("a disabled webhook force-failed %s", r.RID)
		}
	}
	if got := wd.Snapshot().Webhook[watchdog.WebhookDisabled]; got != 1 {
		t.Fatalf("disabled deliveries counted %d, want 1", got)
	}
}
