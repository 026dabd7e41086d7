package e2e

import (
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// --web.systemd-socket serves on the socket systemd passes: here a loopback
// listener handed over as fd 3, with LISTEN_PID set to the binary's own
// pid by a shell that then execs it, as systemd does.
func TestSystemdSocketActivation(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	f, err := l.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	logs := &syncBuffer{}
	cmd := exec.Command("sh", "-c", `export LISTEN_PID=$$; exec "$0" "$@"`, binary, "run", "--web.systemd-socket", "--sglang.metrics-url=off")
	cmd.Env = append(os.Environ(), "LISTEN_FDS=1")
	cmd.ExtraFiles = []*os.File{f}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &watchdogProc{cmd: cmd, logs: logs}
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("watchdog log:\n%s", tail([]byte(logs.String()), 3000))
		}
	})
	waitHealthy(t, "http://"+l.Addr().String())
	// The log reaches the buffer through exec's copying goroutine, which may
	// lag behind the answer that waitHealthy got.
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "systemd") {
		if time.Now().After(deadline) {
			t.Fatalf("no log line about the systemd listeners")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
