// Package collector reads SGLang: it scrapes and parses SGLang's /metrics
// into per-rank queue gauges and progress counters, and exports the
// watchdog's view of the world as Prometheus metrics built at scrape time.
package collector

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// DefaultMaxMetricsBytes caps a /metrics body. A DP8 payload is about
// 600 KB; a wide deployment with --enable-metrics-for-all-schedulers is an
// order of magnitude more.
const DefaultMaxMetricsBytes = 8 << 20

// MaxWatchedLines bounds the lines of watched families parsed from one
// body (expfmt costs about 12 bytes of heap per byte parsed). A DP8 server
// with --enable-metrics-for-all-schedulers has a few hundred.
const MaxWatchedLines = 10000

// queueFamilies maps SGLang's PD queue gauges (every era's name) to the
// watchdog's queue names.
var queueFamilies = map[string]string{
	"sglang:num_prefill_inflight_queue_reqs":  watchdog.QueuePrefillInflight,
	"sglang:num_prefill_prealloc_queue_reqs":  watchdog.QueuePrefillBootstrap, // v0.5 era
	"sglang:num_prefill_bootstrap_queue_reqs": watchdog.QueuePrefillBootstrap, // newest
	"sglang:num_decode_prealloc_queue_reqs":   watchdog.QueueDecodePrealloc,
	"sglang:num_decode_transfer_queue_reqs":   watchdog.QueueDecodeTransfer,
}

// progressFamilies are the counters whose movement proves the server is
// getting work done. Which ones exist depends on the SGLang version.
var progressFamilies = map[string]bool{
	watchdog.TransferFailedFamily:  true,
	watchdog.BootstrapFailedFamily: true, // decode: confirms releases from the prealloc queue
	"sglang:prompt_tokens_total":   true,
	"sglang:num_requests_total":    true,
	"sglang:realtime_tokens_total": true,
}

const (
	perStageFamily = "sglang:per_stage_req_latency_seconds"
	// TransferStageProgress is the Progress key of the number of KV
	// transfers that reached Success, from per_stage_req_latency_seconds.
	TransferStageProgress = `sglang:per_stage_req_latency_seconds_count{stage="prefill_transfer_kv_cache"}`
	transferStageLabel    = `stage="prefill_transfer_kv_cache"`
)

// MetricsScraper reads SGLang's /metrics.
type MetricsScraper struct {
	url     string
	client  *http.Client
	timeout time.Duration
	maxBody int64
}

// NewMetricsScraper returns a scraper for url; timeout bounds each read.
func NewMetricsScraper(url string, timeout time.Duration) *MetricsScraper {
	return &MetricsScraper{
		url:     url,
		client:  &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		timeout: timeout,
		maxBody: DefaultMaxMetricsBytes,
	}
}

// Target is the URL scraped.
func (s *MetricsScraper) Target() string { return s.url }

// Scrape reads and parses /metrics once.
func (s *MetricsScraper) Scrape(ctx context.Context) (*watchdog.MetricsSample, error) {
	if s.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url, nil)
	if err != nil {
		return nil, fmt.Errorf("SGLang metrics %s: %w", s.url, err)
	}
	// SGLang's prometheus_client would otherwise be free to answer in
	// OpenMetrics; the classic text format is what the pre-filter expects.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("SGLang metrics %s: %w", s.url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("SGLang metrics %s: HTTP %d", s.url, resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, s.maxBody+1))
	if err != nil {
		return nil, fmt.Errorf("SGLang metrics %s: reading body: %w", s.url, err)
	}
	if int64(len(body)) > s.maxBody {
		return nil, fmt.Errorf("SGLang metrics %s: body exceeds %d bytes", s.url, s.maxBody)
	}
	sample, err := ParseMetrics(body)
	if err != nil {
		return nil, fmt.Errorf("SGLang metrics %s: %w", s.url, err)
	}
	return sample, nil
}

// ParseMetrics extracts the watched gauges and progress counters from a
// /metrics body. A byte-level pre-pass keeps only the families used (see
// performance-notes: about 20x cheaper than parsing everything), then
// expfmt parses those lines. Errors name the line of the original body.
func ParseMetrics(body []byte) (*watchdog.MetricsSample, error) {
	filtered, lineOf, sglang := filterSGLang(body)
	if !sglang {
		return nil, errors.New("no SGLang metrics in the body (no sglang: family): is --sglang.metrics-url SGLang's /metrics?")
	}
	if len(lineOf) > MaxWatchedLines {
		return nil, fmt.Errorf("%d lines of watched families, more than %d: refusing to parse them", len(lineOf), MaxWatchedLines)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(filtered))
	if err != nil {
		var pe expfmt.ParseError
		if errors.As(err, &pe) && pe.Line >= 1 && pe.Line <= len(lineOf) {
			return nil, fmt.Errorf("malformed metrics at line %d: %s", lineOf[pe.Line-1], pe.Msg)
		}
		return nil, fmt.Errorf("malformed metrics: %w", err)
	}
	s := &watchdog.MetricsSample{Gauges: map[watchdog.GaugeKey]float64{}, Progress: map[string]float64{}}
	for name, fam := range families {
		if queue, ok := queueFamilies[name]; ok {
			for _, m := range fam.GetMetric() {
				addGauge(s, queue, m)
			}
			continue
		}
		if name == perStageFamily {
			for _, m := range fam.GetMetric() {
				if labelValue(m, "stage") == "prefill_transfer_kv_cache" && m.GetHistogram() != nil {
					s.Progress[TransferStageProgress] += float64(m.GetHistogram().GetSampleCount())
				}
			}
			continue
		}
		if progressFamilies[name] {
			for _, m := range fam.GetMetric() {
				s.Progress[name] += value(m)
			}
		}
	}
	return s, nil
}

func addGauge(s *watchdog.MetricsSample, queue string, m *dto.Metric) {
	// QueueCount gauges carry the total under priority="" and a breakdown
	// under priority="<n>"; only the total counts.
	if p := labelValue(m, "priority"); p != "" {
		return
	}
	v := value(m)
	if math.IsNaN(v) {
		return
	}
	key := watchdog.GaugeKey{
		Queue: queue,
		DP:    rankLabel(m, "dp_rank"),
		PP:    rankLabel(m, "pp_rank"),
		TP:    rankLabel(m, "tp_rank"),
	}
	// Several series can map to one rank (a pid label, moe_ep_rank); they
	// describe the same queue, so the largest is the safe reading.
	if old, ok := s.Gauges[key]; !ok || v > old {
		s.Gauges[key] = v
	}
}

func rankLabel(m *dto.Metric, name string) string {
	if v := labelValue(m, name); v != "" {
		return v
	}
	return "0"
}

func labelValue(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Untyped != nil:
		return m.GetUntyped().GetValue()
	}
	return math.NaN()
}

// filterFamilies keeps the HELP/TYPE and sample lines of the families the
// watchdog uses and drops the rest. lineOf maps each kept line to its line
// number in body.
func filterFamilies(body []byte) (out []byte, lineOf []int) {
	out, lineOf, _ = filterSGLang(body)
	return out, lineOf
}

// filterSGLang is filterFamilies that also tells whether any line names an
// SGLang family (sglang:...), watched or not.
func filterSGLang(body []byte) (out []byte, lineOf []int, sglang bool) {
	out = make([]byte, 0, 4096)
	line := 0
	for len(body) > 0 {
		line++
		var l []byte
		if i := bytes.IndexByte(body, '\n'); i >= 0 {
			l, body = body[:i+1], body[i+1:]
		} else {
			l, body = append(body, '\n'), nil
		}
		keep, isSGLang := keepLine(l)
		sglang = sglang || isSGLang
		if keep {
			if len(lineOf) == MaxWatchedLines {
				return nil, append(lineOf, line), sglang // ParseMetrics refuses it
			}
			out = append(out, l...)
			lineOf = append(lineOf, line)
		}
	}
	return out, lineOf, sglang
}

var sglangPrefix = []byte("sglang:")

// keepLine tells whether a line belongs to a watched family, and whether it
// names any SGLang family at all.
func keepLine(l []byte) (keep, sglang bool) {
	t := bytes.TrimLeft(l, " \t")
	if len(t) == 0 || t[0] == '\n' || t[0] == '\r' {
		return false, false
	}
	if t[0] == '#' {
		f := bytes.Fields(t)
		if len(f) >= 3 && (bytes.Equal(f[1], []byte("HELP")) || bytes.Equal(f[1], []byte("TYPE"))) {
			return wantFamily(string(f[2])), bytes.HasPrefix(f[2], sglangPrefix)
		}
		return false, false
	}
	end := bytes.IndexAny(t, "{ \t")
	if end < 0 {
		// A lone token is malformed; keep it so that the parser reports it.
		return true, false
	}
	name := t[:end]
	sglang = bytes.HasPrefix(name, sglangPrefix)
	if bytes.HasPrefix(name, []byte(perStageFamily)) {
		return string(name) == perStageFamily+"_count" && bytes.Contains(t, []byte(transferStageLabel)), true
	}
	return wantFamily(string(name)), sglang
}

func wantFamily(name string) bool {
	if _, ok := queueFamilies[name]; ok {
		return true
	}
	return progressFamilies[name] || name == perStageFamily
}
