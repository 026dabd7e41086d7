package pluginapi

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// kvThreadsListing is a prefill listing whose transfer worker of queue 1
// died (issue 24): its room waits with a chunk queued and nothing in
// flight.
const kvThreadsListing = `{"api_version":1,
 "server":{"pid":9,"dp_rank":0,"pp_rank":0,"tp_rank":0,"disaggregation_mode":"prefill","transfer_backend":"mooncake",
  "sglang_version":"0.5.18","levers":["abort"],"pp_size":1,"transfer_queues":2,"transfer_tracking":true,"transfer_progress":true},
 "now_unix":1764403200.5,"loop":{"iterations":40,"last_iteration_unix":1764403200.4},
 "queues":{"bootstrap":0,"waiting":0,"inflight":1},
 "inflight":[
  {"rid":"a","bootstrap_room":41,"bootstrap_addr":"10.0.0.7:8998","poll":"WaitingForInput","age_seconds":95.5,"prompt_tokens":9000,
   "progress":3,"send_failed":false,"health_check":false,"transfer_in_flight":false,"transfer_queue":1,"chunks_queued":2}],
 "orphaned_transfers":[],
 "transfer_workers":[
  {"transfer_queue":0,"tracked":true,"depth":0,"chunks_taken":12,"in_flight":null,"recent":[]},
  {"transfer_queue":1,"tracked":true,"depth":2,"chunks_taken":41,"in_flight":null,"recent":[[64,0.5]]}],
 "wedge_orders":[],
 "kv_threads":[
  {"role":"bootstrap","function":"bootstrap_thread","alive":true},
  {"role":"transfer_worker","function":"transfer_worker","transfer_queue":0,"alive":true},
  {"role":"transfer_worker","function":"transfer_worker","transfer_queue":1,"alive":false},
  {"role":"other","function":"_failed_session_probe_loop","alive":true}]}`

func TestDecodeListingKVThreads(t *testing.T) {
	var fast wireListing
	if !decodeWireFast([]byte(kvThreadsListing), &fast) {
		t.Fatal("the fast path refused a documented listing with kv_threads")
	}
	var slow wireListing
	if err := json.Unmarshal([]byte(kvThreadsListing), &slow); err != nil || !reflect.DeepEqual(fast, slow) {
		t.Fatalf("fast path differs from encoding/json (%v):\nfast %+v\nslow %+v", err, fast, slow)
	}
	l, err := DecodeListing([]byte(kvThreadsListing))
	if err != nil {
		t.Fatal(err)
	}
	one := 1
	want := KVThread{Role: ThreadTransferWorker, Function: "transfer_worker", TransferQueue: &one, Alive: false}
	if len(l.KVThreads) != 4 || !reflect.DeepEqual(l.KVThreads[2], want) || !l.KVThreads[0].Alive || l.KVThreads[0].TransferQueue != nil {
		t.Fatalf("kv_threads = %+v", l.KVThreads)
	}
	// Absent or null: the plugin does not know, which is not "none alive".
	if l, err := DecodeListing([]byte(round5Listing)); err != nil || l.KVThreads != nil {
		t.Fatalf("kv_threads absent decoded as %+v (%v)", l.KVThreads, err)
	}
	l, err = DecodeListing([]byte(strings.Replace(kvThreadsListing, `"kv_threads":[`, `"kv_threads":null,"kv_unused":[`, 1)))
	if err != nil || l.KVThreads != nil {
		t.Fatalf("kv_threads null decoded as %+v (%v)", l.KVThreads, err)
	}
	l, err = DecodeListing([]byte(strings.Replace(kvThreadsListing, `"kv_threads":[`, `"kv_threads":[],"kv_unused":[`, 1)))
	if err != nil || l.KVThreads == nil || len(l.KVThreads) != 0 {
		t.Fatalf("kv_threads [] decoded as %#v (%v)", l.KVThreads, err)
	}
}

func TestDecodeKVThreadsErrorsNameTheField(t *testing.T) {
	long := strings.Repeat("f", MaxThreadFunction+1)
	for _, tc := range []struct{ from, to, want string }{
		{`{"role":"bootstrap"`, `{"role":"prefill_bootstrap"`, `kv_threads[0] has role "prefill_bootstrap"`},
		{`{"role":"bootstrap"`, `{"role":""`, `kv_threads[0] has role ""`},
		{`"transfer_queue":1,"alive":false`, `"transfer_queue":-1,"alive":false`, "kv_threads[2] (role transfer_worker) has transfer_queue -1"},
		{`"transfer_queue":1,"alive":false`, `"transfer_queue":2,"alive":false`, "kv_threads[2] (role transfer_worker) has transfer_queue 2, but server.transfer_queues is 2"},
		{`"function":"_failed_session_probe_loop"`, `"function":"` + long + `"`, "kv_threads[3] (role other) has a function of 129 bytes, want at most 128"},
	} {
		body := strings.Replace(kvThreadsListing, tc.from, tc.to, 1)
		if body == kvThreadsListing {
			t.Fatalf("the case %q changed nothing", tc.from)
		}
		_, err := DecodeListing([]byte(body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one naming %q", tc.to, err, tc.want)
		}
	}
	// At the limit the name is kept whole.
	body := strings.Replace(kvThreadsListing, `"function":"_failed_session_probe_loop"`, `"function":"`+long[1:]+`"`, 1)
	if l, err := DecodeListing([]byte(body)); err != nil || l.KVThreads[3].Function != long[1:] {
		t.Fatalf("a function name of %d bytes: %v", MaxThreadFunction, err)
	}
}
