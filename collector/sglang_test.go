package collector

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

func gk(queue, dp, pp, tp string) watchdog.GaugeKey {
	return watchdog.GaugeKey{Queue: queue, DP: dp, PP: pp, TP: tp}
}

func TestParseFixtures(t *testing.T) {
	cases := []struct {
		file     string
		families int // every family in the file, parsed in full
		gauges   map[watchdog.GaugeKey]float64
		progress map[string]float64
	}{
		{
			// Real capture, late-2024 docs: model_name only, no PD gauges.
			file: "fixtures/sglang-docs-production-metrics-llama31-8b.prom", families: 12,
			gauges:   map[watchdog.GaugeKey]float64{},
			progress: map[string]float64{"sglang:prompt_tokens_total": 8128902},
		},
		{
			// Real capture, PR #7944 (~v0.4.9 PD setup): engine_type="unified".
			file: "fixtures/sglang-pr7944-deepseek-r1-pd-excerpt.prom", families: 6,
			gauges:   map[watchdog.GaugeKey]float64{},
			progress: map[string]float64{"sglang:num_requests_total": 217},
		},
		{
			file: "v05-dp2-pd.prom", families: 8,
			gauges: map[watchdog.GaugeKey]float64{
				gk(watchdog.QueuePrefillInflight, "0", "0", "0"):  0,
				gk(watchdog.QueuePrefillInflight, "1", "0", "0"):  1,
				gk(watchdog.QueuePrefillBootstrap, "0", "0", "0"): 2,
				gk(watchdog.QueuePrefillBootstrap, "1", "0", "0"): 0,
			},
			progress: map[string]float64{
				watchdog.TransferFailedFamily: 7,
				TransferStageProgress:         200,
				"sglang:prompt_tokens_total":  1.2e6,
				"sglang:num_requests_total":   200,
			},
		},
		{
			file: "newest-pd.prom", families: 7,
			gauges: map[watchdog.GaugeKey]float64{
				gk(watchdog.QueuePrefillInflight, "0", "0", "0"):  3, // the priority="" total, not the breakdown
				gk(watchdog.QueuePrefillBootstrap, "0", "0", "0"): 4,
				gk(watchdog.QueueDecodePrealloc, "0", "0", "0"):   5,
				gk(watchdog.QueueDecodeTransfer, "0", "0", "0"):   6,
			},
			progress: map[string]float64{"sglang:realtime_tokens_total": 1024},
		},
		{
			file: "name-era.prom", families: 2,
			gauges:   map[watchdog.GaugeKey]float64{},
			progress: map[string]float64{"sglang:num_requests_total": 12},
		},
	}
	for _, tc := range cases {
		t.Run(tc.file, func(t *testing.T) {
			body, err := os.ReadFile(filepath.Join("testdata", tc.file))
			if err != nil {
				t.Fatal(err)
			}
			// The whole capture must be valid exposition, every family of it.
			p := expfmt.NewTextParser(model.UTF8Validation)
			all, err := p.TextToMetricFamilies(bytes.NewReader(body))
			if err != nil {
				t.Fatalf("full parse: %v", err)
			}
			if len(all) != tc.families {
				t.Errorf("full parse found %d families, want %d", len(all), tc.families)
			}
			s, err := ParseMetrics(body)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(s.Gauges, tc.gauges) {
				t.Errorf("gauges = %v, want %v", s.Gauges, tc.gauges)
			}
			if !reflect.DeepEqual(s.Progress, tc.progress) {
				t.Errorf("progress = %v, want %v", s.Progress, tc.progress)
			}
		})
	}
}

func TestPidLabelIsNotARank(t *testing.T) {
	body := `# TYPE sglang:num_prefill_inflight_queue_reqs gauge
sglang:num_prefill_inflight_queue_reqs{dp_rank="2",model_name="m",pid="912",pp_rank="0",tp_rank="2"} 1.0
sglang:num_prefill_inflight_queue_reqs{dp_rank="2",model_name="m",pid="913",pp_rank="0",tp_rank="2"} 0.0
`
	s, err := ParseMetrics([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := map[watchdog.GaugeKey]float64{gk(watchdog.QueuePrefillInflight, "2", "0", "2"): 1}
	if !reflect.DeepEqual(s.Gauges, want) {
		t.Fatalf("gauges = %v, want %v", s.Gauges, want)
	}
}

func TestMalformedBodyNamesTheLine(t *testing.T) {
	body := "# HELP sglang:num_running_reqs x\n# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1\n" +
		"# TYPE sglang:num_prefill_inflight_queue_reqs gauge\nsglang:num_prefill_inflight_queue_reqs{dp_rank=\"0\" 1\n"
	_, err := ParseMetrics([]byte(body))
	if err == nil || !strings.Contains(err.Error(), "line 5") {
		t.Fatalf("err = %v, want a parse error naming line 5", err)
	}
}

func TestIgnoredGarbageIsNotParsed(t *testing.T) {
	// Families the watchdog does not use are dropped before parsing, so
	// that a quirk in one of them cannot blind the watchdog.
	body := "sglang:something_else{a=\"b\" broken\n# TYPE sglang:num_requests_total counter\nsglang:num_requests_total 3\n"
	s, err := ParseMetrics([]byte(body))
	if err != nil || s.Progress["sglang:num_requests_total"] != 3 {
		t.Fatalf("ParseMetrics = %v, %v", s, err)
	}
}

func TestScrapeErrors(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/500", func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "boom", http.StatusInternalServerError) })
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	mux.HandleFunc("/huge", func(w http.ResponseWriter, _ *http.Request) {
		chunk := []byte(strings.Repeat("# padding comment line\n", 1000))
		for i := 0; i < 2000; i++ {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	mux.HandleFunc("/garbage", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("# TYPE sglang:num_requests_total counter\nsglang:num_requests_total not-a-number\n")) // the reader checks it
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, tc := range []struct {
		path, want string
	}{
		{"/500", "HTTP 500"},
		{"/slow", "deadline exceeded"},
		{"/huge", "body exceeds"},
		{"/garbage", "line 2"},
	} {
		s := NewMetricsScraper(srv.URL+tc.path, 200*time.Millisecond)
		s.maxBody = 1 << 20
		_, err := s.Scrape(context.Background())
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), srv.URL+tc.path) {
			t.Errorf("%s: err = %v, want one naming the source and %q", tc.path, err, tc.want)
		}
	}
}
