package e2e

import (
	"context"
	"errors"
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
	if !strings.Contains(logs.String(), "systemd") {
		t.Errorf("no log line about the systemd listeners")
	}
}

// A vsock:// listen address goes to vsock, not to TCP: where the host has
// no vsock (as here, usually) the binary exits 1 naming it; where it has,
// the binary serves.
func TestVsockListenAddress(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, "run", "--web.listen-address=vsock://:19433", "--sglang.metrics-url=off")
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil:
		// Served until killed: this host has vsock.
	case errors.As(err, &exit) && exit.ExitCode() == 1 && strings.Contains(logs.String(), "vsock"):
	default:
		t.Fatalf("exit %v; want exit 1 naming vsock, or serving; log:\n%s", err, tail([]byte(logs.String()), 2000))
	}
	if strings.Contains(logs.String(), "tcp") {
		t.Errorf("the vsock address went to TCP:\n%s", tail([]byte(logs.String()), 2000))
	}
}
