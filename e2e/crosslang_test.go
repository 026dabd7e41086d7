package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

const parityToken = "parity-token"

// startStandin runs the real Python plugin on its stand-in scheduler loop
// (sglang_plugin/tests/standin_server.py, scenario parity unless args say
// otherwise) and returns its plugin and metrics base URLs (with --pp-size 2,
// the first stage's; the second stage listens on the next port).
func startStandin(t *testing.T, backend, tokenFile string, args ...string) (string, string) {
	t.Helper()
	return startStandinScript(t, "standin_server.py", backend, tokenFile, args...)
}

// startStandinScript runs one of the stand-in servers of sglang_plugin/tests
// (standin_server.py, standin_decode_server.py: both take the same
// listener flags and print the same READY line).
func startStandinScript(t *testing.T, script, backend, tokenFile string, args ...string) (string, string) {
	t.Helper()
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Fatal("python3 not found: install the Debian package python3 (scripts/deps.sh does)")
	}
	cmd := exec.Command(python, append([]string{filepath.Join(repoRoot, "sglang_plugin", "tests", script),
		"--port", "0", "--metrics-port", "0", "--backend", backend, "--token-file", tokenFile}, args...)...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		// The stand-in exits when its stdin closes; how it exits is in
		// its stderr, logged below when the test failed.
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("stand-in stderr:\n%s", tail(stderr.Bytes(), 3000))
		}
	})
	ready := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		ready <- line
	}()
	var line string
	select {
	case line = <-ready:
	case <-time.After(20 * time.Second):
		t.Fatalf("the stand-in never said READY; stderr:\n%s", stderr.String())
	}
	var pluginPort, metricsPort int
	if _, err := fmt.Sscanf(line, "READY plugin=%d metrics=%d", &pluginPort, &metricsPort); err != nil {
		t.Fatalf("unexpected stand-in line %q: %v; stderr:\n%s", line, err, stderr.String())
	}
	return fmt.Sprintf("http://127.0.0.1:%d", pluginPort), fmt.Sprintf("http://127.0.0.1:%d/metrics", metricsPort)
}

// TestPythonPluginWithTheWatchdog runs the Go client and the watchdog
// against the real plugin code: list, force-fail the pinned request,
// confirm its release through SGLang's transfer-failed counter, and leave
// the progressing request and the health check alone.
func TestPythonPluginWithTheWatchdog(t *testing.T) {
	for _, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			tok := tokenFile(t, parityToken)
			pluginURL, metricsURL := startStandin(t, backend, tok)

			l, err := pluginapi.NewClient(pluginURL, pluginapi.ClientOptions{Timeout: 2 * time.Second}).Inflight(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(l.Inflight) != 4 || l.Inflight[1].BootstrapRoom != 18446744073709551557 || l.Server.TransferBackend != backend {
				t.Fatalf("listing %+v", l)
			}

			wd := startWatchdog(t, "--plugin.url="+pluginURL, "--plugin.token-file="+tok,
				"--sglang.metrics-url="+metricsURL, "--sglang.metrics-interval=1s", "--sglang.timeout=500ms",
				"--watchdog.stall-window=2s", "--force-fail.mode=auto")
			// Generous: the Python scheduler loop shares two cores with the
			// rest of the test suite.
			waitFor(t, "the pinned request released and confirmed", 90*time.Second, func() bool {
				return wd.has(t, `sglang_watchdog_force_fails_total{result="released",role="prefill",trigger="auto"} 1`)
			})
			exposition := wd.metrics(t)
			wd.stop()

			l, err = pluginapi.NewClient(pluginURL, pluginapi.ClientOptions{Timeout: 2 * time.Second}).Inflight(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			var left []string
			for _, r := range l.Inflight {
				left = append(left, r.RID)
			}
			if !reflect.DeepEqual(left, []string{"healthy-0002", "HEALTH_CHECK_1764403200.0", sglangsim.ParityWarmupRID}) {
				t.Fatalf("inflight after the release: %v, want the progressing request, the health check and the warm-up", left)
			}
			for _, r := range watchdog.Results {
				line := fmt.Sprintf(`sglang_watchdog_force_fails_total{result="%s",role="prefill",trigger="auto"} 0`, r)
				if r != watchdog.ResultReleased && !strings.Contains(exposition, line) {
					t.Errorf("/metrics lacks %s", line)
				}
			}
		})
	}
}

// exchange is one HTTP request and what came back.
type exchange struct {
	name   string
	method string
	path   string
	auth   string
	body   string
}

type answerShape struct {
	Status int
	Fields map[string]string // field → JSON type
	Values map[string]interface{}
	Text   string
}

// exactFields are compared by value; the rest by JSON type only, as they
// depend on time, pid or version. An empty list is always compared by value
// ("levers": [] and "orphaned_transfers": [] say something).
var exactFields = map[string]bool{
	"result": true, "rid": true, "bootstrap_room": true, "lever": true,
	"api_version": true, "bootstrap_addr": true, "poll": true, "prompt_tokens": true, "progress": true,
	"send_failed": true, "health_check": true, "dp_rank": true, "pp_rank": true, "tp_rank": true,
	"disaggregation_mode": true, "transfer_backend": true, "bootstrap": true, "waiting": true, "inflight": true,
	// Round 2.
	"levers": true, "lever_note": true, "pp_size": true, "transfer_queues": true,
	"transfer_in_flight": true, "transfer_queue": true, "outstanding_chunks": true,
	// Round 3.
	"transfer_tracking": true, "deferred_release": true,
	// Round 4 (the stand-in scenes have no worker queues: null, false and [] there).
	"transfer_progress": true, "transfer_workers": true, "chunks_queued": true, "tracked": true, "depth": true,
	"chunks_taken": true, "pages": true, "last_chunk": true, "rooms_failed": true,
}

// round4 reports whether a field path belongs to round 4 of the contract
// (transfer liveness and wedge orders).
func round4(path string) bool {
	return path == ".server.transfer_progress" || strings.HasPrefix(path, ".transfer_workers") ||
		strings.HasPrefix(path, ".wedge_orders") || strings.HasSuffix(path, ".chunks_queued")
}

// sameAnswer compares the Python plugin's answer with the simulator's.
// Round 4's fields are compared once the simulator lists them (a listing
// with server.transfer_progress); a simulator that predates round 4 is
// compared without them, and the Python plugin is held to them by
// TestPythonPluginRound4FieldsDecodeStrictly and TestRealCodeServerRound4.
func sameAnswer(py, gs answerShape) bool {
	py, gs = comparable(py, gs)
	return reflect.DeepEqual(py, gs)
}

// comparable returns both answers as sameAnswer compares them.
func comparable(py, gs answerShape) (answerShape, answerShape) {
	if _, ok := gs.Fields[".server.transfer_progress"]; !ok {
		return withoutRound4(py), withoutRound4(gs)
	}
	return py, gs
}

// withoutRound4 drops round 4's fields from an answer: what a simulator that
// predates round 4 is compared on.
func withoutRound4(a answerShape) answerShape {
	out := answerShape{Status: a.Status, Fields: map[string]string{}, Values: map[string]interface{}{}, Text: a.Text}
	for k, v := range a.Fields {
		if !round4(k) {
			out.Fields[k] = v
		}
	}
	for k, v := range a.Values {
		if !round4(k) {
			out.Values[k] = v
		}
	}
	return out
}

// movingProgress is the one room whose progress advances with time in both
// parity scenes; its progress is compared by type.
const movingProgress = "healthy-0002"

// floatFields are seconds; either side may happen to write a whole number.
var floatFields = map[string]bool{"age_seconds": true, "now_unix": true, "last_iteration_unix": true, "applied_unix": true}

func jsonType(v interface{}) string {
	switch v := v.(type) {
	case nil:
		return "null"
	case bool:
		return "bool"
	case json.Number:
		if strings.ContainsAny(string(v), ".eE") {
			return "number"
		}
		return "integer"
	case string:
		return "string"
	case []interface{}:
		return "array"
	case map[string]interface{}:
		return "object"
	}
	return fmt.Sprintf("%T", v)
}

// shape flattens a JSON answer into field paths with types, and the values
// of the fields that must match exactly.
func shape(status int, body []byte) answerShape {
	a := answerShape{Status: status, Fields: map[string]string{}, Values: map[string]interface{}{}}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v interface{}
	if err := dec.Decode(&v); err != nil {
		a.Text = strings.TrimSpace(string(body))
		return a
	}
	var walk func(prefix string, v interface{})
	walk = func(prefix string, v interface{}) {
		switch x := v.(type) {
		case map[string]interface{}:
			for k, e := range x {
				walk(prefix+"."+k, e)
			}
		case []interface{}:
			if len(x) == 0 {
				a.Fields[prefix], a.Values[prefix] = "array", "[]"
			}
			for i, e := range x {
				walk(fmt.Sprintf("%s[%d]", prefix, i), e)
			}
		default:
			leaf := prefix
			for strings.HasSuffix(leaf, "]") {
				leaf = leaf[:strings.LastIndex(leaf, "[")]
			}
			leaf = leaf[strings.LastIndex(leaf, ".")+1:]
			a.Fields[prefix] = jsonType(x)
			if floatFields[leaf] && a.Fields[prefix] == "integer" {
				// Go writes a whole float64 without a decimal point.
				a.Fields[prefix] = "number"
			}
			if exactFields[leaf] {
				a.Values[prefix] = x
			}
		}
	}
	walk("", v)
	for k, rid := range a.Values {
		if rid == movingProgress && strings.HasSuffix(k, ".rid") {
			progress := strings.TrimSuffix(k, ".rid") + ".progress"
			a.Values[progress] = a.Fields[progress]
		}
	}
	// lever_note, by the contract: "Empty when every lever works", and an
	// absent note (Go's pluginapi omits an empty one) says the same, so an
	// empty note and none compare equal. This is the only field where absent
	// and a zero value are equivalent. A non-empty note is one sentence for
	// people, like error: both sides must have one, in their own words.
	if note, ok := a.Values[".server.lever_note"]; ok {
		if note == "" {
			delete(a.Values, ".server.lever_note")
			delete(a.Fields, ".server.lever_note")
		} else {
			a.Values[".server.lever_note"] = "a sentence"
		}
	}
	return a
}

func do(t *testing.T, base string, e exchange) answerShape {
	t.Helper()
	req, err := http.NewRequest(e.method, base+e.path, strings.NewReader(e.body))
	if err != nil {
		t.Fatal(err)
	}
	if e.auth != "" {
		req.Header.Set("Authorization", e.auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", e.name, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return shape(resp.StatusCode, body)
}

// TestGoSimulatorAndPythonPluginAnswerAlike sends the same requests to the
// simulator's and the real plugin's parity scene, and requires the same
// status codes, the same fields with the same JSON types, and the same
// values wherever they do not depend on time or process (exactFields; the
// round 2 fields included). The two cannot drift apart from the contract
// without this test failing. Rules where equal values may look different:
// an empty lever_note and none are the same (see shape), a non-empty one is
// a sentence in each side's words, as error is; healthy-0002's progress
// moves with time. A Success room (409 transfer_succeeded) is not compared:
// SGLang's next pass releases a room whose status is Success, so neither
// scene can hold one still for an order to find.
func TestGoSimulatorAndPythonPluginAnswerAlike(t *testing.T) {
	for _, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			pyURL, _ := startStandin(t, backend, tokenFile(t, parityToken))
			_, _, goURLs := simServer(t, sglangsim.Options{Clock: clock.Real{}, Backend: backend, Token: parityToken, Scenario: sglangsim.ScenarioParity})

			bearer := "Bearer " + parityToken
			ff := func(name, body string) exchange {
				return exchange{name: name, method: http.MethodPost, path: pluginapi.PathForceFail, auth: bearer, body: body}
			}
			exchanges := []exchange{
				{name: "healthz", method: http.MethodGet, path: pluginapi.PathHealthz},
				{name: "listing", method: http.MethodGet, path: pluginapi.PathInflight},
				{name: "no token", method: http.MethodPost, path: pluginapi.PathForceFail, body: `{"rid":"pinned-0001"}`},
				{name: "wrong token", method: http.MethodPost, path: pluginapi.PathForceFail, auth: "Bearer nope", body: `{"rid":"pinned-0001"}`},
				ff("not json", `not json`),
				ff("no rid", `{}`),
				ff("rid not a string", `{"rid":5}`),
				ff("negative room", `{"rid":"pinned-0001","bootstrap_room":-1}`),
				ff("room too large", `{"rid":"pinned-0001","bootstrap_room":18446744073709551616}`),
				ff("dry_run not a bool", `{"rid":"pinned-0001","dry_run":"yes"}`),
				ff("null room", `{"rid":"pinned-0001","bootstrap_room":null}`),
				ff("null dry_run", `{"rid":"pinned-0001","dry_run":null}`),
				ff("not an object", `["pinned-0001"]`),
				ff("empty rid", `{"rid":""}`),
				ff("body too large", `{"rid":"pinned-0001","reason":"`+strings.Repeat("x", 70000)+`"}`),
				ff("unknown rid", `{"rid":"nobody"}`),
				ff("room mismatch", `{"rid":"pinned-0001","bootstrap_room":1}`),
				ff("dry run", `{"rid":"pinned-0001","bootstrap_room":9223372036854775001,"dry_run":true,"future_field":1}`),
				ff("dry run, 64-bit room", `{"rid":"healthy-0002","bootstrap_room":18446744073709551557,"dry_run":true}`),
				ff("dry run, health check", `{"rid":"HEALTH_CHECK_1764403200.0","bootstrap_room":0,"dry_run":true}`),
				ff("health check", `{"rid":"HEALTH_CHECK_1764403200.0","bootstrap_room":0}`),
				ff("dry run, warm-up", `{"rid":"`+sglangsim.ParityWarmupRID+`","dry_run":true}`),
				ff("warm-up", `{"rid":"`+sglangsim.ParityWarmupRID+`","bootstrap_room":0}`),
				ff("flip", `{"rid":"pinned-0001","bootstrap_room":9223372036854775001,"reason":"parity"}`),
			}
			compare(t, pyURL, goURLs[0], exchanges)
			// After the flip, the next pass releases the request in both.
			gone := ff("after release", `{"rid":"pinned-0001","bootstrap_room":9223372036854775001}`)
			waitFor(t, "both to release the pinned request", 10*time.Second, func() bool {
				return do(t, pyURL, gone).Status == http.StatusNotFound && do(t, goURLs[0], gone).Status == http.StatusNotFound
			})
			py, gs := do(t, pyURL, gone), do(t, goURLs[0], gone)
			if !sameAnswer(py, gs) {
				t.Errorf("after release: differ\n python:    %s\n simulator: %s", dump(py), dump(gs))
			}
		})
	}
}

// compare sends each exchange to both and requires the same answer shape.
func compare(t *testing.T, pyURL, goURL string, exchanges []exchange) {
	t.Helper()
	for _, e := range exchanges {
		py, gs := do(t, pyURL, e), do(t, goURL, e)
		if !sameAnswer(py, gs) {
			t.Errorf("%s: the Python plugin and the simulator differ\n python:    %s\n simulator: %s", e.name, dump(py), dump(gs))
		}
	}
}

// TestGoSimulatorAndPythonPluginAnswerAlikeOnOlderEras compares the parity
// scene on the SGLang releases where no lever works (SGLang v0.4.10:
// disaggregation/nixl/conn.py has no _send_failed and a max()-only
// update_status, so neither lever makes poll() read Failed): mid-2025
// NIXL, and the earliest scheduler whose Failed branch raises. Both must list
// no lever with a note, refuse every force-fail with 501 (dry runs too) but a
// health check or warm-up with 409, and change nothing.
func TestGoSimulatorAndPythonPluginAnswerAlikeOnOlderEras(t *testing.T) {
	for _, c := range []struct{ era, lever, backend string }{
		{"mid2025", sglangsim.LeversNIXLMid2025, sglangsim.BackendNIXL},
		{"early", sglangsim.LeversEarly, sglangsim.BackendNIXL},
		{"early", sglangsim.LeversEarly, sglangsim.BackendMooncake},
	} {
		t.Run(c.era+"/"+c.backend, func(t *testing.T) {
			pyURL, _ := startStandin(t, c.backend, tokenFile(t, parityToken), "--era", c.era)
			_, _, goURLs := simServer(t, sglangsim.Options{Clock: clock.Real{}, Backend: c.backend, LeverEra: c.lever,
				Token: parityToken, Scenario: sglangsim.ScenarioParity})
			ff := func(name, body string) exchange {
				return exchange{name: name, method: http.MethodPost, path: pluginapi.PathForceFail, auth: "Bearer " + parityToken, body: body}
			}
			listing := exchange{name: "listing", method: http.MethodGet, path: pluginapi.PathInflight}
			compare(t, pyURL, goURLs[0], []exchange{
				listing,
				ff("no token", `{"rid":"pinned-0001"}`),
				ff("bad body", `{"rid":""}`),
				ff("dry run", `{"rid":"pinned-0001","bootstrap_room":9223372036854775001,"dry_run":true}`),
				ff("flip", `{"rid":"pinned-0001","bootstrap_room":9223372036854775001}`),
				ff("unknown rid", `{"rid":"nobody"}`),
				ff("health check", `{"rid":"HEALTH_CHECK_1764403200.0","bootstrap_room":0}`),
				ff("dry run, warm-up", `{"rid":"`+sglangsim.ParityWarmupRID+`","dry_run":true}`),
			})
			py, gs := comparable(do(t, pyURL, listing), do(t, goURLs[0], listing))
			if py.Values[".queues.inflight"] != json.Number("4") || !reflect.DeepEqual(py.Values, gs.Values) {
				t.Errorf("after the refused orders:\n python:    %s\n simulator: %s", dump(py), dump(gs))
			}
			if py.Values[".server.lever_note"] != "a sentence" {
				t.Errorf("no lever_note with no lever: %s", dump(py))
			}
		})
	}
}

func dump(a answerShape) string {
	keys := make([]string, 0, len(a.Fields))
	for k := range a.Fields {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "status %d", a.Status)
	if a.Text != "" {
		fmt.Fprintf(&b, " text %q", a.Text)
	}
	for _, k := range keys {
		fmt.Fprintf(&b, " %s:%s", k, a.Fields[k])
		if v, ok := a.Values[k]; ok {
			fmt.Fprintf(&b, "=%v", v)
		}
	}
	return b.String()
}

// TestGoSimulatorAndPythonPluginAnswerAlikeOnTwoPPStages compares the
// parity scene on two PP stages of one DP rank: both stages list the same
// requests, a flip on one stage answers flipped and releases nothing (that
// stage polls Failed, the other Transferring), and the flip on the other
// stage releases the request from both.
func TestGoSimulatorAndPythonPluginAnswerAlikeOnTwoPPStages(t *testing.T) {
	py0, _ := startStandin(t, sglangsim.BackendNIXL, tokenFile(t, parityToken), "--pp-size", "2")
	pyURLs := []string{py0, nextStage(t, py0)}
	_, _, goURLs := simServer(t, sglangsim.Options{Clock: clock.Real{}, Backend: sglangsim.BackendNIXL, PPSize: 2,
		Token: parityToken, Scenario: sglangsim.ScenarioParity})
	listing := exchange{name: "listing", method: http.MethodGet, path: pluginapi.PathInflight}
	flip := exchange{name: "flip", method: http.MethodPost, path: pluginapi.PathForceFail, auth: "Bearer " + parityToken,
		body: `{"rid":"pinned-0001","bootstrap_room":9223372036854775001}`}
	for stage := range pyURLs {
		compare(t, pyURLs[stage], goURLs[stage], []exchange{listing})
	}
	compare(t, pyURLs[0], goURLs[0], []exchange{flip})
	// Both sides' loops take their next pass; stage 0 then polls Failed.
	waitFor(t, "stage 0 polling Failed on both sides", 10*time.Second, func() bool {
		return do(t, pyURLs[0], listing).Values[".inflight[0].poll"] == "Failed" &&
			do(t, goURLs[0], listing).Values[".inflight[0].poll"] == "Failed"
	})
	time.Sleep(100 * time.Millisecond) // more passes: still no release
	for stage := range pyURLs {
		compare(t, pyURLs[stage], goURLs[stage], []exchange{listing})
		if n := do(t, pyURLs[stage], listing).Values[".queues.inflight"]; n != json.Number("4") {
			t.Fatalf("stage %d released after one flip: %v rooms", stage, n)
		}
	}
	compare(t, pyURLs[1], goURLs[1], []exchange{flip})
	gone := exchange{name: "after release", method: http.MethodPost, path: pluginapi.PathForceFail, auth: "Bearer " + parityToken,
		body: `{"rid":"pinned-0001","dry_run":true}`}
	waitFor(t, "both sides to release the request from both stages", 10*time.Second, func() bool {
		for stage := range pyURLs {
			if do(t, pyURLs[stage], gone).Status != http.StatusNotFound || do(t, goURLs[stage], gone).Status != http.StatusNotFound {
				return false
			}
		}
		return true
	})
	for stage := range pyURLs {
		compare(t, pyURLs[stage], goURLs[stage], []exchange{listing, gone})
	}
}
