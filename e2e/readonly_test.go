package e2e

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// TestBinaryWritesNothingToDisk runs the built binary the way the
// Kubernetes sidecar does (read-only root filesystem): its working
// directory, HOME and TMPDIR are empty folders, and they must stay empty
// while it watches a simulator, serves its endpoints and shuts down.
func TestBinaryWritesNothingToDisk(t *testing.T) {
	bin := binary
	sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{Clock: clock.Real{}, DPSize: 2, ArrivalRate: 5})
	sim.Inject(0, sglangsim.PinResurrection)

	work, home, tmp := t.TempDir(), t.TempDir(), t.TempDir()
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o400); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	args := append([]string{fmt.Sprintf("--web.listen-address=127.0.0.1:%d", port), "--sglang.metrics-url=" + metricsURL,
		"--sglang.metrics-interval=1s", "--sglang.timeout=500ms", "--plugin.token-file=" + token,
		"--watchdog.deadline=1s", "--watchdog.stall-window=1s", "--force-fail.mode=dry-run"}, pluginArgs(pluginURLs)...)
	cmd := exec.Command(bin, args...)
	cmd.Dir = work
	cmd.Env = []string{"HOME=" + home, "TMPDIR=" + tmp, "PATH=/usr/bin:/bin"}
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Stopped below; killed only if the test ends first (then nothing
	// waits for the kill's outcome).
	defer func() { _ = cmd.Process.Kill() }()

	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	waitFor(t, "the watchdog ready", 20*time.Second, func() bool {
		resp, err := http.Get(base + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	waitFor(t, "a dry-run force-fail", 20*time.Second, func() bool {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return strings.Contains(string(b), `sglang_watchdog_force_fails_total{result="would_flip",role="prefill",trigger="auto"} 1`)
	})
	for _, p := range []string{"/", "/-/healthy"} {
		resp, err := http.Get(base + p)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %v %v", p, resp, err)
		}
		resp.Body.Close()
	}
	// A watchdog that already exited cannot be signalled: the Wait below
	// reports how it ended, with its logs.
	_ = cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the watchdog did not stop cleanly on SIGTERM: %v\n%s", err, logs.String())
	}
	for _, dir := range []string{work, home, tmp} {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(entries) != 0 {
			t.Errorf("the watchdog wrote %v into %s", entries, dir)
		}
	}
	if strings.Contains(logs.String(), "s3cret") {
		t.Error("the token appeared in the logs")
	}
}
