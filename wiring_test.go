package main

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-kit/log"
	"golang.org/x/crypto/bcrypt"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/internal/liveness"
	"github.com/sglang-watchdog/sglang-watchdog/internal/runconfig"
	"github.com/sglang-watchdog/sglang-watchdog/internal/server"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// configError parses run's arguments and returns watchdogConfig's error.
func configError(t *testing.T, args ...string) error {
	t.Helper()
	_, err := watchdogConfig(parseRun(t, args...), log.NewNopLogger())
	return err
}

// TestTimeoutsOfZeroOrBelowAreRefused: a timeout of 0 or below means "no
// timeout" to the clients, so one trickling rank or one admin call that
// never answers would stop every cycle. Each is refused at start, and so
// is an admin timeout the plugin's own 5 s wait fills.
func TestTimeoutsOfZeroOrBelowAreRefused(t *testing.T) {
	for _, tc := range []struct{ args, want string }{
		{"--plugin.timeout=0", "--plugin.timeout (0s) must be above zero"},
		{"--plugin.timeout=-1s", "--plugin.timeout (-1s) must be above zero"},
		{"--force-fail.timeout=0", "--force-fail.timeout (0s) must be above zero"},
		{"--force-fail.timeout=-3s", "--force-fail.timeout (-3s) must be above zero"},
		{"--force-fail.timeout=5s", "must be longer than the 5s the plugin waits"},
		{"--sglang.timeout=0", "--sglang.timeout (0s) must be above zero"},
		{"--watchdog.interval=0", "--watchdog.interval (0s) must be above zero"},
		{"--sglang.metrics-interval=0", "--sglang.metrics-interval (0s) must be above zero"},
	} {
		if err := configError(t, tc.args); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want %q", tc.args, err, tc.want)
		}
	}
	t.Setenv("SGLANG_WATCHDOG_PLUGIN_TIMEOUT", "0s")
	if err := configError(t); err == nil || !strings.Contains(err.Error(), "--plugin.timeout (0s) must be above zero") {
		t.Errorf("a zero timeout from the environment: %v", err)
	}
	os.Unsetenv("SGLANG_WATCHDOG_PLUGIN_TIMEOUT")
	for _, args := range [][]string{
		{"inflight", "--plugin.url=http://127.0.0.1:1", "--plugin.timeout=0"},
		{"force-fail", "--rid=r", "--force-fail.timeout=0"},
		{"force-fail", "--rid=r", "--force-fail.timeout=4s"},
	} {
		var out, errb bytes.Buffer
		if code := run(args, &out, &errb); code != 2 || !strings.Contains(errb.String(), "timeout") {
			t.Errorf("%v: exit %d %q, want 2 naming the timeout", args, code, errb.String())
		}
	}
}

// TestTimeoutDefaultsFollowTheirInterval: shortening an interval alone
// works (the read timeouts default to a fraction of it); an explicit
// timeout is refused only when it is not shorter than its interval.
func TestTimeoutDefaultsFollowTheirInterval(t *testing.T) {
	for _, args := range [][]string{
		{"--watchdog.interval=500ms"},
		{"--watchdog.interval=100ms"},
		{"--sglang.metrics-interval=3s"},
		{"--sglang.metrics-interval=1s", "--watchdog.interval=200ms"},
		{"--watchdog.interval=500ms", "--plugin.timeout=450ms"},
		{"--watchdog.interval=5s", "--plugin.timeout=2s"},
	} {
		if err := configError(t, args...); err != nil {
			t.Errorf("%v: %v", args, err)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--watchdog.interval=500ms", "--plugin.timeout=500ms"}, "--plugin.timeout (500ms) must be shorter than --watchdog.interval (500ms)"},
		{[]string{"--plugin.timeout=2s"}, "--plugin.timeout (2s) must be shorter than --watchdog.interval (1s)"},
		{[]string{"--sglang.metrics-interval=3s", "--sglang.timeout=3s"}, "--sglang.timeout (3s) must be shorter than --sglang.metrics-interval (3s)"},
	} {
		if err := configError(t, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: err = %v, want %q", tc.args, err, tc.want)
		}
	}
	// The default listing timeout really is shorter than a short interval:
	// a rank answering after 450 ms fails its read at 400 ms, while the
	// other rank is read.
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(450 * time.Millisecond):
		case <-r.Context().Done():
		}
		fmt.Fprint(w, `{"api_version":1,"server":{"dp_rank":1},"loop":{"iterations":1},"queues":{},"inflight":[]}`)
	}))
	defer slow.Close()
	fast := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, `{"api_version":1,"server":{},"loop":{"iterations":1},"queues":{},"inflight":[]}`)
	}))
	defer fast.Close()
	wd, _ := watchdogAndOptions(t, clock.Real{}, "--sglang.metrics-url=off", "--watchdog.interval=500ms", "--plugin.url="+fast.URL, "--plugin.url="+slow.URL)
	start := time.Now()
	wd.RunCycle(context.Background())
	if took := time.Since(start); took >= 450*time.Millisecond {
		t.Errorf("a cycle took %s: the listing timeout did not follow the 500ms interval", took)
	}
	up := map[string]bool{}
	for _, s := range wd.Snapshot().Sources {
		up[s.Target] = s.Up
	}
	if !up[fast.URL] || up[slow.URL] {
		t.Errorf("sources %v: want the fast rank up and the slow one down", up)
	}
}

// TestDuplicatePluginURLsAreRefused: one plugin named twice (case, default
// port, trailing slash, IPv6 spelling) is refused at start; different
// ranks are not.
func TestDuplicatePluginURLsAreRefused(t *testing.T) {
	for _, pair := range [][2]string{
		{"http://127.0.0.1:28100", "http://127.0.0.1:28100/"},
		{"http://127.0.0.1:28100", "http://127.0.0.1:28100//"},
		{"HTTP://LOCALHOST:28100", "http://localhost:28100"},
		{"http://127.0.0.1", "http://127.0.0.1:80"},
		{"https://localhost", "https://localhost:443/"},
		{"http://127.0.0.1:28100", "http://127.0.0.1:028100"},
		{"http://[::1]:28100", "http://[0:0:0:0:0:0:0:1]:28100/"},
		{"http://[::ffff:127.0.0.1]:28100", "http://127.0.0.1:28100"},
	} {
		err := configError(t, "--sglang.metrics-url=off", "--plugin.url="+pair[0], "--plugin.url="+pair[1])
		if err == nil || !strings.Contains(err.Error(), "name the same plugin") {
			t.Errorf("%q and %q: err = %v", pair[0], pair[1], err)
		}
		var out, errb bytes.Buffer
		if code := run([]string{"inflight", "--plugin.url=" + pair[0], "--plugin.url=" + pair[1]}, &out, &errb); code != 2 {
			t.Errorf("inflight %q and %q: exit %d", pair[0], pair[1], code)
		}
	}
	for _, pair := range [][2]string{
		{"http://127.0.0.1:28100", "http://127.0.0.1:28101"},
		{"http://127.0.0.1:28100", "https://127.0.0.1:28100"},
		{"http://127.0.0.1:28100/a", "http://127.0.0.1:28100/b"},
	} {
		if err := configError(t, "--sglang.metrics-url=off", "--plugin.url="+pair[0], "--plugin.url="+pair[1]); err != nil {
			t.Errorf("%q and %q: %v", pair[0], pair[1], err)
		}
	}
}

// TestBadTelemetryPathIsAConfigurationError: a path the HTTP mux cannot
// take, or one that would shadow another endpoint, ends the run command
// with exit status 2 and a message naming the flag, not a panic.
func TestBadTelemetryPathIsAConfigurationError(t *testing.T) {
	bad := []string{"metrics", "", "/me trics", "/{x}", "GET /metrics", "/m?x=1", pluginapi.PathRoomVerdict + "7"}
	for _, p := range append(bad, server.Routes...) {
		var out, errb bytes.Buffer
		code := run([]string{"run", "--web.listen-address=127.0.0.1:0", "--sglang.metrics-url=off", "--web.telemetry-path=" + p}, &out, &errb)
		if code != 2 || !strings.Contains(errb.String(), "--web.telemetry-path") {
			t.Errorf("%q: exit %d, %s", p, code, errb.String())
		}
	}
}

// TestMetricsWatchOffFromTheEnvironment: an empty variable counts as
// unset (kingpin), so "off" is the way to turn the gauge watch off from a
// Kubernetes env entry; it works on the command line too.
func TestMetricsWatchOffFromTheEnvironment(t *testing.T) {
	t.Setenv("SGLANG_WATCHDOG_SGLANG_METRICS_URL", "off")
	cfg, err := watchdogConfig(parseRun(t), log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Metrics != nil {
		t.Error(`SGLANG_WATCHDOG_SGLANG_METRICS_URL=off left the gauge watch on`)
	}
	t.Setenv("SGLANG_WATCHDOG_SGLANG_METRICS_URL", "")
	if cfg, err := watchdogConfig(parseRun(t), log.NewNopLogger()); err != nil || cfg.Metrics == nil {
		t.Errorf("an empty variable is documented to keep the default: %v %v", cfg.Metrics, err)
	}
	for _, arg := range []string{"--sglang.metrics-url=off", "--sglang.metrics-url="} {
		if cfg, err := watchdogConfig(parseRun(t, arg), log.NewNopLogger()); err != nil || cfg.Metrics != nil {
			t.Errorf("%s: metrics %v err %v", arg, cfg.Metrics, err)
		}
	}
}

// TestTokenWithANewlineInsideIsRefusedAtStart: such a token makes every
// admin call fail with an invalid header, retried for ever; it is refused
// at start by run, force-fail and the webhook, without quoting it.
func TestTokenWithANewlineInsideIsRefusedAtStart(t *testing.T) {
	bad := tokenFile(t, "SeCrEt\nTok-987")
	if err := configError(t, "--plugin.token-file="+bad); err == nil || !strings.Contains(err.Error(), "whitespace") || strings.Contains(err.Error(), "SeCrEt") {
		t.Errorf("run: %v", err)
	}
	var out, errb bytes.Buffer
	if code := run([]string{"force-fail", "--rid=r", "--plugin.token-file=" + bad}, &out, &errb); code != 2 || strings.Contains(errb.String(), "SeCrEt") {
		t.Errorf("force-fail: exit %d %q", code, errb.String())
	}
	wd, o := watchdogAndOptions(t, clock.Real{}, "--sglang.metrics-url=off", "--alertmanager.webhook",
		"--alertmanager.webhook.token-file="+bad, "--alertmanager.webhook.match-label=pod=p")
	if _, err := webhookReceiver(o, wd, log.NewNopLogger()); err == nil || !strings.Contains(err.Error(), "whitespace") {
		t.Errorf("webhook: %v", err)
	}
}

// TestWebhookNeedsItsOwnCredentialAndIdentity: the webhook does not start
// without a token file and a label naming this watchdog, nor behind basic
// auth, which Alertmanager could not send along with the token.
func TestWebhookNeedsItsOwnCredentialAndIdentity(t *testing.T) {
	tok := tokenFile(t, "hook-tok")
	webConfig := filepath.Join(t.TempDir(), "web.yml")
	if err := os.WriteFile(webConfig, []byte("basic_auth_users:\n  prometheus: $2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--alertmanager.webhook"}, "needs --alertmanager.webhook.token-file"},
		{[]string{"--alertmanager.webhook", "--alertmanager.webhook.token-file=" + tok}, "needs at least one --alertmanager.webhook.match-label"},
		{[]string{"--alertmanager.webhook", "--alertmanager.webhook.token-file=" + tok, "--alertmanager.webhook.match-label=pod"}, "want NAME=VALUE"},
		{[]string{"--alertmanager.webhook.token-file=" + tok}, "need --alertmanager.webhook"},
		{[]string{"--alertmanager.webhook", "--alertmanager.webhook.token-file=" + tok, "--alertmanager.webhook.match-label=pod=p", "--web.config.file=" + webConfig}, "basic_auth_users"},
	} {
		wd, o := watchdogAndOptions(t, clock.Real{}, append([]string{"--sglang.metrics-url=off"}, tc.args...)...)
		if _, err := webhookReceiver(o, wd, log.NewNopLogger()); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: err = %v, want %q", tc.args, err, tc.want)
		}
	}
	var out, errb bytes.Buffer
	if code := run([]string{"run", "--web.listen-address=127.0.0.1:0", "--sglang.metrics-url=off", "--alertmanager.webhook"}, &out, &errb); code != 2 {
		t.Errorf("run with a webhook and no token: exit %d", code)
	}
}

// serveFor starts srv until the test ends and returns its main and probe
// base URLs. A server that stopped with an error (a listener it could not
// open) fails the test with that error.
func serveFor(t *testing.T, srv *server.Server) (string, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("serving: %v", err)
		}
	})
	probe := ""
	if a := srv.ProbeAddr(); a != nil {
		probe = "http://" + a.String()
	}
	addr := srv.Addr(ctx)
	if addr == nil {
		t.Fatal("the server does not serve")
	}
	return "http://" + addr.String(), probe
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestProbesWorkWithWebConfig: with basic auth from --web.config.file the
// main listener answers 401 to a probe, as the toolkit must; the probe
// listener answers the health endpoints without credentials, and nothing
// else.
func TestProbesWorkWithWebConfig(t *testing.T) {
	main, probe := serveWithBasicAuth(t, "prometheus", "scrape-pass")
	if code, _ := get(t, main+"/-/healthy"); code != http.StatusUnauthorized {
		t.Errorf("main listener /-/healthy without credentials: %d, want 401", code)
	}
	if code, body := get(t, probe+"/-/healthy"); code != http.StatusOK || !strings.Contains(body, "Healthy") {
		t.Errorf("probe listener /-/healthy: %d %q", code, body)
	}
	if code, _ := get(t, probe+"/-/ready"); code != http.StatusOK {
		t.Errorf("probe listener /-/ready: %d", code)
	}
	for _, p := range []string{"/metrics", "/", alertwebhook.Path} {
		if code, body := get(t, probe+p); code != http.StatusNotFound {
			t.Errorf("probe listener serves %s: %d %.80q", p, code, body)
		}
	}
}

// serveWithBasicAuth serves a watchdog after one cycle, behind a
// --web.config.file with one basic-auth user, and with a probe listener;
// it returns the main and the probe listener's base URLs.
func serveWithBasicAuth(t *testing.T, user, pass string) (main, probe string) {
	t.Helper()
	hash, err := bcrypt.GenerateFromPassword([]byte(pass), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	webConfig := filepath.Join(t.TempDir(), "web.yml")
	if err := os.WriteFile(webConfig, []byte("basic_auth_users:\n  "+user+": "+string(hash)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	wd, o := watchdogAndOptions(t, clock.Real{}, "--sglang.metrics-url=off", "--web.listen-address=127.0.0.1:0",
		"--web.config.file="+webConfig, "--web.probe-listen-address=127.0.0.1:0")
	srv, err := newServer(o, wd, nil, newLiveness(o, wd), log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	wd.RunCycle(context.Background())
	return serveFor(t, srv)
}

// TestLivenessReflectsAStoppedLoop: /-/healthy fails once the watch loop
// has not finished a cycle for three intervals plus an admin timeout, and
// recovers when it cycles again.
func TestLivenessReflectsAStoppedLoop(t *testing.T) {
	clk := clock.NewFake(time.Now())
	wd, o := watchdogAndOptions(t, clk, "--sglang.metrics-url=off", "--web.listen-address=127.0.0.1:0", "--web.probe-listen-address=127.0.0.1:0")
	live := liveness.New(wd, o.watch.Interval, o.watch.AdminTimeout, clk.Now)
	srv, err := newServer(o, wd, nil, live, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	live.LoopStarted()
	healthy := func() int {
		rec := httptest.NewRecorder()
		srv.Probes().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/-/healthy", nil))
		return rec.Code
	}
	if code := healthy(); code != http.StatusOK {
		t.Fatalf("just started: %d", code)
	}
	wd.RunCycle(context.Background())
	clk.Advance(9 * time.Second) // limit: 3 × 1s + 7s
	if code := healthy(); code != http.StatusOK {
		t.Fatalf("9s after a cycle: %d", code)
	}
	clk.Advance(2 * time.Second)
	if code := healthy(); code != http.StatusServiceUnavailable {
		t.Fatalf("11s without a cycle: %d, want 503", code)
	}
	wd.RunCycle(context.Background())
	if code := healthy(); code != http.StatusOK {
		t.Fatalf("after a new cycle: %d", code)
	}
}

// TestMetricsHandlerIsInstrumented: the promhttp_* series the README
// promises are served, and the webhook's refusal counter with it.
func TestMetricsHandlerIsInstrumented(t *testing.T) {
	wd, o := watchdogAndOptions(t, clock.Real{}, "--sglang.metrics-url=off", "--web.listen-address=127.0.0.1:0", "--alertmanager.webhook",
		"--alertmanager.webhook.token-file="+tokenFile(t, "hook-tok"), "--alertmanager.webhook.match-label=pod=p")
	receiver, err := webhookReceiver(o, wd, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	srv, err := newServer(o, wd, receiver, newLiveness(o, wd), log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	for i := 0; i < 2; i++ {
		rec := httptest.NewRecorder()
		srv.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		if i == 1 {
			for _, want := range []string{`promhttp_metric_handler_requests_total{code="200"} 1`, "promhttp_metric_handler_requests_in_flight 1",
				`sglang_watchdog_alert_webhook_refusals_total{reason="unauthorized"} 0`} {
				if !strings.Contains(rec.Body.String(), want) {
					t.Errorf("/metrics lacks %s", want)
				}
			}
		}
	}
}

// recordingPlugin is a TLS plugin stand-in that records the Authorization
// header of every request by path.
type recordingPlugin struct {
	mu   sync.Mutex
	auth map[string][]string
}

func (p *recordingPlugin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	p.auth[r.URL.Path] = append(p.auth[r.URL.Path], r.Header.Get("Authorization"))
	p.mu.Unlock()
	if r.URL.Path == pluginapi.PathInflight {
		fmt.Fprint(w, `{"api_version":1,"server":{},"loop":{"iterations":1},"queues":{},"inflight":[]}`)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprint(w, `{"result":"would_flip","rid":"r"}`)
}

func (p *recordingPlugin) seen(path string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.auth[path]...)
}

// TestPluginTLSAndTokenRotation: https plugin URLs are verified with the
// CA of --plugin.tls-config-file; the token goes with admin calls only and
// is re-read on every call, so a rotated Secret needs no restart; a bad
// rotation fails the call with a clear error and sends nothing.
func TestPluginTLSAndTokenRotation(t *testing.T) {
	plugin := &recordingPlugin{auth: map[string][]string{}}
	srv := httptest.NewTLSServer(plugin)
	defer srv.Close()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	tlsFile := filepath.Join(dir, "tls.yml")
	if err := os.WriteFile(tlsFile, []byte("ca_file: ca.pem\nmin_version: TLS12\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tok := tokenFile(t, "first-Tok")

	// Without the CA the server is not trusted: the file is what makes
	// the calls below work.
	noCA, _, err := runconfig.PluginTransports("", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pluginapi.NewClient(srv.URL, pluginapi.ClientOptions{Timeout: 2 * time.Second, Transport: noCA}).Inflight(context.Background()); err == nil {
		t.Fatal("a self-signed plugin was trusted without --plugin.tls-config-file")
	}

	listing, admin, err := runconfig.PluginTransports(tlsFile, tok)
	if err != nil {
		t.Fatal(err)
	}
	c := pluginapi.NewClient(srv.URL, pluginapi.ClientOptions{Timeout: 2 * time.Second, AdminTimeout: 6 * time.Second, Transport: listing, AdminTransport: admin})
	ctx := context.Background()
	order := pluginapi.ForceFailRequest{RID: "r", DryRun: true}
	if _, err := c.Inflight(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.ForceFail(ctx, order); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tok, []byte("second-Tok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.ForceFail(ctx, order); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tok, []byte("third\nTok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err = c.ForceFail(ctx, order)
	if err == nil || !strings.Contains(err.Error(), "token file") || strings.Contains(err.Error(), "third") {
		t.Errorf("a bad rotation: err = %v, want a clear error naming the token file", err)
	}
	if got := plugin.seen(pluginapi.PathInflight); len(got) != 1 || got[0] != "" {
		t.Errorf("listing reads carried Authorization %q", got)
	}
	if got, want := plugin.seen(pluginapi.PathForceFail), []string{"Bearer first-Tok", "Bearer second-Tok"}; strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("admin calls carried %q, want %q (and nothing for the bad rotation)", got, want)
	}

	// The run command wires the same transports.
	_, err = watchdogConfig(parseRun(t, "--sglang.metrics-url=off", "--plugin.allow-remote", "--plugin.url="+srv.URL,
		"--plugin.tls-config-file="+filepath.Join(dir, "missing.yml")), log.NewNopLogger())
	if err == nil || !strings.Contains(err.Error(), "--plugin.tls-config-file") {
		t.Errorf("a missing TLS file: %v", err)
	}
	if err := os.WriteFile(tlsFile, []byte("ca_file: ca.pem\nverify: yes\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := runconfig.PluginTransports(tlsFile, ""); err == nil || !strings.Contains(err.Error(), "verify") {
		t.Errorf("an unknown TLS key: %v", err)
	}
}

// TestInflightTableIsSafeForATerminal: rids with escape sequences, OSC
// sequences or newlines are escaped as the logs do, so that they cannot
// forge rows or drive the terminal; long rids are cut, and the table says
// so; health checks and warm-ups come last, marked.
func TestInflightTableIsSafeForATerminal(t *testing.T) {
	long := strings.Repeat("x", 5000)
	rooms := []pluginapi.Room{
		{RID: "HEALTH_CHECK_1764403200.0", BootstrapRoom: 0, Poll: pluginapi.PollTransferring, AgeSeconds: 900, HealthCheck: true},
		{RID: "warmup-1", BootstrapRoom: 0, BootstrapAddr: "2.2.2.2:8998", Poll: pluginapi.PollTransferring, AgeSeconds: 800},
		{RID: "red\x1b[31mRED\x1b[0m", BootstrapRoom: 11, Poll: pluginapi.PollTransferring, AgeSeconds: 300},
		{RID: "osc\x1b]0;pwned\x07", BootstrapRoom: 12, Poll: pluginapi.PollTransferring, AgeSeconds: 200},
		{RID: "a\ndp9/pp9  1.0s  Success  0  request  forged  1  false", BootstrapRoom: 13, Poll: pluginapi.PollTransferring, AgeSeconds: 100},
		{RID: "bidi\u202eevil", BootstrapRoom: 14, Poll: pluginapi.PollTransferring, AgeSeconds: 50},
		{RID: long, BootstrapRoom: 15, Poll: pluginapi.PollTransferring, AgeSeconds: 10},
	}
	var buf bytes.Buffer
	printInflightTable(&buf, []rankListing{{Target: "x", Listing: &pluginapi.Listing{Inflight: rooms}}})
	out := buf.String()
	if strings.ContainsAny(out, "\x1b\x07\u202e") {
		t.Errorf("raw control characters reached the terminal:\n%q", out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	// header, 7 rows, count, health-check note, cut note
	if len(lines) != 11 {
		t.Fatalf("%d lines, want 11 (a rid forged a row?):\n%s", len(lines), out)
	}
	for i, want := range []string{"red", "osc", `"a\ndp9`, "bidi", "xxxx", "HEALTH_CHECK_1764403200.0", "warmup-1"} {
		if !strings.Contains(lines[i+1], want) {
			t.Errorf("row %d is %q, want %q (requests oldest first, health checks last)", i+1, lines[i+1], want)
		}
	}
	for _, i := range []int{6, 7} {
		if !strings.Contains(lines[i], "HEALTH_CHECK  ") {
			t.Errorf("row %d not marked as a health check: %q", i, lines[i])
		}
	}
	if len(lines[5]) > 200 || !strings.Contains(lines[5], "more bytes]") || !strings.Contains(out, "cut here; --output=json prints them whole") {
		t.Errorf("the long rid is not cut, or the cut not said:\n%s", out)
	}
	var js bytes.Buffer
	enc := json.NewEncoder(&js)
	if err := enc.Encode(rooms); err != nil || strings.ContainsAny(js.String(), "\x1b\x07") {
		t.Errorf("JSON output carries raw control characters")
	}
}

// TestForceFailRefusesHealthChecks: the command refuses SGLang's health
// checks and warm-ups (rid prefix, room 0, or what the listing says),
// dry run or not, before any admin call.
func TestForceFailRefusesHealthChecks(t *testing.T) {
	_, _, pluginURLs := simServer(t, sglangsim.Options{Clock: clock.NewFake(time.Now()), Scenario: sglangsim.ScenarioParity})
	var calls int
	var mu sync.Mutex
	warm := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == pluginapi.PathInflight {
			fmt.Fprint(w, `{"api_version":1,"server":{},"loop":{"iterations":1},"queues":{},"inflight":[`+
				`{"rid":"warmup-1","bootstrap_room":0,"bootstrap_addr":"2.2.2.2:8998","poll":"Transferring","age_seconds":1,"progress":0}]}`)
			return
		}
		mu.Lock()
		calls++
		mu.Unlock()
		fmt.Fprint(w, `{"result":"would_flip","rid":"warmup-1"}`)
	}))
	defer warm.Close()
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"--plugin.url=" + pluginURLs[0], "--rid=HEALTH_CHECK_1764403200.0", "--dry-run"}, 2},
		{[]string{"--plugin.url=" + pluginURLs[0], "--rid=HEALTH_CHECK_1764403200.0"}, 2},
		{[]string{"--plugin.url=" + pluginURLs[0], "--rid=pinned-0001", "--room=0", "--dry-run"}, 2},
		{[]string{"--plugin.url=" + warm.URL, "--rid=warmup-1", "--dry-run"}, 1},
		{[]string{"--plugin.url=" + warm.URL, "--rid=warmup-1"}, 1},
	} {
		var out, errb bytes.Buffer
		code := run(append([]string{"force-fail"}, tc.args...), &out, &errb)
		if code != tc.code || !strings.Contains(errb.String(), "never force-failed") || strings.Contains(out.String(), "would_flip") || strings.Contains(out.String(), "flipped") {
			t.Errorf("%v: exit %d, %q %q; want exit %d and a refusal", tc.args, code, out.String(), errb.String(), tc.code)
		}
	}
	if calls != 0 {
		t.Errorf("%d admin calls for a warm-up", calls)
	}
	// The health check is still there, untouched.
	var out, errb bytes.Buffer
	if code := run([]string{"inflight", "--plugin.url=" + pluginURLs[0]}, &out, &errb); code != 0 || !strings.Contains(out.String(), "HEALTH_CHECK_1764403200.0") {
		t.Errorf("inflight after the refusals: exit %d\n%s", code, out.String())
	}
}

// --restart.state-file reaches the watchdog, which refuses a path it
// cannot write in auto mode.
func TestRestartStateFileFlag(t *testing.T) {
	state := filepath.Join(t.TempDir(), "restart-state.json")
	cfg, err := watchdogConfig(parseRun(t, "--sglang.metrics-url=off", "--restart.mode=auto", "--restart.state-file="+state), log.NewNopLogger())
	if err != nil || cfg.RestartStateFile != state {
		t.Fatalf("config %q, %v; want the state file", cfg.RestartStateFile, err)
	}
	cfg.Clock = clock.Real{}
	if _, err := watchdog.New(cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(state); err != nil {
		t.Fatalf("state file not written at start: %v", err)
	}
}
