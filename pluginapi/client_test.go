package pluginapi

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// exampleListing is the listing of docs/plugin-api.md, verbatim.
const exampleListing = `{
  "api_version": 1,
  "server": {"pid": 4242, "dp_rank": 0, "pp_rank": 0, "tp_rank": 0,
             "disaggregation_mode": "prefill", "transfer_backend": "nixl",
             "sglang_version": "0.5.9"},
  "now_unix": 1764403200.125,
  "loop": {"iterations": 918273, "last_iteration_unix": 1764403200.117},
  "queues": {"bootstrap": 2, "waiting": 0, "inflight": 1},
  "inflight": [
    {"rid": "7f3c9a1e5b2d4c6f8a0b1c2d3e4f5a6b", "bootstrap_room": 6619432765110349211,
     "bootstrap_addr": "10.1.2.3:8998", "poll": "Transferring", "age_seconds": 812.4,
     "prompt_tokens": 5120, "progress": 3, "send_failed": false, "health_check": false,
     "a_future_field": {"ignored": true}}
  ]
}`

func TestDecodeListingContractExample(t *testing.T) {
	l, err := DecodeListing([]byte(exampleListing))
	if err != nil {
		t.Fatal(err)
	}
	r := l.Inflight[0]
	if r.BootstrapRoom != 6619432765110349211 || r.AgeSeconds != 812.4 || r.Progress != 3 || r.Poll != PollTransferring {
		t.Fatalf("room decoded as %+v", r)
	}
	if l.Loop.Iterations != 918273 || l.Queues.Bootstrap != 2 || l.Server.TransferBackend != "nixl" {
		t.Fatalf("listing decoded as %+v", l)
	}
}

func TestDecodeListingKeepsAll64Bits(t *testing.T) {
	body := `{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","bootstrap_room":18446744073709551557,"poll":"Transferring","age_seconds":1,"progress":0}]}`
	l, err := DecodeListing([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if l.Inflight[0].BootstrapRoom != 18446744073709551557 {
		t.Fatalf("room = %d", l.Inflight[0].BootstrapRoom)
	}
}

func TestDecodeListingErrorsNameTheField(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{`not json`, "malformed listing"},
		{`{"server":{},"loop":{},"inflight":[]}`, "api_version"},
		{`{"api_version":2,"server":{},"loop":{},"inflight":[]}`, "api_version 2"},
		{`{"api_version":1,"loop":{},"inflight":[]}`, "no server"},
		{`{"api_version":1,"server":{},"inflight":[]}`, "no loop"},
		{`{"api_version":1,"server":{},"loop":{}}`, "no inflight"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":null}`, "no inflight"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"poll":"Transferring"}]}`, "inflight[0] has no rid"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Stuck"}]}`, `poll "Stuck"`},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Failed","bootstrap_room":"12"}]}`, "bootstrap_room"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Failed","bootstrap_room":-1}]}`, "bootstrap_room"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Failed","age_seconds":-3}]}`, "age_seconds"},
		{`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","poll":"Failed","progress":-2}]}`, "progress"},
	} {
		_, err := DecodeListing([]byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to mention %q", tc.body, err, tc.want)
		}
	}
}

func TestClientInflightFailures(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/slow/debug/inflight", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	mux.HandleFunc("/err/debug/inflight", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "scheduler gone", http.StatusBadGateway)
	})
	mux.HandleFunc("/huge/debug/inflight", func(w http.ResponseWriter, _ *http.Request) {
		// The client stops reading at its limit: a failed write is the point.
		_, _ = io.WriteString(w, `{"api_version":1,"server":{},"loop":{},"inflight":[`+strings.Repeat(" ", 4096)+`]}`)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, tc := range []struct{ path, want string }{
		{"/slow", "deadline exceeded"},
		{"/err", "HTTP 502"},
		{"/huge", "body exceeds 1024 bytes"},
	} {
		c := NewClient(srv.URL+tc.path, ClientOptions{Timeout: 100 * time.Millisecond, MaxBodyBytes: 1024})
		_, err := c.Inflight(context.Background())
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), srv.URL+tc.path) {
			t.Errorf("%s: err = %v, want one naming the target and %q", tc.path, err, tc.want)
		}
	}
}

func TestClientForceFailSendsTokenAndNeverFollowsRedirects(t *testing.T) {
	var gotAuth string
	var got ForceFailRequest
	mux := http.NewServeMux()
	mux.HandleFunc("/admin/force_fail", func(w http.ResponseWriter, r *http.Request) {
		gotAuth = r.Header.Get("Authorization")
		if err := json.NewDecoder(r.Body).Decode(&got); err != nil || got.BootstrapRoom == nil {
			http.Error(w, fmt.Sprintf("body %+v: %v", got, err), http.StatusBadRequest)
			return
		}
		room := *got.BootstrapRoom
		// What arrives is the client's to check.
		_ = json.NewEncoder(w).Encode(ForceFailResponse{Result: ResultFlipped, RID: got.RID, BootstrapRoom: &room, Lever: LeverSendFailed, AppliedUnix: 1})
	})
	mux.HandleFunc("/moved/admin/force_fail", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/admin/force_fail", http.StatusTemporaryRedirect)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	room := uint64(18446744073709551557)
	c := NewClient(srv.URL, ClientOptions{Token: "s3cret", AdminTimeout: time.Second})
	status, resp, err := c.ForceFail(context.Background(), ForceFailRequest{RID: "r", BootstrapRoom: &room})
	if err != nil || status != 200 || resp.Result != ResultFlipped || *resp.BootstrapRoom != room {
		t.Fatalf("ForceFail = %d, %+v, %v", status, resp, err)
	}
	if gotAuth != "Bearer s3cret" || *got.BootstrapRoom != room {
		t.Fatalf("server saw auth %q room %v", gotAuth, got.BootstrapRoom)
	}

	gotAuth = ""
	c = NewClient(srv.URL+"/moved", ClientOptions{Token: "s3cret"})
	if _, _, err := c.ForceFail(context.Background(), ForceFailRequest{RID: "r", BootstrapRoom: &room}); err == nil {
		t.Fatal("a redirect answer was taken as a result")
	}
	if gotAuth != "" {
		t.Fatal("the token followed a redirect")
	}
}
