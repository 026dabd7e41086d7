package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/alerts"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/dashboards"
	"github.com/sglang-watchdog/sglang-watchdog/internal/prombin"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startProcess runs a real server binary until the test ends, and stops it
// by its PID.
func startProcess(t *testing.T, logName string, bin string, args ...string) {
	t.Helper()
	logFile, err := os.Create(filepath.Join(t.TempDir(), logName))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			logFile.Seek(0, 0)
			b, _ := io.ReadAll(logFile)
			t.Logf("%s log (last 3000 bytes):\n%s", logName, tail(b, 3000))
		}
		logFile.Close()
	})
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func waitFor(t *testing.T, what string, timeout time.Duration, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if ok() {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("timed out after %s waiting for %s", timeout, what)
}

// webhookSink is Alertmanager's webhook receiver inside the test.
type webhookSink struct {
	mu       sync.Mutex
	messages []amMessage
}

type amMessage struct {
	Status string `json:"status"`
	Alerts []struct {
		Status string            `json:"status"`
		Labels map[string]string `json:"labels"`
	} `json:"alerts"`
}

func (s *webhookSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var m amMessage
	if err := json.NewDecoder(r.Body).Decode(&m); err == nil {
		s.mu.Lock()
		s.messages = append(s.messages, m)
		s.mu.Unlock()
	}
}

// find returns the labels of the first alert named name with the status.
func (s *webhookSink) find(name, status string) map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.messages {
		for _, a := range m.Alerts {
			if a.Labels["alertname"] == name && a.Status == status {
				return a.Labels
			}
		}
	}
	return nil
}

type promResult struct {
	Status string `json:"status"`
	Error  string `json:"error"`
	Data   struct {
		Result []json.RawMessage `json:"result"`
	} `json:"data"`
}

func promQuery(promURL, expr string) (int, error) {
	resp, err := http.Get(promURL + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var r promResult
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return 0, err
	}
	if r.Status != "success" {
		return 0, fmt.Errorf("%s", r.Error)
	}
	return len(r.Data.Result), nil
}

// TestPrometheusAlertmanagerEndToEnd proves the alerts and the dashboard
// against real servers, Debian's Prometheus 2.x and Alertmanager and the
// Prometheus 3.x and current Alertmanager that scripts/deps.sh builds: a
// pinned request in the simulator, the watchdog in dry-run mode, Prometheus
// scraping both every second with the rules loaded, Alertmanager delivering
// to a webhook here. The stuck-request alert arrives with the rank's labels,
// every dashboard query returns data, and after a switch to auto mode the
// alert resolves and the force-fail annotation has its event.
func TestPrometheusAlertmanagerEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Prometheus and Alertmanager twice; about 3 minutes")
	}
	stacks, err := prombin.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range stacks {
		t.Run(s.Name, func(t *testing.T) { prometheusAlertmanagerEndToEnd(t, s.Prometheus, s.Alertmanager) })
	}
}

func prometheusAlertmanagerEndToEnd(t *testing.T, prometheus, alertmanager string) {
	ruleFiles, err := alerts.RuleFiles()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// SGLang, newest era (kv_transfer_* histograms), with a pin on rank 0.
	sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{
		Clock: clock.Real{}, Era: sglangsim.EraNewest, Seed: 3, HookRunsWhenEmpty: true,
		ArrivalRate: 4, TransferMedian: 200 * time.Millisecond,
	})
	_, pinRoom := sim.Inject(0, sglangsim.PinResurrection)

	// The watchdog, wired as the run command does, in dry-run mode.
	wdPort := freePort(t)
	wd, o := watchdogAndOptions(t, clock.Real{}, append([]string{
		fmt.Sprintf("--web.listen-address=127.0.0.1:%d", wdPort), "--sglang.metrics-url=" + metricsURL,
		"--sglang.metrics-interval=2s", "--sglang.timeout=1s", "--force-fail.mode=dry-run",
		"--watchdog.deadline=5s", "--watchdog.stall-window=3s", "--watchdog.pin-window=10s"}, pluginArgs(pluginURLs)...)...)
	srv, err := newServer(o, wd, nil, log.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	go serveAndWatch(ctx, srv, o.web, wd, nil, log.NewNopLogger())

	sink := &webhookSink{}
	hook := httptest.NewServer(sink)
	defer hook.Close()

	dir := t.TempDir()
	amPort, promPort := freePort(t), freePort(t)
	amConfig := fmt.Sprintf(`route:
  receiver: test
  group_by: [alertname, dp_rank, pp_rank]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: test
    webhook_configs:
      - url: %s
        send_resolved: true
`, hook.URL)
	writeFile(t, filepath.Join(dir, "am.yml"), amConfig)
	startProcess(t, "alertmanager.log", alertmanager, "--config.file="+filepath.Join(dir, "am.yml"),
		"--storage.path="+filepath.Join(dir, "am-data"), fmt.Sprintf("--web.listen-address=127.0.0.1:%d", amPort),
		"--cluster.listen-address=")

	simHost := strings.TrimPrefix(strings.TrimSuffix(metricsURL, "/metrics"), "http://")
	promConfig := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [%s]
alerting:
  alertmanagers:
    - static_configs:
        - targets: ["127.0.0.1:%d"]
scrape_configs:
  - job_name: sglang-watchdog
    static_configs:
      - targets: ["127.0.0.1:%d"]
  - job_name: sglang
    static_configs:
      - targets: ["%s"]
`, strings.Join(quoteAll(ruleFiles), ", "), amPort, wdPort, simHost)
	writeFile(t, filepath.Join(dir, "prometheus.yml"), promConfig)
	startProcess(t, "prometheus.log", prometheus, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "prom-data"), fmt.Sprintf("--web.listen-address=127.0.0.1:%d", promPort))
	promURL := fmt.Sprintf("http://127.0.0.1:%d", promPort)

	waitFor(t, "Prometheus ready", 30*time.Second, func() bool {
		resp, err := http.Get(promURL + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	// The stuck-request alert fires (for: 1m) and reaches the webhook.
	var labels map[string]string
	waitFor(t, "SGLangWatchdogRequestStuck at the webhook", 150*time.Second, func() bool {
		labels = sink.find("SGLangWatchdogRequestStuck", "firing")
		return labels != nil
	})
	for k, want := range map[string]string{"dp_rank": "0", "pp_rank": "0", "severity": "critical", "job": "sglang-watchdog",
		"instance": fmt.Sprintf("127.0.0.1:%d", wdPort)} {
		if labels[k] != want {
			t.Errorf("alert label %s = %q, want %q (labels %v)", k, labels[k], want, labels)
		}
	}
	if got := wd.Snapshot().ForceFails[[2]string{watchdog.ResultWouldFlip, watchdog.TriggerAuto}]; got != 1 {
		t.Errorf("dry-run made %d would_flip calls, want 1", got)
	}

	have := dashboards.NeedsSGLangScrape | dashboards.NeedsPlugin | dashboards.NeedsHistogramEra |
		dashboards.NeedsInflightTraffic | dashboards.NeedsKVTransfer
	checkDashboard(t, promURL, have)

	// Auto mode releases the request, and the alert resolves.
	wd.SetMode(watchdog.ModeAuto)
	waitFor(t, "the pinned request released", 30*time.Second, func() bool {
		for _, r := range sim.Records() {
			if r.Room == pinRoom {
				return r.Outcome == sglangsim.OutcomeFailedForced
			}
		}
		return false
	})
	waitFor(t, "SGLangWatchdogRequestStuck resolved at the webhook", 60*time.Second, func() bool {
		return sink.find("SGLangWatchdogRequestStuck", "resolved") != nil
	})
	waitFor(t, "the release counted", 30*time.Second, func() bool {
		return wd.Snapshot().ForceFails[[2]string{watchdog.ResultReleased, watchdog.TriggerAuto}] == 1
	})
	checkDashboard(t, promURL, have|dashboards.NeedsTransferFailure|dashboards.NeedsForceFail)
}

// checkDashboard runs every dashboard query and annotation query whose needs
// the scenario meets and requires data.
func checkDashboard(t *testing.T, promURL string, have dashboards.Needs) {
	t.Helper()
	vars := dashboards.AllVars()
	checked := 0
	for _, q := range append(dashboards.Queries(), dashboards.Annotations()...) {
		if !q.Needs.SatisfiedBy(have) {
			continue
		}
		expr := dashboards.Expand(q.Expr, vars)
		var n int
		var err error
		// Rates need a few samples; give each query a little time.
		waitFor(t, fmt.Sprintf("data for %q / %s: %s", q.Panel, q.RefID, expr), 30*time.Second, func() bool {
			n, err = promQuery(promURL, expr)
			return err == nil && n > 0
		})
		checked++
	}
	if checked < 20 {
		t.Fatalf("only %d dashboard queries checked", checked)
	}
}

func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = fmt.Sprintf("%q", s)
	}
	return out
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
