package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/internal/runconfig"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// TestTokensComeOnlyFromFiles walks every command's flags: the only flags
// about a token take a file path, so that a token never sits in a process
// listing, a shell history or a manifest's args.
func TestTokensComeOnlyFromFiles(t *testing.T) {
	var o options
	model := newApp(&o).Model()
	flags := model.Flags
	for _, c := range model.Commands {
		flags = append(flags, c.Flags...)
	}
	seen := 0
	for _, f := range flags {
		name := strings.ToLower(f.Name)
		if !strings.Contains(name, "token") && !strings.Contains(name, "secret") && !strings.Contains(name, "password") &&
			!strings.Contains(name, "auth") && !strings.Contains(name, "bearer") {
			continue
		}
		seen++
		if !strings.HasSuffix(name, "-file") {
			t.Errorf("flag --%s takes a secret's value; secrets must come from a file", f.Name)
		}
	}
	if seen == 0 {
		t.Fatal("no token flag found: the walk is broken")
	}
	// The environment form of the flag is a path too: setting it to a
	// token value fails instead of being used as the token.
	t.Setenv("SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE", "s3cret-token-value")
	var o2 options
	if _, err := newApp(&o2).Parse([]string{"run"}); err != nil {
		t.Fatal(err)
	}
	if _, err := watchdogConfig(&o2, log.NewNopLogger()); err == nil || !strings.Contains(err.Error(), "reading token file") {
		t.Errorf("a token value given as the token-file variable was not refused: %v", err)
	}
}

// TestRemoteURLsNeedAllowRemote: every URL the watchdog is given (plugin
// URLs, SGLang's /metrics; run, inflight and force-fail) must be loopback
// unless --plugin.allow-remote, and the usual disguises of a remote host are
// refused. Nothing here opens a connection.
func TestRemoteURLsNeedAllowRemote(t *testing.T) {
	loopbackOK := []string{
		"http://127.0.0.1:28100", "http://127.0.0.2:1", "http://localhost:28100", "http://LOCALHOST:28100",
		"http://[::1]:28100", "https://127.0.0.1:28100", "http://[::ffff:127.0.0.1]:28100",
	}
	remote := []string{
		"http://10.0.0.7:28100", "http://192.0.2.1", "http://example.com:28100",
		"http://localhost.example.com:28100", "http://127.0.0.1.nip.io:28100",
		"http://127.0.0.1@192.0.2.1:28100",  // userinfo: the host is 192.0.2.1
		"http://192.0.2.1#@127.0.0.1:28100", // fragment: the host is 192.0.2.1
		"http://[::ffff:192.0.2.1]:28100",
		"http://0.0.0.0:28100", "http://2130706433:28100", "http://0x7f000001:28100", "http://127.1:28100",
	}
	never := []string{"ftp://127.0.0.1/x", "file:///etc/passwd", "127.0.0.1:28100", "", "unix:///run/sglang.sock"}

	for _, u := range loopbackOK {
		if err := runconfig.CheckURLs(false, u); err != nil {
			t.Errorf("loopback %q refused: %v", u, err)
		}
	}
	for _, u := range remote {
		if err := runconfig.CheckURLs(false, u); err == nil {
			t.Errorf("remote %q accepted without --plugin.allow-remote", u)
		}
		if err := runconfig.CheckURLs(true, u); err != nil {
			t.Errorf("remote %q refused with --plugin.allow-remote: %v", u, err)
		}
	}
	for _, u := range never {
		if err := runconfig.CheckURLs(false, u); err == nil {
			t.Errorf("%q accepted", u)
		}
		if err := runconfig.CheckURLs(true, u); err == nil {
			t.Errorf("%q accepted with --plugin.allow-remote", u)
		}
	}

	// Wired into every command, for plugin and SGLang URLs alike.
	for _, args := range [][]string{
		{"--plugin.url=http://192.0.2.1:28100"},
		{"--sglang.metrics-url=http://192.0.2.1:30000/metrics"},
	} {
		var o options
		if _, err := newApp(&o).Parse(append([]string{"run"}, args...)); err != nil {
			t.Fatal(err)
		}
		if _, err := watchdogConfig(&o, log.NewNopLogger()); err == nil || !strings.Contains(err.Error(), "allow-remote") {
			t.Errorf("run %v: err = %v", args, err)
		}
		o.allowRemote = true
		if _, err := watchdogConfig(&o, log.NewNopLogger()); err != nil {
			t.Errorf("run %v --plugin.allow-remote: %v", args, err)
		}
	}
	for _, args := range [][]string{
		{"inflight", "--plugin.url=http://192.0.2.1:28100"},
		{"force-fail", "--rid=x", "--plugin.url=http://192.0.2.1:28100"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(args, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), "allow-remote") {
			t.Errorf("%v: exit %d, %q", args, code, stderr.String())
		}
	}
}

// TestOwnEndpointsMutateNothing: with --alertmanager.webhook off, no method
// on any path of the watchdog's own HTTP server changes anything: no admin
// call, no mode change, no counter but the `disabled` webhook count. The
// same firing alert does act once the webhook is enabled (the control).
func TestOwnEndpointsMutateNothing(t *testing.T) {
	clk := clock.NewFake(time.Now())
	sim, _, pluginURLs := simServer(t, sglangsim.Options{Clock: clk, Seed: 4})
	pin, _ := sim.Inject(0, sglangsim.PinResurrection)
	wd, o := watchdogAndOptions(t, clk, "--sglang.metrics-url=", "--force-fail.mode=off",
		"--web.listen-address=127.0.0.1:0", "--plugin.url="+pluginURLs[0])
	for s := 1; s <= 70; s++ {
		step(clk, wd)
	}
	if wd.Snapshot().Ranks[0].Stuck != 1 {
		t.Fatal("setup: the pin is not stuck")
	}
	before := wd.Snapshot()

	srv, err := newServer(o, wd, nil, newLiveness(o, wd), log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	alert := `{"version":"4","status":"firing","alerts":[{"status":"firing","labels":{"alertname":"` + alertwebhook.AlertName + `","dp_rank":"0","pp_rank":"0"}}]}`
	paths := []string{"/", "/metrics", "/-/healthy", "/-/ready", alertwebhook.Path, "/-/reload", "/-/quit",
		"/admin/force_fail", "/debug/pprof/", "/api/v1/mode", "/metrics?mode=auto", pluginapi.PathRoomVerdict + "1"}
	methods := []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}
	disabled := 0
	for _, p := range paths {
		for _, m := range methods {
			req := httptest.NewRequest(m, p, strings.NewReader(alert))
			req.Header.Set("Content-Type", "application/json")
			rec := httptest.NewRecorder()
			srv.Handler().ServeHTTP(rec, req)
			if p == alertwebhook.Path {
				disabled++
				if rec.Code != http.StatusForbidden {
					t.Errorf("%s %s with the webhook off: %d, want 403", m, p, rec.Code)
				}
			}
			if strings.HasPrefix(p, "/debug/pprof") && rec.Code == http.StatusOK && strings.Contains(rec.Body.String(), "goroutine") {
				t.Errorf("%s %s: profiling endpoints are served", m, p)
			}
		}
	}
	time.Sleep(100 * time.Millisecond)
	after := wd.Snapshot()
	if after.Mode != before.Mode {
		t.Errorf("mode changed from %s to %s", before.Mode, after.Mode)
	}
	for k, v := range after.ForceFails {
		if v != before.ForceFails[k] {
			t.Errorf("force_fails_total%v changed: %d → %d", k, before.ForceFails[k], v)
		}
	}
	for k, v := range after.Webhook {
		want := before.Webhook[k]
		if k == watchdog.WebhookDisabled {
			want += uint64(disabled)
		}
		if v != want {
			t.Errorf("webhook count %s = %d, want %d", k, v, want)
		}
	}
	for _, r := range sim.Records() {
		if !r.ForcedAt.IsZero() {
			t.Errorf("an HTTP request to the watchdog force-failed %s", r.RID)
		}
	}

	// Control: the same alert, webhook on (mode off still refuses; dry-run
	// lets the alert act through the rails).
	wd.SetMode(watchdog.ModeDryRun)
	o.webhook, o.webhookTokenFile, o.webhookMatch = true, tokenFile(t, "hook-tok"), []string{"pod=prefill-0"}
	receiver, err := webhookReceiver(o, wd, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go receiver.Run(ctx)
	srv2, err := newServer(o, wd, receiver, newLiveness(o, wd), log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv2.Close()
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, alertwebhook.Path, strings.NewReader(strings.Replace(alert, `"labels":{`, `"labels":{"pod":"prefill-0",`, 1)))
	req.Header.Set("Authorization", "Bearer hook-tok")
	srv2.Handler().ServeHTTP(rec, req)
	if rec.Code != http.StatusAccepted {
		t.Fatalf("enabled webhook answered %d: %s", rec.Code, rec.Body.String())
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for _, r := range sim.Records() {
			if r.RID == pin && !r.ForcedAt.IsZero() {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Error("control: the enabled webhook did not act, so the check above proves nothing")
}

// TestAllowRemoteStillValidatesURLs: --plugin.allow-remote lifts the
// loopback rule, not the rule that a URL names a host. Today the remote
// branch only checks the scheme prefix, so a URL without a host is
// accepted and fails on every read instead of at start.
func TestAllowRemoteStillValidatesURLs(t *testing.T) {
	for _, u := range []string{"http://", "http://:28100", "https:///metrics", "http://exa mple.com"} {
		if err := runconfig.CheckURLs(true, u); err == nil {
			t.Errorf("%q accepted with --plugin.allow-remote", u)
		}
	}
}

// TestOwnServerDropsSlowClients: the watchdog's HTTP server bounds only the
// time to read request headers (10 s). A client that sends the headers of a
// POST and then trickles, or never sends, its body holds a connection and
// a goroutine for as long as it likes (the webhook handler reads the body),
// and so does a keep-alive connection left idle after a request: enough of
// them exhaust file descriptors. The server should also bound the whole
// request read and idle keep-alive time.
func TestOwnServerDropsSlowClients(t *testing.T) {
	wd, o := watchdogAndOptions(t, clock.Real{}, "--sglang.metrics-url=", "--web.listen-address=127.0.0.1:0", "--alertmanager.webhook",
		"--alertmanager.webhook.token-file="+tokenFile(t, "hook-tok"), "--alertmanager.webhook.match-label=pod=prefill-0")
	receiver, err := webhookReceiver(o, wd, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	srv, err := newServer(o, wd, receiver, newLiveness(o, wd), log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	base, _ := serveFor(t, srv)
	addr := strings.TrimPrefix(base, "http://")

	for _, tc := range []struct{ name, send string }{
		{"stalled body", "POST " + alertwebhook.Path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"alerts\":["},
		{"idle keep-alive", "GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := conn.Write([]byte(tc.send)); err != nil {
				t.Fatal(err)
			}
			// Read whatever the server sends until it closes the
			// connection, or give up after 45 s.
			_ = conn.SetReadDeadline(time.Now().Add(45 * time.Second))
			start := time.Now()
			_, err = io.Copy(io.Discard, conn)
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Errorf("the server still held the connection after %s", time.Since(start).Round(time.Second))
			}
		})
	}
}

func TestConfigErrorsAreClear(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--plugin.timeout=2s"}, "--plugin.timeout (2s) must be shorter than --watchdog.interval (1s)"},
		{[]string{"--sglang.timeout=20s"}, "--sglang.timeout (20s) must be shorter"},
		{[]string{"--plugin.url=http://192.0.2.1:28100"}, "not a loopback address"},
		{[]string{"--plugin.token-file=/nonexistent/token"}, "reading token file"},
	} {
		var o options
		if _, err := newApp(&o).Parse(append([]string{"run"}, tc.args...)); err != nil {
			t.Fatal(err)
		}
		_, err := watchdogConfig(&o, log.NewNopLogger())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: err = %v, want %q", tc.args, err, tc.want)
		}
	}
}

func TestVersionFlag(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--version"}, &out, &out); code != 0 || !strings.HasPrefix(out.String(), appName+", version") {
		t.Fatalf("--version: exit %d, %q", code, out.String())
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
	srv, err := newServer(o, wd, nil, newLiveness(o, wd), log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	for s := 1; s <= 70; s++ {
		step(clk, wd)
	}
	req, _ := http.NewRequest(http.MethodPost, alertwebhook.Path, strings.NewReader(`{"alerts":[{"status":"firing","labels":{"alertname":"SGLangWatchdogRequestStuck","dp_rank":"0","pp_rank":"0"}}]}`))
	rec := httptest.NewRecorder()
	srv.Handler().ServeHTTP(rec, req)
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
