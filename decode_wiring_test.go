package main

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/internal/server"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func TestDecodeFlags(t *testing.T) {
	dir := t.TempDir()
	httpConfig := filepath.Join(dir, "http.yml")
	if err := os.WriteFile(httpConfig, []byte("basic_auth:\n  username: decode\n  password: secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	badConfig := filepath.Join(dir, "bad.yml")
	if err := os.WriteFile(badConfig, []byte("no_such_field: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := []string{"--sglang.metrics-url=off"}
	cfg, err := watchdogConfig(parseRun(t, base...), log.NewNopLogger())
	if err != nil || cfg.Verdicts != nil || cfg.DecodeDeadline.String() != "3m0s" {
		t.Fatalf("defaults: verdicts %v, decode deadline %s, %v; want none and 3m", cfg.Verdicts, cfg.DecodeDeadline, err)
	}
	cfg, err = watchdogConfig(parseRun(t, append(base, "--decode.prefill-watchdog-url=https://{host}:9433", "--decode.prefill-networks=10.0.0.0/8",
		"--decode.prefill-watchdog-http-config-file="+httpConfig)...), log.NewNopLogger())
	if err != nil || cfg.Verdicts == nil {
		t.Fatalf("verdicts %v, %v; want a client", cfg.Verdicts, err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--decode.prefill-watchdog-url=http://10.0.0.1:9433"}, "{host}"},
		{[]string{"--decode.prefill-watchdog-url=http://{host}:9433", "--decode.prefill-networks=10.0.0.0/33"}, "--decode.prefill-networks"},
		{[]string{"--decode.prefill-watchdog-url=http://{host}:9433", "--decode.prefill-watchdog-http-config-file=" + badConfig}, "--decode.prefill-watchdog-http-config-file"},
		{[]string{"--decode.prefill-watchdog-http-config-file=" + httpConfig}, "needs --decode.prefill-watchdog-url"},
		{[]string{"--decode.prefill-watchdog-url=http://{host}:9433", "--decode.prefill-watchdog-timeout=0s"}, "--decode.prefill-watchdog-timeout"},
		{[]string{"--watchdog.decode-deadline=0s"}, "--watchdog.decode-deadline"},
	} {
		if err := configError(t, append(base, tc.args...)...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: error %v, want one naming %s", tc.args, err, tc.want)
		}
	}
}

// The verdict endpoint sits behind --web.config.file like /metrics, and
// never on the probe listener.
func TestVerdictEndpointBehindWebConfig(t *testing.T) {
	main, probe := serveWithBasicAuth(t, "decode", "pass")
	path := pluginapi.PathRoomVerdict + "18446744073709551615"
	if code, _ := get(t, main+path); code != http.StatusUnauthorized {
		t.Errorf("without credentials: %d, want 401", code)
	}
	if code, _ := get(t, probe+path); code != http.StatusNotFound {
		t.Errorf("probe listener: %d, want 404", code)
	}
	req, _ := http.NewRequest(http.MethodGet, main+path, nil)
	req.SetBasicAuth("decode", "pass")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v pluginapi.RoomVerdict
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil || resp.StatusCode != http.StatusOK || v.Verdict != pluginapi.VerdictUnknown || v.Room != "18446744073709551615" {
		t.Fatalf("HTTP %d %+v %v; want an unknown verdict for the room", resp.StatusCode, v, err)
	}
}

// Every route of the main listener, the verdict API and the webhook
// included, sits behind the web config's authentication.
func TestEveryRouteBehindWebConfig(t *testing.T) {
	main, _ := serveWithBasicAuth(t, "decode", "pass")
	for _, p := range append([]string{"/", "/metrics", pluginapi.PathRoomVerdict + "1"}, server.Routes...) {
		if code, _ := get(t, main+p); code != http.StatusUnauthorized {
			t.Errorf("%s without credentials: %d, want 401", p, code)
		}
	}
}

func TestDecodeBudgetFlag(t *testing.T) {
	base := []string{"--sglang.metrics-url=off"}
	cfg, err := watchdogConfig(parseRun(t, base...), log.NewNopLogger())
	if err != nil || cfg.DecodePerMinute != 180 || cfg.MaxPerMinute != 6 || cfg.FailFastPerMinute != 180 {
		t.Fatalf("defaults: decode %d, deadline %d, fail-fast %d, %v; want 180, 6, 180", cfg.DecodePerMinute, cfg.MaxPerMinute, cfg.FailFastPerMinute, err)
	}
	cfg, err = watchdogConfig(parseRun(t, append(base, "--decode.max-per-minute=30")...), log.NewNopLogger())
	if err != nil || cfg.DecodePerMinute != 30 || cfg.MaxPerMinute != 6 {
		t.Fatalf("decode %d, deadline %d, %v; want 30 and 6", cfg.DecodePerMinute, cfg.MaxPerMinute, err)
	}
	// Zero would read as "the default" in the watchdog's config.
	if err := configError(t, append(base, "--decode.max-per-minute=0")...); err == nil || !strings.Contains(err.Error(), "--decode.max-per-minute") {
		t.Fatalf("error %v, want one naming --decode.max-per-minute", err)
	}
}
