package pluginapi

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// round5Listing is a TP2 leader's listing: rank 1 holds a chunk of room 41,
// whose leader share is sent, and has a chunk of room 43 queued
// (docs/plugin-api.md, "Round 5 additions").
const round5Listing = `{"api_version":1,
 "server":{"pid":9,"dp_rank":0,"pp_rank":0,"tp_rank":0,"disaggregation_mode":"prefill","transfer_backend":"nixl",
  "sglang_version":"0.5.18","levers":["abort"],"pp_size":1,"transfer_queues":2,"transfer_tracking":true,"transfer_progress":true,
  "transfer_ranks":2,"transfer_ranks_watched":2},
 "now_unix":1764403200.5,"loop":{"iterations":40,"last_iteration_unix":1764403200.4},
 "queues":{"bootstrap":0,"waiting":0,"inflight":2},
 "inflight":[
  {"rid":"a","bootstrap_room":41,"bootstrap_addr":"10.0.0.7:8998","poll":"Success","age_seconds":95.5,"prompt_tokens":9000,
   "progress":3,"send_failed":false,"health_check":false,"transfer_in_flight":true,"transfer_queue":1,"chunks_queued":0,"peer_chunks_queued":0},
  {"rid":"b","bootstrap_room":43,"bootstrap_addr":"10.0.0.7:8998","poll":"Success","age_seconds":1.5,"prompt_tokens":20,
   "progress":1,"send_failed":false,"health_check":false,"transfer_in_flight":false,"transfer_queue":1,"chunks_queued":0,"peer_chunks_queued":1}],
 "orphaned_transfers":[],
 "transfer_workers":[
  {"transfer_queue":0,"tracked":true,"depth":0,"chunks_taken":12,"in_flight":null,"recent":[]},
  {"transfer_queue":1,"tracked":true,"depth":0,"chunks_taken":41,"in_flight":null,"recent":[[64,0.5]]}],
 "peer_transfer_workers":[{"rank":"tp1-cp0","transfer_workers":[
  {"transfer_queue":0,"tracked":true,"depth":0,"chunks_taken":3,"in_flight":null,"recent":[]},
  {"transfer_queue":1,"tracked":true,"depth":1,"chunks_taken":40,
   "in_flight":{"chunk":40,"bootstrap_room":41,"pages":64,"last_chunk":true,"seconds":95.25},"recent":[[64,0.5]],"queued_rooms":[43]}]}],
 "wedge_orders":[]}`

func TestDecodeListingRound5(t *testing.T) {
	var fast wireListing
	if !decodeWireFast([]byte(round5Listing), &fast) {
		t.Fatal("the fast path refused a documented round-5 listing")
	}
	var slow wireListing
	if err := json.Unmarshal([]byte(round5Listing), &slow); err != nil || !reflect.DeepEqual(fast, slow) {
		t.Fatalf("fast path differs from encoding/json (%v):\nfast %+v\nslow %+v", err, fast, slow)
	}
	l, err := DecodeListing([]byte(round5Listing))
	if err != nil {
		t.Fatal(err)
	}
	if q := l.Inflight[1].PeerChunksQueued; q == nil || *q != 1 {
		t.Fatalf("peer_chunks_queued = %v", q)
	}
	if len(l.PeerTransferWorkers) != 1 || l.PeerTransferWorkers[0].Rank != "tp1-cp0" || len(l.PeerTransferWorkers[0].TransferWorkers) != 2 {
		t.Fatalf("peer_transfer_workers = %+v", l.PeerTransferWorkers)
	}
	if c := l.PeerTransferWorkers[0].TransferWorkers[1].InFlight; c == nil || c.BootstrapRoom != 41 || c.Seconds != 95.25 {
		t.Fatalf("rank 1's chunk in flight = %+v", c)
	}
	if q := l.PeerTransferWorkers[0].TransferWorkers[1].QueuedRooms; !reflect.DeepEqual(q, []uint64{43}) {
		t.Fatalf("rank 1's queued rooms = %v, want [43]", q)
	}
	l, err = DecodeListing([]byte(round4Listing))
	if err != nil || l.PeerTransferWorkers != nil || l.Inflight[0].PeerChunksQueued != nil {
		t.Fatalf("a round-4 listing decoded round-5 fields as known: %+v, %v", l, err)
	}
}

func TestDecodeRound5ErrorsNameTheField(t *testing.T) {
	for _, tc := range []struct{ from, to, want string }{
		{`"peer_chunks_queued":1`, `"peer_chunks_queued":-1`, "inflight[1] (rid \"b\") has peer_chunks_queued -1"},
		{`"rank":"tp1-cp0"`, `"rank":""`, `peer_transfer_workers[0] has rank ""`},
		{`"chunk":40,"bootstrap_room":41,"pages":64,"last_chunk":true,"seconds":95.25`,
			`"chunk":40,"bootstrap_room":41,"pages":64,"last_chunk":true,"seconds":-1`, "peer_transfer_workers[0] (rank tp1-cp0) transfer_workers[1]"},
		{`{"transfer_queue":0,"tracked":true,"depth":0,"chunks_taken":3`, `{"transfer_queue":5,"tracked":true,"depth":0,"chunks_taken":3`,
			"peer_transfer_workers[0] (rank tp1-cp0) transfer_workers[0]"},
	} {
		body := strings.Replace(round5Listing, tc.from, tc.to, 1)
		if body == round5Listing {
			t.Fatalf("the case %q changed nothing", tc.from)
		}
		_, err := DecodeListing([]byte(body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one naming %q", tc.to, err, tc.want)
		}
	}
	twice := strings.Replace(round5Listing, `"transfer_workers":[
  {"transfer_queue":0,"tracked":true,"depth":0,"chunks_taken":3`, `"transfer_workers":[]},{"rank":"tp1-cp0","transfer_workers":[
  {"transfer_queue":0,"tracked":true,"depth":0,"chunks_taken":3`, 1)
	if _, err := DecodeListing([]byte(twice)); err == nil || !strings.Contains(err.Error(), `peer_transfer_workers[1] has rank "tp1-cp0"`) {
		t.Errorf("a rank listed twice: error %v", err)
	}
}
