package pluginapi

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
)

// round4Listing is a prefill plugin's listing with transfer progress
// (docs/plugin-api.md, "Round 4 additions").
const round4Listing = `{"api_version":1,
 "server":{"pid":9,"dp_rank":0,"pp_rank":0,"tp_rank":0,"disaggregation_mode":"prefill","transfer_backend":"nixl",
  "sglang_version":"0.5.18","levers":["abort"],"pp_size":1,"transfer_queues":2,"transfer_tracking":true,"transfer_progress":true},
 "now_unix":1764403200.5,"loop":{"iterations":40,"last_iteration_unix":1764403200.4},
 "queues":{"bootstrap":0,"waiting":0,"inflight":2},
 "inflight":[
  {"rid":"a","bootstrap_room":41,"bootstrap_addr":"10.0.0.7:8998","poll":"Transferring","age_seconds":95.5,"prompt_tokens":9000,
   "progress":3,"send_failed":false,"health_check":false,"transfer_in_flight":true,"transfer_queue":1,"chunks_queued":0},
  {"rid":"b","bootstrap_room":43,"bootstrap_addr":"10.0.0.7:8998","poll":"Transferring","age_seconds":1.5,"prompt_tokens":20,
   "progress":1,"send_failed":false,"health_check":false,"transfer_in_flight":false,"transfer_queue":1,"chunks_queued":1}],
 "orphaned_transfers":[],
 "transfer_workers":[
  {"transfer_queue":0,"tracked":true,"depth":0,"chunks_taken":12,"in_flight":null,"recent":[[64,0.5],[8,0.0625]]},
  {"transfer_queue":1,"tracked":true,"depth":1,"chunks_taken":41,
   "in_flight":{"chunk":41,"bootstrap_room":41,"pages":64,"last_chunk":true,"seconds":95.25},"recent":[]}],
 "wedge_orders":[{"transfer_queue":1,"chunk":41,"expires_in_seconds":8.5,"rooms_failed":3}]}`

func TestDecodeListingRound4(t *testing.T) {
	var fast wireListing
	if !decodeWireFast([]byte(round4Listing), &fast) {
		t.Fatal("the fast path refused a documented round-4 listing")
	}
	var slow wireListing
	if err := json.Unmarshal([]byte(round4Listing), &slow); err != nil || !reflect.DeepEqual(fast, slow) {
		t.Fatalf("fast path differs from encoding/json (%v):\nfast %+v\nslow %+v", err, fast, slow)
	}
	l, err := DecodeListing([]byte(round4Listing))
	if err != nil {
		t.Fatal(err)
	}
	if p := l.Server.TransferProgress; p == nil || !*p {
		t.Fatalf("transfer_progress = %v", p)
	}
	if q := l.Inflight[1].ChunksQueued; q == nil || *q != 1 {
		t.Fatalf("chunks_queued = %v", q)
	}
	if len(l.TransferWorkers) != 2 || l.TransferWorkers[0].InFlight != nil || len(l.TransferWorkers[0].Recent) != 2 ||
		l.TransferWorkers[0].Recent[1] != [2]float64{8, 0.0625} || l.TransferWorkers[1].Recent == nil {
		t.Fatalf("transfer_workers = %+v", l.TransferWorkers)
	}
	if c := l.TransferWorkers[1].InFlight; c == nil || *c != (ChunkInFlight{Chunk: 41, BootstrapRoom: 41, Pages: 64, LastChunk: true, Seconds: 95.25}) {
		t.Fatalf("in_flight = %+v", c)
	}
	if len(l.WedgeOrders) != 1 || l.WedgeOrders[0] != (WedgeOrderState{TransferQueue: 1, Chunk: 41, ExpiresInSeconds: 8.5, RoomsFailed: 3}) {
		t.Fatalf("wedge_orders = %+v", l.WedgeOrders)
	}
	// Older plugins: every round-4 field absent is unknown.
	l, err = DecodeListing([]byte(exampleListing))
	if err != nil || l.Server.TransferProgress != nil || l.TransferWorkers != nil || l.WedgeOrders != nil || l.Inflight[0].ChunksQueued != nil {
		t.Fatalf("older listing decoded round-4 fields as known: %+v, %v", l, err)
	}
}

// Bodies encoding/json would decode in its own way (merging repeats,
// zero-filling short pairs) stay off the fast path.
func TestFastPathLeavesRound4OddFormsToEncodingJSON(t *testing.T) {
	for _, body := range []string{
		`{"api_version":1,"server":{},"loop":{},"inflight":[],"transfer_workers":[{"in_flight":{"chunk":1,"pages":2},"in_flight":{"chunk":3}}]}`,
		`{"api_version":1,"server":{},"loop":{},"inflight":[],"transfer_workers":[{"recent":[[1,2]],"recent":[[3,4]]}]}`,
		`{"api_version":1,"server":{},"loop":{},"inflight":[],"transfer_workers":[{"recent":[[1]]}]}`,
		`{"api_version":1,"server":{},"loop":{},"inflight":[],"transfer_workers":[{"recent":[[1,2,3]]}]}`,
		`{"api_version":1,"server":{},"loop":{},"inflight":[],"transfer_workers":[{"recent":[null]}]}`,
		`{"api_version":1,"server":{},"loop":{},"inflight":[],"wedge_orders":[],"wedge_orders":[{"chunk":1}]}`,
	} {
		var fast wireListing
		if decodeWireFast([]byte(body), &fast) {
			t.Errorf("fast path accepted %s", body)
		}
	}
}

func TestDecodeRound4ErrorsNameTheField(t *testing.T) {
	const head = `{"api_version":1,"server":{"transfer_queues":2},"loop":{},`
	for _, tc := range []struct{ body, want string }{
		{head + `"inflight":[{"rid":"a","poll":"Failed","chunks_queued":-1}]}`, `inflight[0] (rid "a") has chunks_queued -1`},
		{head + `"inflight":[],"transfer_workers":[{"transfer_queue":2}]}`, "transfer_workers[0] has transfer_queue 2, but server.transfer_queues is 2"},
		{head + `"inflight":[],"transfer_workers":[{"transfer_queue":1,"depth":-1}]}`, "transfer_workers[0] (queue 1) has depth -1"},
		{head + `"inflight":[],"transfer_workers":[{"chunks_taken":-3}]}`, "chunks_taken -3"},
		{head + `"inflight":[],"transfer_workers":[{"in_flight":{"chunk":1,"pages":-1}}]}`, "in_flight.pages -1"},
		{head + `"inflight":[],"transfer_workers":[{"in_flight":{"chunk":1,"seconds":-0.5}}]}`, "in_flight.seconds -0.5"},
		{head + `"inflight":[],"transfer_workers":[{"in_flight":{"chunk":-1}}]}`, "in_flight.chunk -1"},
		{head + `"inflight":[],"transfer_workers":[{"recent":[[1,2],[3,-1]]}]}`, "recent[1]"},
		{head + `"inflight":[],"transfer_workers":{}}`, "transfer_workers"},
		{head + `"inflight":[],"wedge_orders":[{"transfer_queue":-1}]}`, "wedge_orders[0] has transfer_queue -1"},
	} {
		_, err := DecodeListing([]byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to mention %q", tc.body, err, tc.want)
		}
	}
}

func TestClientPostWedgeOrder(t *testing.T) {
	var got WedgeOrderRequest
	var gotAuth string
	mux := http.NewServeMux()
	mux.HandleFunc(PathWedgeOrder, func(w http.ResponseWriter, r *http.Request) {
		gotAuth = r.Header.Get("Authorization")
		got = WedgeOrderRequest{}
		if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		switch {
		case got.Chunk != 41:
			w.WriteHeader(http.StatusConflict)
			_ = json.NewEncoder(w).Encode(WedgeOrderResponse{Result: ResultWedgeCleared, Failed: []FailedRoom{}})
		case got.DryRun:
			_ = json.NewEncoder(w).Encode(WedgeOrderResponse{Result: ResultWouldOrder, Failed: []FailedRoom{{RID: "b", BootstrapRoom: 43}}})
		default:
			_ = json.NewEncoder(w).Encode(WedgeOrderResponse{Result: ResultOrdered, ExpiresInSeconds: got.TTLSeconds,
				Failed: []FailedRoom{{RID: "b", BootstrapRoom: 43, Levers: []string{LeverAbort}}}})
		}
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	c := NewClient(srv.URL, ClientOptions{Token: "t0k"})
	order := WedgeOrderRequest{TransferQueue: 1, Chunk: 41, TTLSeconds: 10, MinAgeSeconds: 2, Reason: "chunk 41 overdue"}
	status, resp, err := c.PostWedgeOrder(context.Background(), order)
	if err != nil || status != http.StatusOK || resp.Result != ResultOrdered || resp.ExpiresInSeconds != 10 || len(resp.Failed) != 1 ||
		resp.Failed[0].Levers[0] != LeverAbort || got != order || gotAuth != "Bearer t0k" {
		t.Fatalf("PostWedgeOrder = %d, %+v, %v (server saw %+v, auth %q)", status, resp, err, got, gotAuth)
	}
	order.DryRun = true
	if status, resp, err = c.PostWedgeOrder(context.Background(), order); err != nil || status != http.StatusOK || resp.Result != ResultWouldOrder || !got.DryRun {
		t.Fatalf("dry run = %d, %+v, %v", status, resp, err)
	}
	order.Chunk = 42
	if status, resp, err = c.PostWedgeOrder(context.Background(), order); err != nil || status != http.StatusConflict || resp.Result != ResultWedgeCleared {
		t.Fatalf("cleared = %d, %+v, %v", status, resp, err)
	}
	// An older plugin has no such path: an error, with the status.
	if status, _, err = NewClient(srv.URL+"/old", ClientOptions{}).PostWedgeOrder(context.Background(), order); err == nil || status != http.StatusNotFound {
		t.Fatalf("older plugin = %d, %v", status, err)
	}
}
