package faults

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// endless streams filler until the client hangs up: a body with no end.
func endless(filler byte) hookFunc {
	return func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusOK)
		chunk := bytes.Repeat([]byte{filler}, 64<<10)
		for r.Context().Err() == nil {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}
}

// gzipBomb is n zero bytes, gzip-compressed (about n/1000 bytes).
func gzipBomb(n int) []byte {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression)
	zero := make([]byte, 1<<20)
	for n > 0 {
		k := min(n, len(zero))
		_, _ = zw.Write(zero[:k])
		n -= k
	}
	_ = zw.Close()
	return b.Bytes()
}

func serveGzip(body []byte) hookFunc {
	return func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	}
}

// lyingLength announces far more than it sends.
func lyingLength(w http.ResponseWriter, r *http.Request, _ http.Handler) {
	w.Header().Set("Content-Length", "1000000000")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write([]byte(`{"api_version":1,`))
}

// mangle passes the request on and rewrites the answer's body.
func mangle(f func([]byte) []byte) hookFunc {
	return func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		rec := recorded(next, r)
		copyResponse(w, rec.Code, f(rec.Body.Bytes()))
	}
}

// editListing decodes the listing, lets f change it, and encodes it again
// through a generic map so that f can produce what the types forbid.
func editListing(f func(l map[string]any)) func([]byte) []byte {
	return func(b []byte) []byte {
		var l map[string]any
		if err := json.Unmarshal(b, &l); err != nil {
			panic(err)
		}
		f(l)
		out, _ := json.Marshal(l)
		return out
	}
}

func randomBytes(n int) []byte {
	rng := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.UintN(256))
	}
	return b
}

type bodyCase struct {
	name    string
	hook    hookFunc
	wantErr string // in the error log line
}

// TestFaultGarbageAndHugeListings: rank 0's listing turns to garbage or
// grows without bound. The rank is reported down with the reason logged,
// its last verdicts are kept, nothing is acted on there, memory does not
// follow the body, and the rank recovers when the listing does.
func TestFaultGarbageAndHugeListings(t *testing.T) {
	limit := strconv.Itoa(pluginapi.DefaultMaxBodyBytes)
	cases := []bodyCase{
		{"random bytes", answer(http.StatusOK, "application/json", string(randomBytes(4096))), "malformed listing"},
		{"truncated JSON", mangle(func(b []byte) []byte { return b[:len(b)/2] }), "malformed listing"},
		{"HTML with 200", answer(http.StatusOK, "text/html", "<html><body>It works!</body></html>"), "malformed listing"},
		{"HTML with 500", answer(http.StatusInternalServerError, "text/html", "<html>Internal Server Error</html>"), "HTTP 500"},
		{"empty body", answer(http.StatusOK, "application/json", ""), "malformed listing"},
		{"JSON null", answer(http.StatusOK, "application/json", "null"), "no api_version"},
		{"future api_version", mangle(editListing(func(l map[string]any) { l["api_version"] = 2 })), "api_version 2"},
		{"no inflight array", mangle(editListing(func(l map[string]any) { delete(l, "inflight") })), "no inflight array"},
		{"room without rid", mangle(editListing(func(l map[string]any) {
			l["inflight"] = []any{map[string]any{"bootstrap_room": 1, "poll": "Transferring", "age_seconds": 1}}
		})), "has no rid"},
		{"negative age", mangle(editListing(func(l map[string]any) {
			l["inflight"] = []any{map[string]any{"rid": "x", "bootstrap_room": 1, "poll": "Transferring", "age_seconds": -5}}
		})), "age_seconds -5"},
		{"unknown poll", mangle(editListing(func(l map[string]any) {
			l["inflight"] = []any{map[string]any{"rid": "x", "bootstrap_room": 1, "poll": "Exploded", "age_seconds": 5}}
		})), `poll \"Exploded\"`},
		{"room above 2^64", mangle(func(b []byte) []byte {
			return []byte(`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"x","bootstrap_room":18446744073709551616,"poll":"Transferring","age_seconds":1}]}`)
		}), "malformed listing"},
		{"lying Content-Length", lyingLength, "unexpected EOF"},
		{"endless body", endless(' '), "body exceeds " + limit + " bytes"},
		{"gzip bomb", serveGzip(gzipBomb(64 * mib)), "body exceeds " + limit + " bytes"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{sim: baseSim()})
			pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
			e.tick(70) // the pin is stuck and released at ~61 s; start over with another
			pin2, _ := e.sim.Inject(0, sglangsim.PinAbortBeforeRegister)
			e.tick(58) // 60 s old at ~131 s, while the listing is broken
			heap0 := heapInUse()
			e.plugins[0].setHook(onListing(tc.hook))
			e.tick(10)
			growth := int64(heapInUse()) - int64(heap0)

			p0 := e.plugins[0].url()
			e.wantMetric("rank 0 down", eq(0), "sglang_watchdog_scrape_success", "source", "plugin", "target", p0)
			e.wantMetric("failures counted", atLeast(10), "sglang_watchdog_scrape_failures_total", "source", "plugin", "target", p0)
			e.wantMetric("the other rank is up", eq(1), "sglang_watchdog_scrape_success", "source", "plugin", "target", e.plugins[1].url())
			e.wantLog("level=error", "reading plugin listing failed", "target="+p0, tc.wantErr)
			if r := e.record(pin2); !r.ForcedAt.IsZero() {
				t.Errorf("acted on a rank whose listing is unreadable: %+v", r)
			}
			if growth > 48*mib {
				t.Errorf("live heap grew by %d MiB over 10 cycles of %s", growth/mib, tc.name)
			}

			e.plugins[0].setHook(nil)
			e.tick(35)
			e.wantMetric("rank 0 recovered", eq(1), "sglang_watchdog_scrape_success", "source", "plugin", "target", p0)
			for _, rid := range []string{pin, pin2} {
				if r := e.record(rid); r.Outcome != sglangsim.OutcomeFailedForced {
					t.Errorf("pin %s not released once the listing recovered: %+v", rid, r)
				}
			}
			e.checkSafe()
		})
	}
}

// TestFaultDuplicateRoomsInListing: a listing that names the same request
// twice is readable; the request is tracked and acted on once.
func TestFaultDuplicateRoomsInListing(t *testing.T) {
	e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 1, Seed: 5}})
	pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
	e.plugins[0].setHook(onListing(mangle(func(b []byte) []byte {
		var l pluginapi.Listing
		_ = json.Unmarshal(b, &l)
		l.Inflight = append(l.Inflight, l.Inflight...)
		out, _ := json.Marshal(l)
		return out
	})))
	e.tick(5)
	e.wantMetric("tracked once", eq(1), "sglang_watchdog_tracked_rooms")
	e.wantMetric("counted once", eq(1), "sglang_watchdog_inflight_requests", "poll", "Transferring")
	e.tick(70)
	if r := e.record(pin); r.Outcome != sglangsim.OutcomeFailedForced {
		t.Fatalf("pin not released: %+v", r)
	}
	if n := len(e.allCalls()); n != 1 {
		t.Errorf("%d admin calls, want 1", n)
	}
}

// TestFaultGarbageAndHugeMetrics: SGLang's /metrics turns to garbage or
// grows without bound. The metrics source is reported down with the reason
// logged, no gauge reads as pinned while it is down, the plugin path keeps
// working, and the source recovers.
func TestFaultGarbageAndHugeMetrics(t *testing.T) {
	limit := strconv.Itoa(collector.DefaultMaxMetricsBytes)
	cut := func(b []byte) []byte {
		i := bytes.Index(b, []byte("sglang:num_prefill_inflight_queue_reqs{"))
		if i < 0 {
			panic("no inflight gauge in the simulator's /metrics")
		}
		return b[:i+45]
	}
	cases := []bodyCase{
		// Malformed, or (once nothing SGLang is left) no SGLang metrics.
		{"random bytes", answer(http.StatusOK, "text/plain", string(randomBytes(4096))), ""},
		{"truncated in a watched family", mangle(cut), "malformed metrics at line"},
		{"HTTP 503", answer(http.StatusServiceUnavailable, "text/plain", "busy"), "HTTP 503"},
		{"duplicate HELP", mangle(func(b []byte) []byte {
			return append(b, []byte("# HELP sglang:num_requests_total again\n# HELP sglang:num_requests_total again\n")...)
		}), "malformed metrics"},
		{"lying Content-Length", lyingLength, "unexpected EOF"},
		{"endless body", endless('#'), "body exceeds " + limit + " bytes"},
		{"gzip bomb", serveGzip(gzipBomb(96 * mib)), "body exceeds " + limit + " bytes"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// No traffic: the pin holds the inflight gauge, so a pinned
			// verdict is possible at all.
			e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 2, Era: sglangsim.EraNewest, Seed: 9}})
			e.sim.Inject(1, sglangsim.PinAbortBeforeRegister)
			e.plugins[1].down() // rank 1 only through its gauge
			e.tick(150)
			e.wantMetric("setup: gauge pinned", eq(1), "sglang_watchdog_queue_pinned", "queue", "prefill_inflight", "dp_rank", "1")
			heap0 := heapInUse()
			e.metrics.setHook(tc.hook)
			for i := 0; i < 4; i++ {
				e.wd.ScrapeMetrics(context.Background())
			}
			e.tick(30)
			growth := int64(heapInUse()) - int64(heap0)

			e.wantMetric("metrics down", eq(0), "sglang_watchdog_scrape_success", "source", "metrics")
			e.wantMetric("failures counted", atLeast(6), "sglang_watchdog_scrape_failures_total", "source", "metrics")
			e.wantMetric("no pinned verdict from stale data", eq(0), "sglang_watchdog_queue_pinned", "dp_rank", "1")
			e.wantMetric("plugin path unaffected", eq(1), "sglang_watchdog_scrape_success", "source", "plugin", "target", e.plugins[0].url())
			e.wantLog("level=error", "reading SGLang metrics failed", strings.ReplaceAll(tc.wantErr, `"`, `\"`))
			if growth > 48*mib {
				t.Errorf("live heap grew by %d MiB over the %s reads", growth/mib, tc.name)
			}

			e.metrics.setHook(nil)
			e.tick(15)
			e.wantMetric("metrics recovered", eq(1), "sglang_watchdog_scrape_success", "source", "metrics")
			e.wantMetric("pin seen again", eq(1), "sglang_watchdog_queue_pinned", "queue", "prefill_inflight", "dp_rank", "1")
			e.checkSafe()
		})
	}
}

// TestFaultMetricsWithoutSGLangFamilies: SGLang's /metrics URL answers 200
// with a body that holds no SGLang metric at all: an HTML page, an empty
// body, another exporter's metrics (a wrong --sglang.metrics-url, a proxy's
// error page). The pre-filter drops every unknown line, so the read counts
// as a success with no gauges: the pinned gauges vanish from the export (a
// pinned-gauge alert resolves), every gauge's unchanged time starts over,
// and nothing tells the operator. It must count as a failed read instead.
func TestFaultMetricsWithoutSGLangFamilies(t *testing.T) {
	for _, tc := range []struct{ name, body string }{
		{"HTML with 200", "<html><body>It works!</body></html>\n"},
		{"empty body", ""},
		{"another exporter", "# HELP go_goroutines Number of goroutines.\n# TYPE go_goroutines gauge\ngo_goroutines 12\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{sim: sglangsim.Options{DPSize: 2, Era: sglangsim.EraNewest, Seed: 9}})
			e.sim.Inject(1, sglangsim.PinAbortBeforeRegister)
			e.plugins[1].down()
			e.tick(150)
			e.wantMetric("setup: gauge pinned", eq(1), "sglang_watchdog_queue_pinned", "queue", "prefill_inflight", "dp_rank", "1")
			e.metrics.setHook(answer(http.StatusOK, "text/plain", tc.body))
			e.wd.ScrapeMetrics(context.Background())
			e.wantMetric("metrics down", eq(0), "sglang_watchdog_scrape_success", "source", "metrics")
			e.wantMetric("failure counted", eq(1), "sglang_watchdog_scrape_failures_total", "source", "metrics")
			e.wantLog("level=error", "reading SGLang metrics failed", "no SGLang metrics")
			e.metrics.setHook(nil)
			e.wd.ScrapeMetrics(context.Background())
			e.wantMetric("pin still known after the bad read", eq(1), "sglang_watchdog_queue_pinned", "queue", "prefill_inflight", "dp_rank", "1")
		})
	}
}
