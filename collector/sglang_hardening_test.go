package collector

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestScraperNeverFollowsRedirects: a /metrics URL that redirects is a
// failed read, and the redirect target is never called.
func TestScraperNeverFollowsRedirects(t *testing.T) {
	var targetHits atomic.Int32
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		targetHits.Add(1)
		fmt.Fprintln(w, "sglang:num_requests_total 1")
	}))
	defer target.Close()
	for _, code := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		redirector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, target.URL+"/metrics", code)
		}))
		_, err := NewMetricsScraper(redirector.URL+"/metrics", time.Second).Scrape(context.Background())
		redirector.Close()
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("HTTP %d", code)) {
			t.Errorf("redirect %d: err = %v, want the redirect reported as a failure", code, err)
		}
	}
	if n := targetHits.Load(); n != 0 {
		t.Fatalf("the redirect target was read %d times", n)
	}
}

// TestScraperBodyLimits: a /metrics body over the limit is refused, not
// truncated, whether plain, endless or a gzip bomb (the limit counts
// decompressed bytes), and a body that stalls is cut by the timeout.
func TestScraperBodyLimits(t *testing.T) {
	const limit = 8 << 10
	var bomb bytes.Buffer
	zw := gzip.NewWriter(&bomb)
	_, _ = zw.Write(bytes.Repeat([]byte("#\n"), 8<<20))
	_ = zw.Close()
	for _, tc := range []struct {
		name  string
		serve http.HandlerFunc
		want  string
	}{
		{"one byte over", func(w http.ResponseWriter, _ *http.Request) {
			_, _ = w.Write(bytes.Repeat([]byte("#"), limit+1))
		}, "body exceeds 8192 bytes"},
		{"endless", func(w http.ResponseWriter, r *http.Request) {
			for r.Context().Err() == nil {
				if _, err := w.Write(bytes.Repeat([]byte("# x\n"), 256)); err != nil {
					return
				}
			}
		}, "body exceeds 8192 bytes"},
		{"gzip bomb", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Encoding", "gzip")
			_, _ = w.Write(bomb.Bytes())
		}, "body exceeds 8192 bytes"},
		{"stalled body", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("# HELP sglang:num_requests_total x\n"))
			http.NewResponseController(w).Flush()
			<-r.Context().Done()
		}, "deadline exceeded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(tc.serve)
			defer srv.Close()
			s := NewMetricsScraper(srv.URL+"/metrics", 300*time.Millisecond)
			s.maxBody = limit
			start := time.Now()
			_, err := s.Scrape(context.Background())
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want %q", err, tc.want)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("the read took %s with a 300ms timeout", d)
			}
		})
	}
}

// TestParseMetricsGarbage: bodies that are not Prometheus text are refused
// with the line of the original body named, or yield nothing usable; no
// input panics.
func TestParseMetricsGarbage(t *testing.T) {
	for _, tc := range []struct {
		name, body, wantErr string
	}{
		{"bad value", "sglang:num_requests_total{model_name=\"m\"} one\n", "line 1"},
		{"unterminated labels", "# HELP x y\nsglang:num_prefill_inflight_queue_reqs{dp_rank=\"0\"\n", "line 2"},
		{"duplicate TYPE", "# TYPE sglang:num_requests_total counter\n# TYPE sglang:num_requests_total counter\n", "line 2"},
		{"lone token", "sglang:num_requests_total 1\ngarbage\n", "line 2"},
		{"invalid UTF-8 label", "sglang:num_prefill_inflight_queue_reqs{dp_rank=\"\xff\"} 1\n", "malformed metrics"},
		{"huge exponent", "sglang:num_requests_total 1e999999\n", "malformed metrics"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseMetrics([]byte(tc.body))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("err = %v, want %q", err, tc.wantErr)
			}
		})
	}
	// Lines of families the watchdog does not use are dropped unparsed,
	// binary junk included.
	s, err := ParseMetrics([]byte("sglang:num_requests_total\x00 1\n\x00\xff\xfe junk\nsglang:num_requests_total 3\n"))
	if err != nil || s.Progress["sglang:num_requests_total"] != 3 {
		t.Errorf("junk lines around a good one: %+v, %v", s, err)
	}
	// Accepted oddities must not reach the watchdog as NaN.
	s, err = ParseMetrics([]byte("sglang:num_prefill_inflight_queue_reqs{dp_rank=\"0\"} NaN\nsglang:num_prefill_inflight_queue_reqs{dp_rank=\"1\"} +Inf\n"))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range s.Gauges {
		if v != v {
			t.Errorf("NaN gauge %+v accepted", k)
		}
	}
}

// TestParseMetricsWithoutSGLangFamilies: a 200 answer with no sglang:
// family at all is not SGLang's /metrics (an HTML page, an empty body,
// another exporter behind a wrong URL). It parses today as an empty sample,
// which the watchdog takes as a successful read that removed every gauge.
func TestParseMetricsWithoutSGLangFamilies(t *testing.T) {
	for _, body := range []string{
		"",
		"<html><body>It works!</body></html>\n",
		"# HELP go_goroutines Number of goroutines.\n# TYPE go_goroutines gauge\ngo_goroutines 12\n",
	} {
		if _, err := ParseMetrics([]byte(body)); err == nil || !strings.Contains(err.Error(), "no SGLang metrics") {
			t.Errorf("%q: err = %v, want a refusal naming the problem", body, err)
		}
	}
	// Any sglang: family, watched or not, is enough: a server without
	// traffic or without PD disaggregation is still SGLang.
	if _, err := ParseMetrics([]byte("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0\n")); err != nil {
		t.Errorf("an SGLang body with no watched family was refused: %v", err)
	}
}

// TestParseMetricsWorstCaseMemory: a body made only of lines the
// pre-filter keeps (the worst case for the parser) is parsed within a
// bounded multiple of its size. 4 MiB here; the root package's
// TestBinaryStaysUnderItsMemoryLimit measures the full 32 MiB in the
// binary (docs/hardening.md).
func TestParseMetricsWorstCaseMemory(t *testing.T) {
	var b bytes.Buffer
	b.WriteString("# TYPE sglang:num_prefill_inflight_queue_reqs gauge\n")
	for i := 0; b.Len() < 4<<20; i++ {
		fmt.Fprintf(&b, "sglang:num_prefill_inflight_queue_reqs{dp_rank=\"%d\",tp_rank=\"0\",pp_rank=\"0\"} 1\n", i)
	}
	body := b.Bytes()
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	s, err := ParseMetrics(body)
	runtime.ReadMemStats(&after)
	alloc := after.TotalAlloc - before.TotalAlloc
	if err != nil {
		// Refusing such a body outright is fine, if it is cheap.
		t.Logf("%d MiB body refused after %d MiB of allocation: %v", len(body)>>20, alloc>>20, err)
		if alloc > 3*uint64(len(body)) {
			t.Errorf("refusing a %d MiB body allocated %d MiB", len(body)>>20, alloc>>20)
		}
		return
	}
	t.Logf("%d MiB body, %d series: %d MiB allocated while parsing (%.1fx the body)",
		len(body)>>20, len(s.Gauges), alloc>>20, float64(alloc)/float64(len(body)))
	if alloc > 40*uint64(len(body)) {
		t.Errorf("parsing a %d MiB body allocated %d MiB", len(body)>>20, alloc>>20)
	}
}
