package sglangsim

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// TestMetricsParseWithExpfmt parses the /metrics output of every era with
// prometheus/common/expfmt and checks families, types and label names.
func TestMetricsParseWithExpfmt(t *testing.T) {
	type want struct {
		inflightLabels string
		tokLabels      string
		families       []string // must be present
		absent         []string
	}
	v05, newest := "engine_type,model_name,pp_rank,tp_rank", "dp_rank,engine_type,model_name,moe_ep_rank,pp_rank,priority,tp_rank"
	eras := map[string]want{
		EraName: {"name", "name",
			[]string{"sglang:num_prefill_prealloc_queue_reqs", "sglang:num_transfer_failed_reqs_total"},
			[]string{"sglang:num_requests_total", "sglang:per_stage_req_latency_seconds"}},
		EraModelName: {"model_name", "model_name",
			[]string{"sglang:num_prefill_prealloc_queue_reqs"},
			[]string{"sglang:num_requests_total", "sglang:kv_transfer_latency_ms"}},
		EraEngineType: {"engine_type,model_name", "model_name",
			[]string{"sglang:num_requests_total", "sglang:num_prefill_prealloc_queue_reqs"},
			[]string{"sglang:per_stage_req_latency_seconds", "sglang:num_retracted_reqs"}},
		EraV05: {v05, "model_name",
			[]string{"sglang:num_prefill_prealloc_queue_reqs", "sglang:kv_transfer_latency_ms", "sglang:per_stage_req_latency_seconds", "sglang:num_retracted_reqs"},
			[]string{"sglang:num_prefill_bootstrap_queue_reqs", "sglang:scheduler_loop_iterations_total"}},
		EraNewest: {newest, "model_name",
			[]string{"sglang:num_prefill_bootstrap_queue_reqs", "sglang:scheduler_loop_iterations_total", "sglang:realtime_tokens_total"},
			[]string{"sglang:num_prefill_prealloc_queue_reqs"}},
	}
	for era, w := range eras {
		t.Run(era, func(t *testing.T) {
			s, c := newSim(t, Options{Era: era, ArrivalRate: 50, Seed: 4})
			s.Inject(0, PinResurrection)
			run(s, c, 5*time.Second, 100*time.Millisecond)
			p := expfmt.NewTextParser(model.LegacyValidation)
			fams, err := p.TextToMetricFamilies(bytes.NewReader(s.MetricsText()))
			if err != nil {
				t.Fatal(err)
			}
			for _, name := range w.families {
				if fams[name] == nil {
					t.Errorf("no %s", name)
				}
			}
			for _, name := range w.absent {
				if fams[name] != nil {
					t.Errorf("unexpected %s", name)
				}
			}
			names := func(m *dto.Metric) string {
				var ks []string
				for _, l := range m.GetLabel() {
					ks = append(ks, l.GetName())
				}
				slices.Sort(ks)
				return strings.Join(ks, ",")
			}
			inf := fams["sglang:num_prefill_inflight_queue_reqs"]
			if inf.GetType() != dto.MetricType_GAUGE || len(inf.GetMetric()) != 1 || names(inf.GetMetric()[0]) != w.inflightLabels {
				t.Fatalf("inflight gauge: %v", inf)
			}
			if v := inf.GetMetric()[0].GetGauge().GetValue(); era == EraNewest && v < 1 {
				t.Fatalf("inflight gauge %v", v)
			}
			pt := fams["sglang:prompt_tokens_total"]
			if pt.GetType() != dto.MetricType_COUNTER || names(pt.GetMetric()[0]) != w.tokLabels || pt.GetMetric()[0].GetCounter().GetValue() == 0 {
				t.Fatalf("prompt tokens: %v", pt)
			}
			if ps := fams["sglang:per_stage_req_latency_seconds"]; ps != nil {
				if ps.GetType() != dto.MetricType_HISTOGRAM || len(ps.GetMetric()) != numStages {
					t.Fatalf("per stage: %d series", len(ps.GetMetric()))
				}
				for _, m := range ps.GetMetric() {
					if len(m.GetHistogram().GetBucket()) != 31 { // 30 bounds and +Inf
						t.Fatalf("per stage buckets %d", len(m.GetHistogram().GetBucket()))
					}
				}
			}
			if era == EraNewest {
				kv := fams["sglang:kv_transfer_latency_ms"]
				if kv.GetType() != dto.MetricType_HISTOGRAM || kv.GetMetric()[0].GetHistogram().GetSampleCount() == 0 {
					t.Fatalf("kv latency: %v", kv)
				}
			}
			if era == EraV05 {
				if fams["sglang:kv_transfer_latency_ms"].GetType() != dto.MetricType_GAUGE {
					t.Fatal("v0.5 kv_transfer_latency_ms is a gauge")
				}
				rr := fams["sglang:num_retracted_reqs"]
				if names(rr.GetMetric()[0]) != "engine_type,model_name,pid,pp_rank,tp_rank" {
					t.Fatalf("retracted labels %s", names(rr.GetMetric()[0]))
				}
			}
		})
	}
}
