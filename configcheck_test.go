package main

import (
	"bytes"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
)

// TestConfigCheck: --config.check answers "config OK" and 0 for good
// arguments, and 2 with the error naming the flag or file otherwise. It
// neither binds the listen addresses (held here, so binding would fail)
// nor reads SGLang or the plugins (any request is counted).
func TestConfigCheck(t *testing.T) {
	var reads atomic.Int32
	sglang := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { reads.Add(1) }))
	defer sglang.Close()
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	token := write("token", "secret\n")
	mode := write("mode", "auto\n")
	badMode := write("bad-mode", "automatic\n")
	webConfig := write("web.yml", "tls_server_config: {}\n")
	badWebConfig := write("bad-web.yml", "no_such_key: 1\n")
	missing := filepath.Join(dir, "missing")
	good := map[string]string{"web.listen-address": held.Addr().String(), "web.probe-listen-address": held.Addr().String(),
		"sglang.metrics-url": sglang.URL + "/metrics", "plugin.url": sglang.URL, "plugin.token-file": token, "force-fail.mode-file": mode}
	args := func(extra []string) []string {
		out := []string{"run", "--config.check"}
		for k, v := range good {
			if !slices.ContainsFunc(extra, func(e string) bool { return strings.HasPrefix(e, "--"+k+"=") }) {
				out = append(out, "--"+k+"="+v)
			}
		}
		return append(out, extra...)
	}

	for _, tc := range []struct {
		name  string
		extra []string
		code  int
		want  string
	}{
		{"valid", nil, 0, ""},
		{"mode file absent", []string{"--force-fail.mode-file=" + missing}, 0, ""},
		{"bad duration", []string{"--watchdog.interval=soon"}, 2, `--watchdog.interval=soon: time: invalid duration "soon"`},
		{"bad enum", []string{"--force-fail.mode=yes"}, 2, "--force-fail.mode=yes: enum value must be one of off,dry-run,auto"},
		{"bad number", []string{"--watchdog.max-rooms=many"}, 2, "--watchdog.max-rooms=many"},
		{"timeout above interval", []string{"--plugin.timeout=2s"}, 2, "--plugin.timeout"},
		{"missing token file", []string{"--plugin.token-file=" + missing}, 2, missing},
		{"missing TLS config", []string{"--plugin.tls-config-file=" + missing}, 2, "--plugin.tls-config-file"},
		{"invalid mode file", []string{"--force-fail.mode-file=" + badMode}, 2, `--force-fail.mode-file: ` + badMode + `: unknown force-fail mode \"automatic\"`},
		{"missing web config", []string{"--web.config.file=" + missing}, 2, "--web.config.file " + missing},
		{"invalid web config", []string{"--web.config.file=" + badWebConfig}, 2, "--web.config.file " + badWebConfig},
		{"valid web config", []string{"--web.config.file=" + webConfig}, 0, ""},
		{"bad probe address", []string{"--web.probe-listen-address=9433"}, 2, "--web.probe-listen-address"},
		{"webhook without token", []string{"--alertmanager.webhook", "--alertmanager.webhook.match-label=pod=p"}, 2, "--alertmanager.webhook.token-file"},
		{"remote URL", []string{"--plugin.url=http://10.1.2.3:28100"}, 2, "--plugin.allow-remote"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(args(tc.extra), &out, &errb)
			if code != tc.code {
				t.Fatalf("exit %d, want %d; stdout %q, stderr %q", code, tc.code, out.String(), errb.String())
			}
			if tc.code == 0 && (out.String() != configOKMessage+"\n" || errb.Len() != 0) {
				t.Fatalf("stdout %q, stderr %q; want only %q", out.String(), errb.String(), configOKMessage)
			}
			if tc.code != 0 && (out.Len() != 0 || !strings.Contains(errb.String(), tc.want)) {
				t.Fatalf("stdout %q, stderr %q; want an error naming %s", out.String(), errb.String(), tc.want)
			}
		})
	}
	t.Run("bad value from the environment", func(t *testing.T) {
		t.Setenv("SGLANG_WATCHDOG_WATCHDOG_DEADLINE", "1 minute")
		var out, errb bytes.Buffer
		if code := run(args(nil), &out, &errb); code != 2 || !strings.Contains(errb.String(), "SGLANG_WATCHDOG_WATCHDOG_DEADLINE=1 minute (--watchdog.deadline)") {
			t.Fatalf("exit %d, stderr %q; want 2 naming the variable and its flag", code, errb.String())
		}
	})
	if n := reads.Load(); n != 0 {
		t.Fatalf("the check sent %d requests to SGLang or a plugin", n)
	}
}
