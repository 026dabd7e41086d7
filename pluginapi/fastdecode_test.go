package pluginapi

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// FuzzDecodeWireFast holds the fast path to encoding/json: whatever it
// accepts, encoding/json accepts too and decodes to the same value.
func FuzzDecodeWireFast(f *testing.F) {
	f.Add(benchListingFuzzSeed())
	f.Add([]byte(`{"api_version":1,"server":{"pid":1},"loop":{"iterations":2},"inflight":[]}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Success","progress":-1}],"queues":{"waiting":3}} `))
	// Round 2: every new field, null and empty forms, and repeats that
	// encoding/json merges.
	f.Add([]byte(round2Listing))
	f.Add([]byte(`{"api_version":1,"server":{"levers":[],"transfer_queues":null,"pp_size":1},"loop":{},"inflight":[{"rid":"a","poll":"Failed","transfer_in_flight":null,"transfer_queue":null}],"orphaned_transfers":null}`))
	f.Add([]byte(`{"api_version":1,"server":{"levers":null,"lever_note":"mid-2025 NIXL"},"loop":{},"inflight":[{"rid":"a","poll":"Failed","transfer_queue":1,"transfer_queue":null}],"orphaned_transfers":[]}`))
	f.Add([]byte(`{"api_version":1,"server":{"levers":["abort"],"levers":["x","y"]},"loop":{},"inflight":[],"orphaned_transfers":[{"bootstrap_room":1,"outstanding_chunks":1}],"orphaned_transfers":[{"transfer_queue":0}]}`))
	// Round 3: decode listings, every new field in its null, empty and
	// repeated forms.
	f.Add([]byte(decodeListing))
	f.Add([]byte(`{"api_version":1,"server":{"disaggregation_mode":"decode","deferred_release":null},"loop":{},"inflight":[],"queues":{"prealloc":0,"transfer":2},"decode_requests":null}`))
	f.Add([]byte(`{"api_version":1,"server":{"deferred_release":false,"transfer_tracking":true},"loop":{},"inflight":[],"decode_requests":[]}`))
	f.Add([]byte(`{"api_version":1,"server":{"transfer_tracking":null,"transfer_tracking":false},"loop":{},"inflight":[]}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[],"decode_requests":[{"rid":"a","queue":"prealloc","poll":"Failed","chunks_expected":1,"chunks_expected":null,"transfer_started":true,"transfer_started":null}],"decode_requests":[{"rid":"b"}]}`))
	// Round 4: transfer workers, chunks queued and wedge orders, in their
	// null, empty, odd and repeated forms.
	f.Add([]byte(round4Listing))
	f.Add([]byte(`{"api_version":1,"server":{"transfer_progress":null,"transfer_progress":true},"loop":{},"inflight":[{"rid":"a","poll":"Failed","chunks_queued":null,"chunks_queued":2}],"transfer_workers":null,"wedge_orders":null}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[],"transfer_workers":[{"in_flight":null,"recent":null},{"recent":[[1,2],[1e3,0.5]],"in_flight":{"chunk":3,"chunk":4}}],"wedge_orders":[]}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[],"transfer_workers":[{"recent":[[1]]},{"recent":[[1,2,3]]}],"transfer_workers":[]}`))
	// Round 5: the other ranks' workers and queued chunks.
	f.Add([]byte(round5Listing))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Success","peer_chunks_queued":null}],"peer_transfer_workers":[{"rank":"tp1-cp0","transfer_workers":null},{"transfer_workers":[]}]}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[],"peer_transfer_workers":[{"rank":"a","transfer_workers":[{"queued_rooms":null},{"queued_rooms":[]},{"queued_rooms":[1,18446744073709551615],"queued_rooms":[2]}]}]}`))
	// KV manager threads (issue 24): null, empty, odd and repeated forms.
	f.Add([]byte(kvThreadsListing))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[],"kv_threads":null}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[],"kv_threads":[{"role":"heartbeat","function":"heartbeat_checker","alive":true,"alive":false},{"transfer_queue":null},{"transfer_queue":3,"transfer_queue":null}]}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[],"kv_threads":[],"kv_threads":[{"role":"other"}]}`))
	files, _ := filepath.Glob(filepath.Join("testdata", "*.json"))
	for _, p := range files {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var fast wireListing
		if !decodeWireFast(body, &fast) {
			return
		}
		var slow wireListing
		if err := json.Unmarshal(body, &slow); err != nil {
			t.Fatalf("fast path accepted what encoding/json rejects (%v): %q", err, body)
		}
		if !reflect.DeepEqual(fast, slow) {
			t.Fatalf("fast path decoded differently:\nfast %+v\nslow %+v\nbody %q", fast, slow, body)
		}
	})
}

func benchListingFuzzSeed() []byte {
	inFlight, queue, queues := true, 3, 4
	l := Listing{OrphanedTransfers: []OrphanedTransfer{{BootstrapRoom: 9, TransferQueue: &queue, OutstandingChunks: 2}}, APIVersion: 1, Server: Server{PID: 7, DPRank: 1, DisaggregationMode: "prefill", Levers: []string{LeverAbort}, PPSize: 2, TransferQueues: &queues}, NowUnix: 1.5,
		Loop: Loop{Iterations: 1 << 60, LastIterationUnix: 2.25}, Queues: Queues{Inflight: 2},
		Inflight: []Room{{RID: "x", BootstrapRoom: 1<<64 - 1, BootstrapAddr: "10.0.0.7:8998", Poll: PollTransferring, AgeSeconds: 3.5, PromptTokens: 9, Progress: 4,
			TransferInFlight: &inFlight, TransferQueue: &queue},
			{RID: "HEALTH_CHECK_1.0", BootstrapAddr: "2.2.2.2:8998", Poll: PollSuccess, Progress: -1, HealthCheck: true, SendFailed: false}}}
	b, _ := json.Marshal(&l)
	return b
}
