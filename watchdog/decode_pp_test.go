package watchdog

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// ppDecodeGroup is the decode PP stages of one DP rank as SGLang's PP
// decode loop runs them (managers/scheduler_pp_mixin.py, v0.5.10 to
// v0.5.18, sglang_plugin/conformance_tests/test_decode_pp.py): a flipped
// request stays listed, Failed, on its stage until every stage holding it
// is Failed; then stage 0's Failed branch releases it and counts it once,
// and the later stages, which process_decode_transfer_queue never passes a
// failed rid to, keep it listed, Failed.
type ppDecodeGroup struct {
	mu      sync.Mutex
	stages  []*ppDecodeStage
	flipped map[string]map[int]bool
	metrics *fakeMetrics
}

type ppDecodeStage struct {
	*fakeDecode
	group *ppDecodeGroup
	pp    int
}

func newPPDecodeGroup(dp, pp int, m *fakeMetrics) *ppDecodeGroup {
	g := &ppDecodeGroup{flipped: map[string]map[int]bool{}, metrics: m}
	for i := 0; i < pp; i++ {
		d := newFakeDecode(fmt.Sprintf("http://127.0.0.1:%d", 30200+dp*pp+i), dp)
		d.server.PPRank, d.server.PPSize, d.server.PID = i, pp, 200+i
		g.stages = append(g.stages, &ppDecodeStage{fakeDecode: d, group: g, pp: i})
	}
	return g
}

func (s *ppDecodeStage) ForceFail(ctx context.Context, req pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
	var before *pluginapi.DecodeRequest
	s.mu.Lock()
	for _, r := range s.reqs {
		if r.RID == req.RID {
			r := r
			before = &r
		}
	}
	s.mu.Unlock()
	status, resp, err := s.fakeDecode.ForceFail(ctx, req)
	if status != http.StatusOK || resp.Result != pluginapi.ResultFlipped || before == nil {
		return status, resp, err
	}
	g := s.group
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.flipped[req.RID] == nil {
		g.flipped[req.RID] = map[int]bool{}
	}
	g.flipped[req.RID][s.pp] = true
	failed := *before
	failed.Poll = pluginapi.PollFailed
	s.mu.Lock()
	s.reqs = append(s.reqs, failed) // latched Failed, held by the stages' consensus
	s.mu.Unlock()
	for _, o := range g.stages {
		if o.holds(req.RID) && !g.flipped[req.RID][o.pp] {
			return status, resp, err
		}
	}
	g.stages[0].drop(req.RID)
	if g.metrics != nil {
		g.metrics.addProgress(familyOf(before), 1)
	}
	return status, resp, err
}

func familyOf(r *pluginapi.DecodeRequest) string {
	if r.Queue == pluginapi.DecodeQueuePrealloc {
		return BootstrapFailedFamily
	}
	return TransferFailedFamily
}

func (s *ppDecodeStage) holds(rid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.reqs {
		if r.RID == rid {
			return true
		}
	}
	return false
}

func (s *ppDecodeStage) drop(rid string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	kept := s.reqs[:0]
	for _, r := range s.reqs {
		if r.RID != rid {
			kept = append(kept, r)
		}
	}
	s.reqs = kept
}

type ppDecodeHarness struct {
	*decodeHarness
	group *ppDecodeGroup
}

// newPPDecodeHarness watches the stages of one PP decode DP rank whose
// pp ranks are in watched.
func newPPDecodeHarness(t *testing.T, pp int, watched []int, mutate func(*Config)) *ppDecodeHarness {
	m := &fakeMetrics{}
	g := newPPDecodeGroup(0, pp, m)
	h := newDecodeHarness(t, nil, nil, func(c *Config) {
		c.Metrics = m
		for _, i := range watched {
			c.Plugins = append(c.Plugins, g.stages[i])
		}
		if mutate != nil {
			mutate(c)
		}
	})
	h.metrics = m
	h.metrics.addProgress(TransferFailedFamily, 0)
	h.metrics.addProgress(BootstrapFailedFamily, 0)
	h.wd.ScrapeMetrics(context.Background())
	return &ppDecodeHarness{decodeHarness: h, group: g}
}

func (h *ppDecodeHarness) tick(n int) {
	for i := 0; i < n; i++ {
		for _, s := range h.group.stages {
			s.age(time.Second)
		}
		h.decodeHarness.tick(1)
	}
}

func (h *ppDecodeHarness) calls() []int {
	out := make([]int, len(h.group.stages))
	for i, s := range h.group.stages {
		out[i] = len(s.orders())
	}
	return out
}

// stuckDecode is a transfer-queue request past the decode deadline whose
// transfer never started: releasable without asking prefill.
func stuckDecode(rid string, room uint64) pluginapi.DecodeRequest {
	return dreq(rid, room, pluginapi.DecodeQueueTransfer, pluginapi.PollWaitingForInput, 170, boolp(false))
}

func TestDecodePPReleasesOnEveryStageOrNone(t *testing.T) {
	for _, tc := range []struct {
		name    string
		watched []int
		// holding: the stages whose listing holds the request.
		holding []int
		// wantCalls per stage (stage 0, stage 1).
		wantCalls []int
		wantSkip  string
	}{
		{name: "both stages watched and holding", watched: []int{0, 1}, holding: []int{0, 1}, wantCalls: []int{1, 1}},
		{name: "stage 1 not watched", watched: []int{0}, holding: []int{0, 1}, wantCalls: []int{0, 0}, wantSkip: SkipSourceDown},
		{name: "stage 1 does not list it", watched: []int{0, 1}, holding: []int{0}, wantCalls: []int{0, 0}, wantSkip: SkipSourceDown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newPPDecodeHarness(t, 2, tc.watched, nil)
			for _, i := range tc.holding {
				h.group.stages[i].set(stuckDecode("a", 11))
			}
			h.tick(decisionTick)
			if got := h.calls(); fmt.Sprint(got) != fmt.Sprint(tc.wantCalls) {
				t.Fatalf("calls per stage %v, want %v", got, tc.wantCalls)
			}
			if tc.wantSkip != "" && h.skips(tc.wantSkip) != 1 {
				t.Fatalf("skips %v, want one %s", h.wd.Snapshot().RoleSkips, tc.wantSkip)
			}
			if tc.wantSkip == "" {
				if h.group.stages[0].holds("a") || !h.group.stages[1].holds("a") {
					t.Fatal("the fake did not release it as SGLang does: from stage 0 only")
				}
				h.rise(TransferFailedFamily, 0)
				h.tick(int(time.Minute / time.Second))
				// One request, one call per stage, one slot, one outcome:
				// unconfirmed, since SGLang keeps it on stage 1 for good.
				if got := h.calls(); got[0] != 1 || got[1] != 1 {
					t.Fatalf("calls per stage %v after the confirm timeout, want no second call", got)
				}
				if r, u := h.forceFails(ResultReleased), h.forceFails(ResultUnconfirmed); r != 0 || u != 1 {
					t.Fatalf("released %d, unconfirmed %d; want one unconfirmed release for the request", r, u)
				}
				if n := len(h.wd.callTimes[budgetDecode]); n != 1 {
					t.Fatalf("%d decode budget slots taken, want one for the request", n)
				}
			}
		})
	}
}

func TestDecodePPRequestLeavingAStageBeforeTheCallIsNotCalledOnTheOthers(t *testing.T) {
	h := newPPDecodeHarness(t, 2, []int{0, 1}, nil)
	for _, s := range h.group.stages {
		s.set(stuckDecode("a", 11))
	}
	h.tick(decisionTick - 1)
	reads := 0
	h.group.stages[1].beforeRead = func(int) {
		// The cycle's listing, then the re-read right before the call.
		if reads++; reads == 2 {
			h.group.stages[1].drop("a")
		}
	}
	h.tick(1)
	if got := h.calls(); got[0] != 0 || got[1] != 0 {
		t.Fatalf("calls per stage %v: called on stage 0 alone after stage 1 let it go", got)
	}
	if h.skips(SkipProgressed) != 1 {
		t.Fatalf("skips %v, want one progressed", h.wd.Snapshot().RoleSkips)
	}
}

// decisionTick is the cycle on which a stuckDecode request listed from the
// first cycle is decided: the stall window after its first sight.
const decisionTick = 31
