package pluginapi

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"
)

// round2Listing carries every round-2 field (docs/plugin-api.md, "Round 2
// additions").
const round2Listing = `{"api_version":1,
 "server":{"pid":4242,"dp_rank":1,"pp_rank":1,"tp_rank":0,"disaggregation_mode":"prefill","transfer_backend":"nixl",
  "sglang_version":"0.5.23","levers":["abort","_send_failed"],"lever_note":"","pp_size":2,"transfer_queues":4},
 "now_unix":1764403200.125,"loop":{"iterations":918273,"last_iteration_unix":1764403200.117},
 "queues":{"bootstrap":0,"waiting":0,"inflight":2},
 "inflight":[
  {"rid":"a","bootstrap_room":6619432765110349211,"bootstrap_addr":"10.1.2.3:8998","poll":"Transferring","age_seconds":81.5,
   "prompt_tokens":5120,"progress":3,"send_failed":false,"health_check":false,"transfer_in_flight":true,"transfer_queue":2},
  {"rid":"b","bootstrap_room":7,"bootstrap_addr":"10.1.2.3:8998","poll":"WaitingForInput","age_seconds":1.5,
   "prompt_tokens":10,"progress":0,"send_failed":false,"health_check":false,"transfer_in_flight":false,"transfer_queue":null}],
 "orphaned_transfers":[{"bootstrap_room":18446744073709551615,"transfer_queue":2,"outstanding_chunks":1},
  {"bootstrap_room":5,"transfer_queue":null,"outstanding_chunks":3}]}`

func TestDecodeRound2Fields(t *testing.T) {
	l, err := DecodeListing([]byte(round2Listing))
	if err != nil {
		t.Fatal(err)
	}
	s := l.Server
	if !reflect.DeepEqual(s.Levers, []string{LeverAbort, LeverSendFailed}) || s.PPSize != 2 || s.TransferQueues == nil || *s.TransferQueues != 4 {
		t.Fatalf("server decoded as %+v", s)
	}
	a, b := l.Inflight[0], l.Inflight[1]
	if a.TransferInFlight == nil || !*a.TransferInFlight || a.TransferQueue == nil || *a.TransferQueue != 2 {
		t.Fatalf("room a decoded as %+v", a)
	}
	if b.TransferInFlight == nil || *b.TransferInFlight || b.TransferQueue != nil {
		t.Fatalf("room b decoded as %+v", b)
	}
	if len(l.OrphanedTransfers) != 2 || l.OrphanedTransfers[0].BootstrapRoom != 1<<64-1 || *l.OrphanedTransfers[0].TransferQueue != 2 ||
		l.OrphanedTransfers[1].TransferQueue != nil || l.OrphanedTransfers[1].OutstandingChunks != 3 {
		t.Fatalf("orphans decoded as %+v", l.OrphanedTransfers)
	}
	// The fast path must take round-2 listings, or every real listing
	// would pay for encoding/json.
	var w wireListing
	if !decodeWireFast([]byte(round2Listing), &w) {
		t.Fatal("the fast decoder refused a round-2 listing")
	}
}

// An older plugin sends none of the round-2 fields: each one reads as
// unknown, never as "no lever" or "nothing in flight".
func TestDecodeAbsentRound2FieldsAreUnknown(t *testing.T) {
	l, err := DecodeListing([]byte(exampleListing))
	if err != nil {
		t.Fatal(err)
	}
	if l.Server.Levers != nil || l.Server.PPSize != 0 || l.Server.TransferQueues != nil || l.OrphanedTransfers != nil {
		t.Fatalf("absent fields decoded as known: %+v orphans %v", l.Server, l.OrphanedTransfers)
	}
	if r := l.Inflight[0]; r.TransferInFlight != nil || r.TransferQueue != nil {
		t.Fatalf("absent room fields decoded as known: %+v", r)
	}
	// An empty levers list is known and means "no lever works here".
	l, err = DecodeListing([]byte(`{"api_version":1,"server":{"levers":[]},"loop":{},"inflight":[],"orphaned_transfers":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	if l.Server.Levers == nil || len(l.Server.Levers) != 0 || l.OrphanedTransfers == nil {
		t.Fatalf("empty lists decoded as absent: %+v %v", l.Server, l.OrphanedTransfers)
	}
}

func TestDecodeRound2ErrorsNameTheField(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{`{"api_version":1,"server":{"pp_size":-1},"loop":{},"inflight":[]}`, "pp_size -1"},
		{`{"api_version":1,"server":{"pp_size":2,"pp_rank":2},"loop":{},"inflight":[]}`, "pp_rank 2 outside pp_size 2"},
		{`{"api_version":1,"server":{"transfer_queues":0},"loop":{},"inflight":[]}`, "transfer_queues 0"},
		{`{"api_version":1,"server":{"levers":["abort",""]},"loop":{},"inflight":[]}`, "empty levers[1]"},
		{`{"api_version":1,"server":{"levers":"abort"},"loop":{},"inflight":[]}`, "levers"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Failed","transfer_queue":-1}]}`, `inflight[0] (rid "a") has transfer_queue -1`},
		{`{"api_version":1,"server":{"transfer_queues":4},"loop":{},"inflight":[{"rid":"a","poll":"Failed","transfer_queue":4}]}`, "transfer_queue 4, but server.transfer_queues is 4"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Failed","transfer_in_flight":1}]}`, "transfer_in_flight"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[],"orphaned_transfers":[{"bootstrap_room":3,"outstanding_chunks":0}]}`, "orphaned_transfers[0] (room 3) has outstanding_chunks 0"},
		{`{"api_version":1,"server":{"transfer_queues":2},"loop":{},"inflight":[],"orphaned_transfers":[{"bootstrap_room":3,"transfer_queue":5,"outstanding_chunks":1}]}`, "orphaned_transfers[0] (room 3) has transfer_queue 5"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[],"orphaned_transfers":{}}`, "orphaned_transfers"},
	} {
		_, err := DecodeListing([]byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to mention %q", tc.body, err, tc.want)
		}
	}
}

func TestClientRestart(t *testing.T) {
	var gotAuth, gotPath string
	var got RestartRequest
	mux := http.NewServeMux()
	mux.HandleFunc("/admin/restart", func(w http.ResponseWriter, r *http.Request) {
		gotAuth, gotPath = r.Header.Get("Authorization"), r.URL.Path
		if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		// What arrives is the client's to check.
		if got.DryRun {
			_ = json.NewEncoder(w).Encode(RestartResponse{Result: ResultWouldRestart, PID: got.PID})
			return
		}
		w.WriteHeader(http.StatusAccepted)
		_ = json.NewEncoder(w).Encode(RestartResponse{Result: ResultRestarting, PID: got.PID})
	})
	mux.HandleFunc("/old/admin/restart", http.NotFound)
	mux.HandleFunc("/slow/admin/restart", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // only the timing matters here
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	c := NewClient(srv.URL, ClientOptions{Token: "s3cret", AdminTimeout: time.Second})
	status, resp, err := c.Restart(context.Background(), RestartRequest{PID: 4242, Reason: "transfer queue 2 wedged", DryRun: true})
	if err != nil || status != http.StatusOK || resp.Result != ResultWouldRestart || !got.DryRun || got.PID != 4242 || got.Reason == "" {
		t.Fatalf("Restart dry run = %d, %+v, %v (server saw %+v)", status, resp, err, got)
	}
	status, resp, err = c.Restart(context.Background(), RestartRequest{PID: 4242})
	if err != nil || status != http.StatusAccepted || resp.Result != ResultRestarting || gotAuth != "Bearer s3cret" || gotPath != PathRestart {
		t.Fatalf("Restart = %d, %+v, %v (auth %q, path %q)", status, resp, err, gotAuth, gotPath)
	}
	// An older plugin has no such path: the status comes back with an error.
	status, _, err = NewClient(srv.URL+"/old", ClientOptions{}).Restart(context.Background(), RestartRequest{PID: 1})
	if err == nil || status != http.StatusNotFound {
		t.Fatalf("Restart on an older plugin = %d, %v", status, err)
	}
	// The admin timeout bounds the call.
	start := time.Now()
	_, _, err = NewClient(srv.URL+"/slow", ClientOptions{AdminTimeout: 100 * time.Millisecond}).Restart(context.Background(), RestartRequest{PID: 1})
	if err == nil || !strings.Contains(err.Error(), "deadline exceeded") || time.Since(start) > 3*time.Second {
		t.Fatalf("Restart past the admin timeout = %v", err)
	}
}
