package pluginapi

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// prefill_rank_addrs reaches the watchdog on both decode paths, and an
// older plugin's listing without it still decodes.
func TestDecodeListingPrefillRankAddrs(t *testing.T) {
	body := strings.Replace(decodeListing, `"transfer_started":true,"health_check":false}`,
		`"transfer_started":true,"health_check":false,"prefill_rank_addrs":["10.1.2.4:40001","10.1.2.4:40002"]}`, 1)
	if body == decodeListing {
		t.Fatal("the listing fixture changed")
	}
	var fast wireListing
	if !decodeWireFast([]byte(body), &fast) {
		t.Fatal("the fast path refused prefill_rank_addrs")
	}
	l, err := DecodeListing([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.1.2.4:40001", "10.1.2.4:40002"}
	for name, got := range map[string][]string{"listing": l.DecodeRequests[0].PrefillRankAddrs, "fast path": fast.DecodeRequests[0].PrefillRankAddrs} {
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: prefill_rank_addrs %v, want %v", name, got, want)
		}
	}
	if got := l.DecodeRequests[1].PrefillRankAddrs; got != nil {
		t.Errorf("absent prefill_rank_addrs decoded as %v", got)
	}
}

func TestDecodeListingPrefillRankAddrsErrors(t *testing.T) {
	base := `{"api_version":1,"server":{"disaggregation_mode":"decode"},"loop":{},"inflight":[],"decode_requests":[{"rid":"a","poll":"Failed","queue":"transfer","prefill_rank_addrs":%s}]}`
	many := make([]string, MaxPrefillRankAddrs+1)
	for i := range many {
		many[i] = fmt.Sprintf("%q", "10.0.0.1:1")
	}
	for addrs, want := range map[string]string{
		`["10.0.0.1"]`:                      `prefill_rank_addrs entry "10.0.0.1", want host:port`,
		`["10.0.0.1:"]`:                     `prefill_rank_addrs entry "10.0.0.1:"`,
		`[""]`:                              `prefill_rank_addrs entry ""`,
		`[7]`:                               "malformed listing",
		"[" + strings.Join(many, ",") + "]": "257 prefill_rank_addrs, want at most 256",
	} {
		_, err := DecodeListing([]byte(fmt.Sprintf(base, addrs)))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%.40s: error %v, want %q", addrs, err, want)
		}
	}
}

// verdictServers serves a prefill watchdog on each loopback host with the
// verdict of that host, on one port, as the watchdogs of a prefill
// instance's nodes are.
func verdictServers(t *testing.T, verdicts map[string]RoomVerdict) (port string, asked func() map[string]int) {
	t.Helper()
	var mu sync.Mutex
	counts := map[string]int{}
	asked = func() map[string]int {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(counts)
	}
	first, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ = net.SplitHostPort(first.Addr().String())
	for host, v := range verdicts {
		ln := first
		if host != "127.0.0.1" {
			if ln, err = net.Listen("tcp", net.JoinHostPort(host, port)); err != nil {
				t.Skipf("cannot listen on %s: %v", host, err)
			}
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			counts[host]++
			mu.Unlock()
			v := v
			v.Room = strings.TrimPrefix(r.URL.Path, PathRoomVerdict)
			if v.Verdict == VerdictStopped {
				v.RID = r.URL.Query().Get(VerdictParamRID)
			}
			_ = json.NewEncoder(w).Encode(v)
		})}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
	}
	if _, ok := verdicts["127.0.0.1"]; !ok {
		first.Close()
	}
	return port, asked
}

func TestVerdictAsksEveryPrefillRankHost(t *testing.T) {
	for _, c := range []struct {
		name     string
		verdicts map[string]RoomVerdict
		addrs    []string
		want     string
		wantAgo  float64
	}{
		{"the node that watches the room outvotes a worker node's unknown",
			map[string]RoomVerdict{"127.0.0.2": {Verdict: VerdictUnknown}, "127.0.0.3": {Verdict: VerdictStopped, ReleasedSecondsAgo: 9}},
			[]string{"127.0.0.2:1", "127.0.0.3:1", "127.0.0.3:2"}, VerdictStopped, 9},
		{"a stage still holding the room holds the request",
			map[string]RoomVerdict{"127.0.0.2": {Verdict: VerdictInQueue}, "127.0.0.3": {Verdict: VerdictStopped, ReleasedSecondsAgo: 9}},
			[]string{"127.0.0.3:1", "127.0.0.2:1"}, VerdictInQueue, 0},
		{"live wins", map[string]RoomVerdict{"127.0.0.2": {Verdict: VerdictLive}, "127.0.0.3": {Verdict: VerdictInQueue}},
			[]string{"127.0.0.2:1", "127.0.0.3:1"}, VerdictLive, 0},
		{"of two releases the later", map[string]RoomVerdict{"127.0.0.2": {Verdict: VerdictStopped, ReleasedSecondsAgo: 2}, "127.0.0.3": {Verdict: VerdictStopped, ReleasedSecondsAgo: 9}},
			[]string{"127.0.0.3:1", "127.0.0.2:1"}, VerdictStopped, 2},
		{"without prefill_rank_addrs the bootstrap host", map[string]RoomVerdict{"127.0.0.4": {Verdict: VerdictLive}},
			nil, VerdictLive, 0},
	} {
		port, asked := verdictServers(t, c.verdicts)
		client, err := NewVerdictClient(VerdictClientOptions{URLTemplate: "http://{host}:" + port, Networks: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
			Client: &http.Client{}, Timeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		v, err := client.Verdict(context.Background(), VerdictQuery{BootstrapAddr: "127.0.0.4:8998", PrefillRankAddrs: c.addrs, Room: 5, RID: "r", AgeSeconds: 100})
		if err != nil || v.Verdict != c.want || v.ReleasedSecondsAgo != c.wantAgo {
			t.Errorf("%s: %+v, %v; want %s %vs ago", c.name, v, err, c.want, c.wantAgo)
		}
		for host, n := range asked() {
			if n != 1 {
				t.Errorf("%s: %s asked %d times, want once", c.name, host, n)
			}
		}
		if len(asked()) != len(c.verdicts) {
			t.Errorf("%s: asked %v, want every host of %v", c.name, asked(), c.verdicts)
		}
	}
}

func TestVerdictPrefillRankOutsideNetworksNotAsked(t *testing.T) {
	port, asked := verdictServers(t, map[string]RoomVerdict{"127.0.0.2": {Verdict: VerdictStopped}})
	client, err := NewVerdictClient(VerdictClientOptions{URLTemplate: "http://{host}:" + port, Networks: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")},
		Client: &http.Client{}, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	_, err = client.Verdict(context.Background(), VerdictQuery{BootstrapAddr: "127.0.0.2:8998", PrefillRankAddrs: []string{"127.0.0.2:1", "10.9.9.9:1"}, Room: 5, RID: "r"})
	if err == nil || !strings.Contains(err.Error(), "outside the allowed prefill networks") {
		t.Fatalf("error %v, want the address outside the networks refused", err)
	}
	if n := asked(); len(n) != 0 {
		t.Fatalf("asked %v before refusing", n)
	}
}
