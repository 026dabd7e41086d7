package sglangsim

import (
	"bufio"
	"bytes"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

func TestPythonFloatFormatting(t *testing.T) {
	for f, want := range map[float64]string{
		0: "0.0", 1: "1.0", -1: "-1.0", 0.5: "0.5", 11008: "11008.0", 162: "162.0", 0.28: "0.28",
		8128902: "8.128902e+06", 7400757: "7.400757e+06", 1e6: "1e+06", 866964.5791549598: "866964.5791549598",
		2.3518979474117756e+06: "2.3518979474117756e+06", 12345678901: "1.2345678901e+010",
		0.0001: "0.0001", 1e-05: "1e-05", 0.00162: "0.00162", 1e16: "1e+16", 0.07500000000000001: "0.07500000000000001",
		-1234567: "-1234567.0", 1764403200: "1.7644032e+09",
	} {
		if got := goFloat(f); got != want {
			t.Errorf("goFloat(%v) = %q, want %q", f, got, want)
		}
	}
	if got := pyRepr(1764403200.0); got != "1764403200.0" {
		t.Errorf("pyRepr = %q", got)
	}
	if got := pyRepr(1764403200.125); got != "1764403200.125" {
		t.Errorf("pyRepr = %q", got)
	}
	if got := pyRepr(1e22); got != "1e+22" {
		t.Errorf("pyRepr = %q", got)
	}
}

var pyValue = regexp.MustCompile(`^(-?\d+\.\d+(e[+-]\d+)?|-?\d(\.\d+)?e[+-]\d+|\+Inf|-Inf|NaN)$`)

type famInfo struct {
	typ    string
	series []sample
}

// checkExposition verifies the text structure and returns the families.
func checkExposition(t *testing.T, body []byte) map[string]*famInfo {
	t.Helper()
	fams := map[string]*famInfo{}
	var cur string
	var helpFor string
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "# HELP "):
			f := strings.Fields(line)
			if len(f) < 4 {
				t.Fatalf("HELP without text: %q", line)
			}
			helpFor = f[2]
			if fams[helpFor] != nil {
				t.Fatalf("family %s twice", helpFor)
			}
		case strings.HasPrefix(line, "# TYPE "):
			f := strings.Fields(line)
			if len(f) != 4 || f[2] != helpFor {
				t.Fatalf("TYPE %q not right after its HELP (%s)", line, helpFor)
			}
			cur = f[2]
			fams[cur] = &famInfo{typ: f[3]}
		case strings.HasPrefix(line, "#") || line == "":
			t.Fatalf("unexpected line %q", line)
		default:
			smp := parseLine(t, line)
			fi := fams[cur]
			if fi == nil {
				t.Fatalf("sample before any TYPE: %q", line)
			}
			ok := smp.name == cur
			if fi.typ == "histogram" {
				ok = smp.name == cur+"_bucket" || smp.name == cur+"_sum" || smp.name == cur+"_count"
			}
			if !ok {
				t.Fatalf("sample %s in family %s (%s)", smp.name, cur, fi.typ)
			}
			if !pyValue.MatchString(smp.vtext) {
				t.Fatalf("value %q is not in Python's float format: %q", smp.vtext, line)
			}
			var keys []string
			for _, kv := range splitLabels(smp.raw) {
				k, _, _ := strings.Cut(kv, "=")
				keys = append(keys, k)
			}
			if !sort.StringsAreSorted(keys) {
				t.Fatalf("labels not sorted: %q", line)
			}
			id := smp.name + "{" + smp.raw + "}"
			if seen[id] {
				t.Fatalf("duplicate series %s", id)
			}
			seen[id] = true
			fi.series = append(fi.series, smp)
		}
	}
	return fams
}

func labelKeys(s sample) string {
	var keys []string
	for k := range s.labels {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return strings.Join(keys, ",")
}

func TestMetricsPerEra(t *testing.T) {
	type want struct {
		sched, tok string // label keys of scheduler and tokenizer series
		pd         string // bootstrap-queue gauge name
		perRank    bool
	}
	eras := map[string]want{
		EraName:       {"name", "name", "sglang:num_prefill_prealloc_queue_reqs", false},
		EraModelName:  {"model_name", "model_name", "sglang:num_prefill_prealloc_queue_reqs", false},
		EraEngineType: {"engine_type,model_name", "model_name", "sglang:num_prefill_prealloc_queue_reqs", false},
		EraV05:        {"dp_rank,engine_type,model_name,pp_rank,tp_rank", "model_name", "sglang:num_prefill_prealloc_queue_reqs", true},
		EraNewest:     {"dp_rank,engine_type,model_name,moe_ep_rank,pp_rank,tp_rank", "model_name", "sglang:num_prefill_bootstrap_queue_reqs", true},
	}
	for era, w := range eras {
		for _, dp := range []int{1, 2} {
			t.Run(era+"/dp"+string(rune('0'+dp)), func(t *testing.T) {
				s, c := newSim(t, Options{Era: era, DPSize: dp, PPSize: 2, ArrivalRate: 80, Seed: 2})
				rid, _ := s.Inject(0, PinStuckHandle)
				run(s, c, 3*time.Second, 100*time.Millisecond)
				// The request leaves only once both PP stages of dp 0 fail it;
				// each stage's Failed branch counts it.
				for _, rank := range []int{0, 1} {
					if st, _ := s.ForceFail(t.Context(), rank, forceReq(rid), ""); st != 200 {
						t.Fatal(st)
					}
				}
				run(s, c, time.Second, 100*time.Millisecond)
				fams := checkExposition(t, s.MetricsText())

				schedKeys := w.sched
				if era == EraV05 && dp == 1 {
					schedKeys = "engine_type,model_name,pp_rank,tp_rank"
				}
				nRanks := 1
				if w.perRank {
					nRanks = dp * 2
				}
				checkFam := func(name, typ, keys string, n int) *famInfo {
					t.Helper()
					fi := fams[name]
					if fi == nil {
						t.Fatalf("no family %s", name)
					}
					if fi.typ != typ || len(fi.series) != n {
						t.Fatalf("%s: type %s with %d series, want %s with %d", name, fi.typ, len(fi.series), typ, n)
					}
					for _, smp := range fi.series {
						if got := labelKeys(smp); got != keys {
							t.Fatalf("%s labels %s, want %s", name, got, keys)
						}
					}
					return fi
				}
				prio := ""
				if era == EraNewest {
					prio = ",priority"
				}
				withPrio := func(keys string) string {
					if prio == "" {
						return keys
					}
					parts := append(strings.Split(keys, ","), "priority")
					slices.Sort(parts)
					return strings.Join(parts, ",")
				}
				checkFam("sglang:num_prefill_inflight_queue_reqs", "gauge", withPrio(schedKeys), nRanks)
				checkFam(w.pd, "gauge", withPrio(schedKeys), nRanks)
				checkFam("sglang:num_running_reqs", "gauge", withPrio(schedKeys), nRanks)
				checkFam("sglang:num_used_tokens", "gauge", schedKeys, nRanks)
				fi := checkFam("sglang:num_transfer_failed_reqs_total", "counter", schedKeys, nRanks)
				total := 0.0
				for _, smp := range fi.series {
					total += smp.value
				}
				if total != 2 {
					t.Fatalf("failed counter sums to %v, want 2 (one per stage)", total)
				}
				checkFam("sglang:prompt_tokens_total", "counter", w.tok, 1)
				if f := fams["sglang:time_to_first_token_seconds"]; f == nil || f.typ != "histogram" {
					t.Fatal("no ttft histogram")
				}
				for _, smp := range fams["sglang:time_to_first_token_seconds"].series {
					keys := w.tok
					if smp.name == "sglang:time_to_first_token_seconds_bucket" {
						keys = "le," + w.tok
					}
					if labelKeys(smp) != keys {
						t.Fatalf("ttft labels %s", labelKeys(smp))
					}
				}
				if _, ok := fams["sglang:num_requests_total"]; ok != (era != EraName && era != EraModelName) {
					t.Fatalf("num_requests_total present=%v", ok)
				}
				other := "sglang:num_prefill_bootstrap_queue_reqs"
				if era == EraNewest {
					other = "sglang:num_prefill_prealloc_queue_reqs"
				}
				if _, ok := fams[other]; ok {
					t.Fatalf("%s in era %s", other, era)
				}
				kv := fams["sglang:kv_transfer_latency_ms"]
				iters := fams["sglang:scheduler_loop_iterations_total"]
				switch era {
				case EraV05:
					if kv == nil || kv.typ != "gauge" || iters != nil {
						t.Fatal("v0.5: kv_transfer gauges, no loop counter")
					}
				case EraNewest:
					if kv == nil || kv.typ != "histogram" || iters == nil {
						t.Fatal("newest: kv_transfer histograms and the loop counter")
					}
				default:
					if kv != nil || iters != nil || fams["sglang:per_stage_req_latency_seconds"] != nil ||
						fams["sglang:num_retracted_reqs"] != nil {
						t.Fatalf("era %s has v0.5+ families", era)
					}
				}
				if w.perRank {
					pidKeys := strings.Join(append(strings.Split(schedKeys, ","), "pid"), ",")
					parts := strings.Split(pidKeys, ",")
					slices.Sort(parts)
					pidKeys = strings.Join(parts, ",")
					checkFam("sglang:num_retracted_reqs", "gauge", pidKeys, nRanks)
					checkFam("sglang:num_paused_reqs", "gauge", pidKeys, nRanks)
					stages := fams["sglang:per_stage_req_latency_seconds"]
					n := 0
					for _, smp := range stages.series {
						want := schedKeys + ",stage"
						if smp.name == "sglang:per_stage_req_latency_seconds_bucket" {
							want += ",le"
						}
						parts := strings.Split(want, ",")
						slices.Sort(parts)
						if labelKeys(smp) != strings.Join(parts, ",") {
							t.Fatalf("per_stage labels %s", labelKeys(smp))
						}
						if smp.name == "sglang:per_stage_req_latency_seconds_bucket" {
							n++
						}
					}
					if n%31 != 0 || n == 0 {
						t.Fatalf("%d per-stage buckets", n)
					}
					for _, smp := range fams["sglang:num_transfer_failed_reqs_total"].series {
						if _, ok := smp.labels["pid"]; ok {
							t.Fatal("pid on a counter")
						}
					}
				}
			})
		}
	}
}

func forceReq(rid string) pluginapi.ForceFailRequest { return pluginapi.ForceFailRequest{RID: rid} }

func TestMetricsMostRecentMerge(t *testing.T) {
	s, c := newSim(t, Options{Era: EraEngineType, DPSize: 2})
	s.Submit(RequestSpec{Rank: 0, Transfer: time.Hour})
	s.Step()
	c.Advance(time.Second)
	s.Submit(RequestSpec{Rank: 0, Behavior: BehaviorHealthCheck})
	s.Step()
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != 1 {
		t.Fatalf("merged gauge %v, want rank 0's 1", v)
	}
	c.Advance(time.Second)
	s.Submit(RequestSpec{Rank: 1, Behavior: BehaviorHealthCheck})
	s.Step()
	if v := mustMetric(t, s, "sglang:num_prefill_inflight_queue_reqs", nil); v != 0 {
		t.Fatalf("merged gauge %v, want rank 1's 0 (most recent)", v)
	}
	if v := mustMetric(t, s, "sglang:num_requests_total", nil); v != 2 {
		t.Fatalf("summed requests %v", v)
	}
}

func TestMetricsHandlerAndSize(t *testing.T) {
	s, c := newSim(t, Options{Era: EraNewest, DPSize: 8, ArrivalRate: 800, Seed: 1})
	run(s, c, 30*time.Second, 100*time.Millisecond)
	srv := httptest.NewServer(s.MetricsHandler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/plain; version=0.0.4; charset=utf-8" {
		t.Fatalf("content type %q", ct)
	}
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(resp.Body)
	fams := checkExposition(t, buf.Bytes())
	n := 0
	for _, f := range fams {
		n += len(f.series)
	}
	t.Logf("DP8 newest: %d families, %d series, %d bytes", len(fams), n, buf.Len())
	if n < 2800 || n > 3600 {
		t.Fatalf("%d series, want about 3k", n)
	}
	// Histogram output order: all _sum lines, then buckets and _count per series.
	lines := strings.Split(buf.String(), "\n")
	firstBucket, lastSum := -1, -1
	for i, l := range lines {
		if strings.HasPrefix(l, "sglang:per_stage_req_latency_seconds_sum{") {
			lastSum = i
		}
		if firstBucket < 0 && strings.HasPrefix(l, "sglang:per_stage_req_latency_seconds_bucket{") {
			firstBucket = i
		}
	}
	if lastSum > firstBucket {
		t.Fatal("a _sum line after the first _bucket line")
	}
}
