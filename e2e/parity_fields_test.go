package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// Issue 24, item 6: the simulator against SGLang's own prefill code (TP1),
// field by field, on the two releases the conformance harness loads for
// both backends. Each case plays the same scenes on a real-code server and
// on a simulator configured as that release: a healthy transfer, a stuck
// handle and its force-fail, and (where the release has transfer workers)
// rooms queued behind the hung chunk and a wedge order. Rooms and rids are
// the same on both sides, so they compare by value; what only time or the
// process decides compares by JSON type (looseFields).

// fieldCase is one release and backend, and the simulator configured as it.
type fieldCase struct {
	release, backend string
	leverEra         string
	untracked        bool // no _staging_outstanding in the release's manager
}

var fieldCases = []fieldCase{
	{realCodeRelease, sglangsim.BackendNIXL, sglangsim.LeversNewest, false},
	{realCodeRelease, sglangsim.BackendMooncake, sglangsim.LeversNewest, false},
	// NIXL up to v0.5.11 posts each chunk from the scheduler thread and
	// reads its handles in poll(): the mid-2025 lever era.
	{"sglang-v0.5.11", sglangsim.BackendNIXL, sglangsim.LeversNIXLMid2025, true},
	{"sglang-v0.5.11", sglangsim.BackendMooncake, sglangsim.LeversNewest, true},
}

// looseFields are compared by JSON type only: clocks, ages, process ids,
// counters of loop passes, chunk serial numbers (each side numbers its
// worker's chunks from its own start), link names (a uuid4 or a session
// address drawn at start) and the version string (the simulator stands
// for a family of releases, not one).
var looseFields = map[string]bool{
	"now_unix": true, "last_iteration_unix": true, "iterations": true, "age_seconds": true, "pid": true,
	"seconds": true, "expires_in_seconds": true, "applied_unix": true, "bootstrap_addr": true, "chunk": true,
	"link": true, "sglang_version": true, "recent": true, "error": true,
}

// omittedWhenEmpty are the fields the Go writers of the listing (pluginapi,
// which the simulator serves) leave out when empty and the plugin writes
// as "" or []: the watchdog decodes both alike.
var omittedWhenEmpty = map[string]bool{"lever_note": true, "finished": true}

func emptyJSON(v any) bool {
	switch x := v.(type) {
	case nil:
		return true
	case string:
		return x == ""
	case []any:
		return len(x) == 0
	}
	return false
}

// fieldDiffs collects every difference of one case, for the table the
// test logs.
type fieldDiffs struct {
	c    fieldCase
	rows []string
}

func (d *fieldDiffs) add(scene, field string, real, sim any) {
	d.rows = append(d.rows, fmt.Sprintf("%s | %s | %s | %s | real %s | sim %s", scene, strings.TrimPrefix(d.c.release, "sglang-"),
		d.c.backend, field, compactJSON(real), compactJSON(sim)))
}

func compactJSON(v any) string {
	if v == nil {
		return "absent"
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "bool"
	case float64:
		return "number"
	case string:
		return "string"
	case []any:
		return "array"
	default:
		return "object"
	}
}

// diff compares two decoded JSON values under path.
func (d *fieldDiffs) diff(scene, path string, real, sim any) {
	key := path[strings.LastIndexAny(path, ".]")+1:]
	if omittedWhenEmpty[key] && emptyJSON(real) && emptyJSON(sim) {
		return
	}
	if key == "lever_note" {
		// One sentence of the writer's own words: whether there is one.
		if emptyJSON(real) != emptyJSON(sim) {
			d.add(scene, path+" (given)", real, sim)
		}
		return
	}
	if looseFields[key] {
		if jsonKind(real) != jsonKind(sim) {
			d.add(scene, path+" (type)", jsonKind(real), jsonKind(sim))
		}
		return
	}
	rm, rok := real.(map[string]any)
	sm, sok := sim.(map[string]any)
	if rok && sok {
		keys := map[string]bool{}
		for k := range rm {
			keys[k] = true
		}
		for k := range sm {
			keys[k] = true
		}
		sorted := make([]string, 0, len(keys))
		for k := range keys {
			sorted = append(sorted, k)
		}
		sort.Strings(sorted)
		for _, k := range sorted {
			rv, rin := rm[k]
			sv, sin := sm[k]
			if omittedWhenEmpty[k] && (!rin || !sin) && emptyJSON(rv) && emptyJSON(sv) {
				continue
			}
			switch {
			case rin && !sin:
				d.add(scene, path+"."+k, rv, nil)
			case sin && !rin:
				d.add(scene, path+"."+k, nil, sv)
			default:
				d.diff(scene, path+"."+k, rv, sv)
			}
		}
		return
	}
	ra, rok := real.([]any)
	sa, sok := sim.([]any)
	if rok && sok && len(ra) == len(sa) {
		for i := range ra {
			d.diff(scene, fmt.Sprintf("%s[%d]", path, i), ra[i], sa[i])
		}
		return
	}
	if !reflect.DeepEqual(real, sim) {
		d.add(scene, path, real, sim)
	}
}

// fieldSide is one side of a case: a plugin listener, its /metrics and
// how a request is admitted.
type fieldSide struct {
	name    string
	client  *pluginapi.Client
	plugin  string
	metrics string
	admit   func(t *testing.T, rid string, room uint64, behaviour string)
}

// listing is the side's raw /debug/inflight, decoded.
func (s *fieldSide) listing(t *testing.T) map[string]any {
	t.Helper()
	var l map[string]any
	if err := json.Unmarshal([]byte(getText(t, s.plugin+pluginapi.PathInflight)), &l); err != nil {
		t.Fatalf("%s: %v", s.name, err)
	}
	return l
}

// row is the listing row of rid, nil when it is not listed.
func row(l map[string]any, rid string) map[string]any { return entry(l, "inflight", "rid", rid) }

// worker is the listing's transfer_workers entry of queue q, nil if none.
func worker(l map[string]any, q float64) map[string]any {
	return entry(l, "transfer_workers", "transfer_queue", q)
}

// asMap is an answer as the listing's JSON reads, so that both sides'
// answers compare field by field.
func asMap(v any) map[string]any {
	var m map[string]any
	b, _ := json.Marshal(v)
	_ = json.Unmarshal(b, &m)
	return m
}

// entry is the element of the listing's list whose key holds want, nil if none.
func entry(l map[string]any, list, key string, want any) map[string]any {
	items, _ := l[list].([]any)
	for _, item := range items {
		if m, ok := item.(map[string]any); ok && m[key] == want {
			return m
		}
	}
	return nil
}

// counters sums each counter of a text exposition over its labels (0 for
// one declared without a sample: prometheus_client writes no sample of a
// labelled counter before its first increment). Gauges
// are left out: the real-code server runs no prefill batch and sets
// SGLang's inflight gauge after every pass (conformance/server.py), where
// SGLang sets its gauges when it logs a batch's stats.
func counters(text string) map[string]float64 {
	out := map[string]float64{}
	isCounter := map[string]bool{}
	for _, line := range strings.Split(text, "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" && f[3] == "counter" {
			name := strings.TrimSuffix(f[2], "_total") + "_total"
			isCounter[name] = true
			out[name] += 0
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name := line
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name = line[:i]
		}
		var v float64
		fields := strings.Fields(line[strings.LastIndex(line, "}")+1:])
		if len(fields) == 0 {
			continue
		}
		if _, err := fmt.Sscan(fields[0], &v); err == nil && isCounter[name] {
			out[name] += v
		}
	}
	return out
}

// compareMetrics compares the families both sides expose; SGLang's
// histograms' buckets and the simulator's own families are left out.
func (d *fieldDiffs) compareMetrics(t *testing.T, scene string, real, sim *fieldSide) {
	t.Helper()
	rc, sc := counters(getText(t, real.metrics)), counters(getText(t, sim.metrics))
	names := make([]string, 0, len(rc))
	for name := range rc {
		if _, ok := sc[name]; ok && !strings.HasSuffix(name, "_bucket") && !strings.HasSuffix(name, "_created") {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		if batchCounters[name] {
			continue
		}
		if rc[name] != sc[name] {
			d.add(scene, "/metrics "+name, rc[name], sc[name])
		}
	}
	if len(names) == 0 || !slices.Contains(names, "sglang:num_transfer_failed_reqs_total") {
		d.add(scene, "/metrics counters both expose", names, names)
	}
}

// batchCounters count the work of prefill batches, which the real-code
// server does not run (it puts each request in the inflight queue
// directly): the simulator counts its prompt tokens there.
var batchCounters = map[string]bool{"sglang:realtime_tokens_total": true, "sglang:prompt_tokens_total": true,
	"sglang:num_requests_total": true, "sglang:cached_tokens_total": true, "sglang:generation_tokens_total": true}

// serverFields are the listing's server fields the scenes compare.
var serverFields = []string{"transfer_backend", "disaggregation_mode", "levers", "lever_note", "transfer_tracking",
	"transfer_progress", "transfer_queues", "transfer_ranks", "transfer_ranks_watched", "tp_rank", "dp_rank", "pp_rank"}

func (d *fieldDiffs) compareServer(scene string, real, sim map[string]any) {
	rs, _ := real["server"].(map[string]any)
	ss, _ := sim["server"].(map[string]any)
	for _, k := range serverFields {
		d.diff(scene, "server."+k, rs[k], ss[k])
	}
}

// compareRows compares the rows of rids (listed or not) on both sides.
func (d *fieldDiffs) compareRows(scene string, real, sim map[string]any, rids ...string) {
	for _, rid := range rids {
		r, s := row(real, rid), row(sim, rid)
		if (r == nil) != (s == nil) {
			d.add(scene, "listed "+rid, r != nil, s != nil)
			continue
		}
		if r != nil {
			d.diff(scene, "row "+rid, r, s)
		}
	}
}

// forceFail posts req to both sides and records where their HTTP status
// or answer differ; it returns SGLang's own status and answer.
func (d *fieldDiffs) forceFail(t *testing.T, scene string, real, sim *fieldSide, req pluginapi.ForceFailRequest) (int, map[string]any) {
	t.Helper()
	statuses, answers := [2]int{}, [2]map[string]any{}
	for i, s := range []*fieldSide{real, sim} {
		status, resp, err := s.client.ForceFail(context.Background(), req)
		if err != nil {
			t.Fatalf("%s: force-fail: %v", s.name, err)
		}
		statuses[i], answers[i] = status, asMap(resp)
	}
	if statuses[0] != statuses[1] {
		d.add(scene, "HTTP status", statuses[0], statuses[1])
	}
	d.diff(scene, "answer", answers[0], answers[1])
	return statuses[0], answers[0]
}

// simAdmit admits requests to the simulator as the real-code server's
// behaviours name them: specs by behaviour, every room bound for port.
func simAdmit(sim *sglangsim.Sim, specs map[string]sglangsim.RequestSpec, port int) func(*testing.T, string, uint64, string) {
	return func(t *testing.T, rid string, room uint64, behaviour string) {
		t.Helper()
		spec := specs[behaviour]
		spec.RID, spec.Room, spec.DecodePort, spec.PromptTokens = rid, room, port, 4
		sim.Submit(spec)
	}
}

func TestSimulatorParityFieldByField(t *testing.T) { eachFieldCase(t, fieldScenes) }

// eachFieldCase plays scenes on every case, in parallel, and reports each
// difference they collect as an error.
func eachFieldCase(t *testing.T, scenes func(t *testing.T, src string, d *fieldDiffs)) {
	if testing.Short() {
		t.Skip("starts SGLang's own code")
	}
	for _, c := range fieldCases {
		src := sglangSource(t, c.release)
		d := &fieldDiffs{c: c}
		t.Run(strings.TrimPrefix(c.release, "sglang-")+"/"+c.backend, func(t *testing.T) {
			t.Parallel()
			scenes(t, src, d)
			for _, r := range d.rows {
				t.Errorf("%s", r)
			}
		})
	}
}

// fieldScenes plays the three scenes of one case on both sides.
func fieldScenes(t *testing.T, src string, d *fieldDiffs) {
	const token = "fields-token"
	srv := startRealCodeServer(t, src, d.c.backend, tokenFile(t, token), "--pass-interval", "0.02")
	opts := pluginapi.ClientOptions{Timeout: 2 * time.Second, AdminTimeout: 10 * time.Second, Token: token}
	real := &fieldSide{name: "SGLang " + d.c.release, client: pluginapi.NewClient(srv.pluginURL, opts),
		plugin: srv.pluginURL, metrics: srv.control + "/metrics"}
	// The simulator sends every room to one decode port, on the queue
	// SGLang's own code put the first room on.
	var queue int
	real.admit = func(t *testing.T, rid string, room uint64, behaviour string) {
		t.Helper()
		var a struct {
			Queue *int `json:"transfer_queue"`
		}
		if err := json.Unmarshal(srv.post(t, "/scenario/admit", map[string]any{"rid": rid, "room": room, "behaviour": behaviour}), &a); err != nil {
			t.Fatal(err)
		}
		if a.Queue != nil {
			queue = *a.Queue
		}
	}

	real.admit(t, "healthy", 9001, "slow:1.5")
	port := 17000 + queue
	sim, _ := startSim(t, sglangsim.Options{Clock: clock.Real{}, Backend: d.c.backend, LeverEra: d.c.leverEra,
		UntrackedTransfers: d.c.untracked, DecodePorts: []int{port}, Token: token})
	plugin := httptest.NewServer(sim.PluginHandler(0))
	t.Cleanup(plugin.Close)
	metrics := httptest.NewServer(sim.MetricsHandler())
	t.Cleanup(metrics.Close)
	simSide := &fieldSide{name: "simulator", client: pluginapi.NewClient(plugin.URL, opts), plugin: plugin.URL,
		metrics: metrics.URL}
	specs := map[string]sglangsim.RequestSpec{
		"slow:1.5": {Behavior: sglangsim.BehaviorHealthy, Transfer: 1500 * time.Millisecond, Chunks: 1},
		"hang":     {Behavior: sglangsim.BehaviorPinStuckHandle, FreezeAt: -1},
		"complete": {Behavior: sglangsim.BehaviorHealthy, Transfer: 10 * time.Millisecond, Chunks: 1},
	}
	simSide.admit = simAdmit(sim, specs, port)
	simSide.admit(t, "healthy", 9001, "slow:1.5")
	listed := func(s *fieldSide, rid string) bool { return row(s.listing(t), rid) != nil }

	// Scene 1: a healthy transfer, listed while its chunk is in flight,
	// then gone; SGLang's counters.
	waitFor(t, "the healthy request listed on the simulator", 5*time.Second, func() bool { return listed(simSide, "healthy") })
	time.Sleep(500 * time.Millisecond)
	rl, sl := real.listing(t), simSide.listing(t)
	d.compareServer("healthy, in flight", rl, sl)
	d.compareRows("healthy, in flight", rl, sl, "healthy")
	d.diff("healthy, in flight", "queues", rl["queues"], sl["queues"])
	d.diff("healthy, in flight", fmt.Sprintf("transfer_workers[%d]", queue), worker(rl, float64(queue)), worker(sl, float64(queue)))
	waitFor(t, "the healthy request gone on both sides", 10*time.Second, func() bool {
		return !listed(real, "healthy") && !listed(simSide, "healthy")
	})
	time.Sleep(300 * time.Millisecond)
	rl, sl = real.listing(t), simSide.listing(t)
	d.compareRows("healthy, done", rl, sl, "healthy")
	d.diff("healthy, done", fmt.Sprintf("transfer_workers[%d]", queue), worker(rl, float64(queue)), worker(sl, float64(queue)))
	d.diff("healthy, done", "orphaned_transfers", rl["orphaned_transfers"], sl["orphaned_transfers"])
	d.compareMetrics(t, "healthy, done", real, simSide)

	// Scene 2: a stuck handle, two rooms queued behind it on its worker,
	// then the plugin's force-fail of the stuck one.
	rids := []string{"hung", "behind-1", "behind-2"}
	for _, s := range []*fieldSide{real, simSide} {
		s.admit(t, "hung", 9002, "hang")
		s.admit(t, "behind-1", 9003, "complete")
		s.admit(t, "behind-2", 9004, "complete")
	}
	// The two behind may complete at once (mid-2025 NIXL has no queue to
	// hold them): only the hung one is sure to be listed.
	waitFor(t, "the hung request listed on the simulator", 5*time.Second, func() bool { return listed(simSide, "hung") })
	time.Sleep(time.Second)
	rl, sl = real.listing(t), simSide.listing(t)
	scene := "stuck handle, two behind"
	d.compareServer(scene, rl, sl)
	d.compareRows(scene, rl, sl, rids...)
	d.diff(scene, "queues", rl["queues"], sl["queues"])
	d.diff(scene, fmt.Sprintf("transfer_workers[%d]", queue), worker(rl, float64(queue)), worker(sl, float64(queue)))
	d.diff(scene, "wedge_orders", rl["wedge_orders"], sl["wedge_orders"])
	rw, sw := worker(rl, float64(queue)), worker(sl, float64(queue))

	hungRoom := uint64(9002)
	d.forceFail(t, "force-fail of the stuck handle", real, simSide, pluginapi.ForceFailRequest{RID: "hung", BootstrapRoom: &hungRoom, Reason: "parity"})
	time.Sleep(1200 * time.Millisecond)
	rl, sl = real.listing(t), simSide.listing(t)
	scene = "after the force-fail"
	d.compareRows(scene, rl, sl, rids...)
	d.diff(scene, fmt.Sprintf("transfer_workers[%d]", queue), worker(rl, float64(queue)), worker(sl, float64(queue)))
	d.diff(scene, "orphaned_transfers", rl["orphaned_transfers"], sl["orphaned_transfers"])
	d.compareMetrics(t, scene, real, simSide)

	// Scene 3: where the release has transfer workers, a wedge order on
	// the chunk the worker holds fails the rooms queued behind it.
	if rw == nil && sw == nil {
		return
	}
	if rw == nil || sw == nil {
		return // already a difference above
	}
	// The first call stands the order; the scheduler's next passes fail
	// the rooms, which the renewal reports.
	orders := map[string]pluginapi.WedgeOrderRequest{}
	for _, s := range []*fieldSide{real, simSide} {
		f, _ := worker(s.listing(t), float64(queue))["in_flight"].(map[string]any)
		chunk, _ := f["chunk"].(float64)
		orders[s.name] = pluginapi.WedgeOrderRequest{TransferQueue: queue, Chunk: int64(chunk), TTLSeconds: 5, Reason: "parity"}
	}
	failed := map[string][]string{}
	order := func(scene string) {
		t.Helper()
		answers, statuses := map[string]any{}, map[string]int{}
		for _, s := range []*fieldSide{real, simSide} {
			status, resp, err := s.client.PostWedgeOrder(context.Background(), orders[s.name])
			if err != nil {
				t.Fatalf("%s: wedge order: %v", s.name, err)
			}
			answers[s.name], statuses[s.name] = asMap(resp), status
			failed[s.name] = nil
			for _, r := range resp.Failed {
				failed[s.name] = append(failed[s.name], r.RID)
			}
			sort.Strings(failed[s.name])
		}
		if statuses[real.name] != statuses[simSide.name] {
			d.add(scene, "HTTP status", statuses[real.name], statuses[simSide.name])
		}
		d.diff(scene, "answer", answers[real.name], answers[simSide.name])
	}
	order("wedge order")
	time.Sleep(600 * time.Millisecond)
	order("wedge order, renewed")
	if !slices.Equal(failed[real.name], []string{"behind-1", "behind-2"}) {
		t.Errorf("SGLang's own code: the wedge order failed %v, want the two rooms behind the hung chunk", failed[real.name])
	}
	time.Sleep(1200 * time.Millisecond)
	rl, sl = real.listing(t), simSide.listing(t)
	scene = "after the wedge order"
	d.compareRows(scene, rl, sl, rids...)
	d.diff(scene, fmt.Sprintf("transfer_workers[%d]", queue), worker(rl, float64(queue)), worker(sl, float64(queue)))
	d.diff(scene, "wedge_orders", rl["wedge_orders"], sl["wedge_orders"])
	d.compareMetrics(t, scene, real, simSide)
}
