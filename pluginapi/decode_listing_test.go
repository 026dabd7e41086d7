package pluginapi

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// decodeListing is a decode plugin's listing (docs/plugin-api.md, "Round 3
// additions").
const decodeListing = `{"api_version":1,
 "server":{"pid":77,"dp_rank":0,"pp_rank":0,"tp_rank":0,"disaggregation_mode":"decode","transfer_backend":"nixl",
  "sglang_version":"0.5.23","levers":["abort"],"lever_note":"","pp_size":1,"transfer_queues":null,"deferred_release":true},
 "now_unix":1764403200.125,"loop":{"iterations":5,"last_iteration_unix":1764403200.117},
 "queues":{"bootstrap":0,"waiting":0,"inflight":0,"prealloc":1,"transfer":1},
 "inflight":[],
 "orphaned_transfers":[],
 "decode_requests":[
  {"rid":"a","bootstrap_room":18446744073709551615,"bootstrap_addr":"10.1.2.3:8998","queue":"transfer","poll":"Transferring",
   "age_seconds":212.5,"progress":3,"chunks_expected":8,"transfer_started":true,"health_check":false},
  {"rid":"b","bootstrap_room":7,"bootstrap_addr":"10.1.2.3:8998","queue":"prealloc","poll":"Bootstrapping",
   "age_seconds":1.5,"progress":-1,"chunks_expected":null,"transfer_started":null,"health_check":false}]}`

func TestDecodeListingRound3(t *testing.T) {
	l, err := DecodeListing([]byte(decodeListing))
	if err != nil {
		t.Fatal(err)
	}
	var fast wireListing
	if !decodeWireFast([]byte(decodeListing), &fast) {
		t.Fatal("the fast path refused a documented decode listing")
	}
	if l.Server.DisaggregationMode != ModeDecode || l.Server.DeferredRelease == nil || !*l.Server.DeferredRelease ||
		l.Queues.Prealloc != 1 || l.Queues.Transfer != 1 || len(l.DecodeRequests) != 2 {
		t.Fatalf("listing %+v", l)
	}
	a, b := l.DecodeRequests[0], l.DecodeRequests[1]
	if a.BootstrapRoom != 1<<64-1 || a.Queue != DecodeQueueTransfer || a.ChunksExpected == nil || *a.ChunksExpected != 8 ||
		a.TransferStarted == nil || !*a.TransferStarted || a.Progress != 3 {
		t.Fatalf("decode_requests[0] = %+v", a)
	}
	if b.TransferStarted != nil || b.ChunksExpected != nil || b.Queue != DecodeQueuePrealloc {
		t.Fatalf("decode_requests[1] = %+v, want unknown transfer_started and chunks_expected", b)
	}
	// A prefill listing (and an older decode plugin) has none.
	l, err = DecodeListing([]byte(exampleListing))
	if err != nil || l.DecodeRequests != nil {
		t.Fatalf("prefill listing: decode_requests %v, %v; want nil", l.DecodeRequests, err)
	}
}

func TestDecodeListingRound3Errors(t *testing.T) {
	base := `{"api_version":1,"server":{"disaggregation_mode":"decode"},"loop":{},"inflight":[],"decode_requests":[%s]}`
	for entry, want := range map[string]string{
		`{"poll":"Failed","queue":"transfer"}`:                                    "decode_requests[0] has no rid",
		`{"rid":"a","poll":"Done","queue":"transfer"}`:                            `decode_requests[0] (rid "a") has poll "Done"`,
		`{"rid":"a","poll":"Failed","queue":"waiting"}`:                           `decode_requests[0] (rid "a") has queue "waiting", want prealloc or transfer`,
		`{"rid":"a","poll":"Failed","queue":"transfer","age_seconds":-1}`:         `decode_requests[0] (rid "a") has age_seconds -1`,
		`{"rid":"a","poll":"Failed","queue":"transfer","progress":-2}`:            `decode_requests[0] (rid "a") has progress -2`,
		`{"rid":"a","poll":"Failed","queue":"transfer","chunks_expected":-1}`:     `decode_requests[0] (rid "a") has chunks_expected -1`,
		`{"rid":"a","poll":"Failed","queue":"transfer","transfer_started":"yes"}`: "malformed listing",
		`{"rid":"a","poll":"Failed","queue":"transfer","bootstrap_room":-1}`:      "malformed listing",
	} {
		_, err := DecodeListing([]byte(fmt.Sprintf(base, entry)))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want %q", entry, err, want)
		}
	}
}

func TestVerdictClientCachesAllButStopped(t *testing.T) {
	var hits atomic.Int64
	verdict := VerdictInQueue
	// A prefill watchdog that predates binding echoes no rid.
	bound := true
	echo := func(r *http.Request) string {
		if !bound {
			return ""
		}
		return r.URL.Query().Get(VerdictParamRID)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		// What arrives is the client's to check.
		_ = json.NewEncoder(w).Encode(RoomVerdict{Room: strings.TrimPrefix(r.URL.Path, PathRoomVerdict), RID: echo(r), Verdict: verdict})
	}))
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	now := time.Unix(1_700_000_000, 0)
	c, err := NewVerdictClient(VerdictClientOptions{URLTemplate: "http://{host}:" + u.Port(), Networks: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		Client: &http.Client{}, Timeout: time.Second, CacheTTL: 5 * time.Second, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	q9 := VerdictQuery{BootstrapAddr: "127.0.0.1:8998", Room: 9, RID: "r9", AgeSeconds: 200}
	for i := 0; i < 3; i++ {
		if v, err := c.Verdict(ctx, q9); err != nil || v.Verdict != VerdictInQueue {
			t.Fatalf("%+v, %v", v, err)
		}
	}
	if hits.Load() != 1 {
		t.Fatalf("%d requests for three lookups within the cache TTL, want 1", hits.Load())
	}
	now = now.Add(5 * time.Second)
	verdict = VerdictStopped
	for i := 0; i < 2; i++ {
		if v, err := c.Verdict(ctx, q9); err != nil || v.Verdict != VerdictStopped {
			t.Fatalf("%+v, %v", v, err)
		}
	}
	if hits.Load() != 3 {
		t.Fatalf("%d requests, want stopped asked afresh every time", hits.Load())
	}
	// A stopped that is not bound to the rid asked for is refused.
	bound = false
	if v, err := c.Verdict(ctx, q9); err == nil || !strings.Contains(err.Error(), "not bound to this request") {
		t.Fatalf("unbound stopped: %+v, %v; want a refusal", v, err)
	}
	bound = true
	// An unknown verdict is refused.
	verdict = "maybe"
	if _, err := c.Verdict(ctx, VerdictQuery{BootstrapAddr: "127.0.0.1:8998", Room: 10, RID: "r9", AgeSeconds: 200}); err == nil {
		t.Fatal("accepted an unknown verdict")
	}
}

func TestVerdictClientTemplate(t *testing.T) {
	nets := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}
	for _, bad := range []string{"http://127.0.0.1:9433", "http://{host}.example:9433", "ftp://{host}:9433", "http://u@{host}:9433", "http://{host}:9433/?q={host}"} {
		if _, err := NewVerdictClient(VerdictClientOptions{URLTemplate: bad, Networks: nets, Client: &http.Client{}}); err == nil {
			t.Errorf("template %q accepted", bad)
		}
	}
	c, err := NewVerdictClient(VerdictClientOptions{URLTemplate: "https://{host}:9433", Networks: nets, Client: &http.Client{}})
	if err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[string]string{"10.1.2.3:8998": "https://10.1.2.3:9433", "[fd00::7]:8998": "https://[fd00::7]:9433", "[::ffff:10.0.0.1]:1": "https://10.0.0.1:9433"} {
		if got, _, err := c.BaseURL(addr); err != nil || got != want {
			t.Errorf("%s: %q, %v; want %q", addr, got, err, want)
		}
	}
	for _, addr := range []string{"192.168.0.1:8998", "prefill-0:8998", "[fe80::1%eth0]:8998", "10.1.2.3"} {
		if _, _, err := c.BaseURL(addr); err == nil {
			t.Errorf("%s accepted", addr)
		}
	}
}

// waiting_for_memory (issue 18) reaches the watchdog on both decode paths.
func TestDecodeListingWaitingForMemory(t *testing.T) {
	body := strings.Replace(decodeListing, `"poll":"Bootstrapping",`, `"poll":"WaitingForInput",`, 1)
	body = strings.Replace(body, `"transfer_started":null,"health_check":false}`, `"transfer_started":false,"health_check":false,"waiting_for_memory":true}`, 1)
	l, err := DecodeListing([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	var fast wireListing
	if !decodeWireFast([]byte(body), &fast) {
		t.Fatal("the fast path refused waiting_for_memory")
	}
	if !l.DecodeRequests[1].WaitingForMemory || l.DecodeRequests[0].WaitingForMemory || !fast.DecodeRequests[1].WaitingForMemory {
		t.Fatalf("decode_requests %+v (fast %+v), want only the prealloc request waiting for memory", l.DecodeRequests, fast.DecodeRequests)
	}
}
