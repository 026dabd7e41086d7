package collector

import (
	"math"
	"os"
	"path/filepath"
	"testing"
)

// FuzzParseMetrics feeds arbitrary bodies to the /metrics ingestion path,
// seeded with the real captures. It must never panic, and whatever it
// accepts must be usable: finite-or-NaN-free gauges under known queues.
func FuzzParseMetrics(f *testing.F) {
	files, _ := filepath.Glob(filepath.Join("testdata", "*.prom"))
	more, _ := filepath.Glob(filepath.Join("testdata", "fixtures", "*.prom"))
	for _, p := range append(files, more...) {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte("# TYPE sglang:num_prefill_inflight_queue_reqs gauge\nsglang:num_prefill_inflight_queue_reqs{dp_rank=\"0\"} NaN\n"))
	f.Fuzz(func(t *testing.T, body []byte) {
		s, err := ParseMetrics(body)
		if err != nil {
			return
		}
		for k, v := range s.Gauges {
			if math.IsNaN(v) {
				t.Fatalf("NaN gauge accepted for %+v", k)
			}
			if _, ok := map[string]bool{"prefill_inflight": true, "prefill_bootstrap": true, "decode_prealloc": true, "decode_transfer": true}[k.Queue]; !ok {
				t.Fatalf("unknown queue %q", k.Queue)
			}
			if k.DP == "" || k.PP == "" || k.TP == "" {
				t.Fatalf("empty rank label in %+v", k)
			}
		}
	})
}
