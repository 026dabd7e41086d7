package e2e

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// TestTokenNeverLogged runs the binary at debug level in auto mode against the simulator with a bearer token: with the
// right token the pin is force-failed, with a wrong one every call is
// refused; neither token ever appears in the logs, and the force-fail
// command prints neither.
func TestTokenNeverLogged(t *testing.T) {
	const token = "tok-3f9a1c7e2b8d4c6f"
	for _, tc := range []struct {
		name, fileToken, want string
	}{
		{"right token", token, "plugin_result=flipped"},
		{"wrong token", "tok-wrong-77d2e0a1", "plugin_result=unauthorized"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{Clock: clock.Real{}, Token: token, Seed: 2})
			rid, room := sim.Inject(0, sglangsim.PinAbortBeforeRegister)
			tokenFile := tokenFile(t, tc.fileToken)
			wd := startWatchdog(t, "--log.level=debug",
				"--sglang.metrics-url="+metricsURL, "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
				"--plugin.url="+pluginURLs[0], "--plugin.token-file="+tokenFile, "--plugin.timeout=100ms",
				"--watchdog.interval=200ms", "--watchdog.deadline=1s", "--watchdog.stall-window=1s", "--watchdog.pin-window=20s",
				"--force-fail.mode=auto")
			logs := wd.logs
			deadline := time.Now().Add(15 * time.Second)
			for !strings.Contains(logs.String(), tc.want) && time.Now().Before(deadline) {
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(500 * time.Millisecond)
			wd.stop()
			if code := wd.cmd.ProcessState.ExitCode(); code != 0 {
				t.Errorf("the watchdog exited %d", code)
			}
			out := logs.String()
			if !strings.Contains(out, tc.want) {
				t.Fatalf("no force-fail call with %s in the logs:\n%s", tc.want, out)
			}
			for _, secret := range []string{token, tc.fileToken} {
				if strings.Contains(out, secret) {
					t.Errorf("a token appeared in the logs")
				}
			}

			_, stdout, stderr := runBinary(t, "force-fail", "--plugin.url="+pluginURLs[0], "--plugin.token-file="+tokenFile,
				"--rid="+rid, "--room="+strconv.FormatUint(room, 10), "--dry-run")
			for _, secret := range []string{token, tc.fileToken} {
				if strings.Contains(stdout+stderr, secret) {
					t.Errorf("the force-fail command printed a token: %q %q", stdout, stderr)
				}
			}
		})
	}
}
