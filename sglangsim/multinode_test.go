package sglangsim

import (
	"io"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"
)

// Decode names every PP stage of the request's prefill DP rank on its
// node: RankHosts', or without them the bootstrap host's, as SGLang's
// receiver gets them from a one-node instance's bootstrap server.
func TestDecodeListsPrefillRankAddrs(t *testing.T) {
	for _, hosts := range [][]string{nil, {"127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"}} {
		s, c := newSim(t, Options{DPSize: 2, PPSize: 2, RankHosts: hosts})
		rid, _ := s.Submit(RequestSpec{Rank: s.RankIndex(1, 0), Behavior: BehaviorHealthy, Transfer: time.Hour})
		run(s, c, time.Second, 100*time.Millisecond)
		var got []string
		found := false
		for _, r := range s.DecodeListing(0).DecodeRequests {
			if r.RID == rid {
				got, found = r.PrefillRankAddrs, true
			}
		}
		if !found {
			t.Fatalf("%v: request %s not listed on decode", hosts, rid)
		}
		want := []string{"10.0.0.7:40002", "10.0.0.7:40003"}
		if hosts != nil {
			want = []string{"127.0.0.2:40002", "127.0.0.2:40003"}
		}
		if !slices.Equal(got, want) {
			t.Errorf("RankHosts %v: prefill_rank_addrs %v, want %v", hosts, got, want)
		}
	}
	if _, err := New(Options{Clock: nil, DPSize: 2, RankHosts: []string{"127.0.0.1"}}); err == nil {
		t.Error("one host for two ranks accepted")
	}
}

// A node's /metrics has the scheduler series of its own ranks only.
func TestNodeMetricsHasOnlyItsRanks(t *testing.T) {
	s, _ := newSim(t, Options{DPSize: 4, Era: EraNewest})
	srv := httptest.NewServer(s.NodeMetricsHandler([]int{2, 3}))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	text := string(body)
	for _, dp := range []string{"2", "3"} {
		if !strings.Contains(text, `dp_rank="`+dp+`"`) {
			t.Errorf("dp_rank %s missing from its node's /metrics", dp)
		}
	}
	for _, dp := range []string{"0", "1"} {
		if strings.Contains(text, `dp_rank="`+dp+`"`) {
			t.Errorf("dp_rank %s of another node on this node's /metrics", dp)
		}
	}
}
