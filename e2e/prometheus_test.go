package e2e

import (
	"encoding/json"
	"fmt"
	"io"
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

	"github.com/sglang-watchdog/sglang-watchdog/alerts"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/dashboards"
	"github.com/sglang-watchdog/sglang-watchdog/internal/prombin"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

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
		// Killed: its exit status says only that.
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			if _, err := logFile.Seek(0, io.SeekStart); err != nil {
				t.Logf("%s log: %v", logName, err)
			}
			b, _ := io.ReadAll(logFile)
			t.Logf("%s log (last 3000 bytes):\n%s", logName, tail(b, 3000))
		}
		logFile.Close()
	})
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
		Result []struct {
			Metric map[string]string `json:"metric"`
		} `json:"result"`
	} `json:"data"`
}

// promSeries runs an instant query and returns the label sets of its result.
func promSeries(promURL, expr string) ([]map[string]string, error) {
	resp, err := http.Get(promURL + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var r promResult
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return nil, err
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("%s", r.Error)
	}
	out := make([]map[string]string, len(r.Data.Result))
	for i, s := range r.Data.Result {
		out[i] = s.Metric
	}
	return out, nil
}

// TestPrometheusAlertmanagerEndToEnd proves the alerts, the dashboard and
// the shipped Alertmanager route (deploy/alertmanager/webhook-route.yml)
// against real servers: Debian's Prometheus 2.x and Alertmanager 0.25, and
// the Prometheus 3.x and current Alertmanager that scripts/deps.sh builds
// (internal/prombin), one subtest each, run side by side. In each: a pinned
// request in the simulator, the watchdog binary in dry-run mode with its
// webhook on, Prometheus scraping both every second with the rules loaded
// (the target labelled with pod and namespace, as a PodMonitor does),
// Alertmanager delivering to a sink here and, through the shipped route with
// its bearer token, to the watchdog. The stuck-request alert arrives with
// the rank's labels, the watchdog force-fails the pin under trigger "alert"
// while in dry-run mode, the alert resolves, the force-fail annotation has
// the release as an event, and every dashboard query and annotation whose
// needs the scenario meets returns data.
func TestPrometheusAlertmanagerEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Prometheus and Alertmanager twice; about 90 s")
	}
	stacks, err := prombin.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range stacks {
		t.Run(s.Name, func(t *testing.T) {
			// Both pairs mostly wait for the alert's `for`: side by side
			// they take the time of one.
			t.Parallel()
			prometheusAlertmanagerEndToEnd(t, s.Prometheus, s.Alertmanager)
		})
	}
}

func prometheusAlertmanagerEndToEnd(t *testing.T, prometheus, alertmanager string) {
	ruleFiles, err := alerts.RuleFiles()
	if err != nil {
		t.Fatal(err)
	}

	// SGLang, newest era (kv_transfer_* histograms), with a pin on rank 0.
	sim, metricsURL, pluginURLs := simServer(t, sglangsim.Options{
		Clock: clock.Real{}, Era: sglangsim.EraNewest, Seed: 3, HookRunsWhenEmpty: true,
		// Healthy transfers are capped at 100 medians (10 s), under the
		// deadline below, so that only the pin can be stuck.
		ArrivalRate: 4, TransferMedian: 100 * time.Millisecond,
	})
	_, pinRoom := sim.Inject(0, sglangsim.PinResurrection)

	// The watchdog binary in dry-run mode, its webhook on for this pod.
	hookToken := tokenFile(t, "am-route-Tok_5d2f9")
	wd := startWatchdog(t, append([]string{"--sglang.metrics-url=" + metricsURL,
		"--sglang.metrics-interval=2s", "--sglang.timeout=1s", "--force-fail.mode=dry-run",
		"--watchdog.deadline=15s", "--watchdog.stall-window=5s", "--watchdog.pin-window=10s",
		"--alertmanager.webhook", "--alertmanager.webhook.token-file=" + hookToken,
		"--alertmanager.webhook.match-label=pod=sglang-prefill-0", "--alertmanager.webhook.match-label=namespace=llm"},
		pluginArgs(pluginURLs)...)...)
	wdPort := wd.port

	sink := &webhookSink{}
	hook := httptest.NewServer(sink)
	defer hook.Close()

	dir := t.TempDir()
	amPort, promPort := freePort(t), freePort(t)
	amConfig := shippedRoute(t, map[string]string{
		"http://sglang-prefill-0.sglang-prefill.llm.svc:9433":     wd.base,
		"/etc/alertmanager/secrets/sglang-watchdog-webhook/token": hookToken,
		"group_wait: 30s":    "group_wait: 1s",
		"group_interval: 5m": "group_interval: 1s",
		// A sink here sees every alert first, and lets the routes after
		// it (the shipped one) see them too.
		"  routes:\n":  "  routes:\n    - receiver: test\n      group_by: [alertname, dp_rank, pp_rank]\n      group_wait: 1s\n      group_interval: 1s\n      continue: true\n",
		"receivers:\n": fmt.Sprintf("receivers:\n  - name: test\n    webhook_configs:\n      - url: %s\n        send_resolved: true\n", hook.URL),
	})
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
        labels: {pod: sglang-prefill-0, namespace: llm}
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

	// The stuck-request alert fires (for: 1m) and reaches the webhook: in
	// dry-run mode it is the warning, which names the mode.
	var labels map[string]string
	waitFor(t, "SGLangWatchdogRequestStuck at the webhook", 150*time.Second, func() bool {
		labels = sink.find("SGLangWatchdogRequestStuck", "firing")
		return labels != nil
	})
	for k, want := range map[string]string{"dp_rank": "0", "pp_rank": "0", "severity": "warning", "mode": "dry-run", "job": "sglang-watchdog",
		"instance": fmt.Sprintf("127.0.0.1:%d", wdPort)} {
		if labels[k] != want {
			t.Errorf("alert label %s = %q, want %q (labels %v)", k, labels[k], want, labels)
		}
	}
	if !wd.has(t, `sglang_watchdog_force_fails_total{result="would_flip",role="prefill",trigger="auto"} 1`) {
		t.Errorf("dry-run did not make exactly one would_flip call; the watchdog's force-fail series:\n%s", grepLines(wd.metrics(t), "sglang_watchdog_force_fail"))
	}

	// The shipped route delivers the alert to the watchdog, which releases
	// the request through its rails, and the alert resolves.
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
	waitFor(t, "the release counted under trigger alert", 30*time.Second, func() bool {
		return wd.has(t, `sglang_watchdog_force_fails_total{result="released",role="prefill",trigger="alert"} 1`)
	})
	for _, line := range []string{`sglang_watchdog_force_fail_mode{mode="dry-run"} 1`, `sglang_watchdog_alert_webhook_requests_total{result="accepted"} 1`,
		`sglang_watchdog_alert_webhook_refusals_total{reason="unauthorized"} 0`, `sglang_watchdog_alert_webhook_refusals_total{reason="foreign_target"} 0`} {
		if !wd.has(t, line) {
			t.Errorf("/metrics lacks %s", line)
		}
	}
	// The force-fail annotation marks the release with its result and trigger.
	anno := annotation(t, "Force-fails")
	waitFor(t, "the release in the force-fail annotation", 30*time.Second, func() bool {
		events, err := promSeries(promURL, dashboards.Expand(anno.Expr, dashboards.AllVars()))
		if err != nil {
			return false
		}
		for _, e := range events {
			if e["result"] == "released" && e["trigger"] == "alert" {
				return true
			}
		}
		return false
	})
	have := dashboards.NeedsSGLangScrape | dashboards.NeedsPlugin | dashboards.NeedsHistogramEra |
		dashboards.NeedsInflightTraffic | dashboards.NeedsKVTransfer | dashboards.NeedsTransferFailure |
		dashboards.NeedsForceFail | dashboards.NeedsWebhook
	checkDashboard(t, promURL, have)
}

// annotation returns the dashboard's annotation query named name.
func annotation(t *testing.T, name string) dashboards.Query {
	t.Helper()
	for _, a := range dashboards.Annotations() {
		if a.Panel == name {
			return a
		}
	}
	t.Fatalf("the dashboard has no annotation %q", name)
	return dashboards.Query{}
}

// shippedRoute reads the Alertmanager route example and makes the given
// replacements, each of which must apply exactly once.
func shippedRoute(t *testing.T, replace map[string]string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "deploy", "alertmanager", "webhook-route.yml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := string(b)
	for from, to := range replace {
		if n := strings.Count(cfg, from); n != 1 {
			t.Fatalf("the route example holds %q %d times, want once", from, n)
		}
		cfg = strings.Replace(cfg, from, to, 1)
	}
	return cfg
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
		// Rates need a few samples; give each query a little time.
		waitFor(t, fmt.Sprintf("data for %q / %s: %s", q.Panel, q.RefID, expr), 30*time.Second, func() bool {
			series, err := promSeries(promURL, expr)
			return err == nil && len(series) > 0
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

// grepLines returns the lines of text that contain substr, for failure messages.
func grepLines(text, substr string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, substr) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
