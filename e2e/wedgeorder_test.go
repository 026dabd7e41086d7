package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// decodeStrictly decodes a plugin answer into the Go wire type, refusing
// any field the type does not know: the Python plugin may not drift from
// pluginapi's round 4 types.
func decodeStrictly(t *testing.T, what string, body []byte, v interface{}) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s does not decode strictly into %T: %v\n%s", what, v, err, body)
	}
}

// wedgeOrder posts a wedge order and decodes the answer strictly.
func wedgeOrder(t *testing.T, base, token string, req pluginapi.WedgeOrderRequest) (int, pluginapi.WedgeOrderResponse) {
	t.Helper()
	body, _ := json.Marshal(req)
	hr, _ := http.NewRequest(http.MethodPost, base+pluginapi.PathWedgeOrder, bytes.NewReader(body))
	hr.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out pluginapi.WedgeOrderResponse
	decodeStrictly(t, "the wedge order answer", b, &out)
	if out.Failed == nil {
		t.Errorf("wedge order answer %d without a failed array: %s", resp.StatusCode, b)
	}
	return resp.StatusCode, out
}

// TestPythonPluginRound4FieldsDecodeStrictly holds the Python plugin's
// listing and wedge order answers to pluginapi's round 4 types where the
// stand-in manager has no worker queues (transfer_progress false).
func TestPythonPluginRound4FieldsDecodeStrictly(t *testing.T) {
	tok := tokenFile(t, parityToken)
	pluginURL, _ := startStandin(t, sglangsim.BackendNIXL, tok)
	var l pluginapi.Listing
	decodeStrictly(t, "the listing", []byte(getText(t, pluginURL+pluginapi.PathInflight)), &l)
	if l.Server.TransferProgress == nil || *l.Server.TransferProgress || l.TransferWorkers != nil || l.WedgeOrders == nil {
		t.Errorf("without worker queues: transfer_progress %v, transfer_workers %v, wedge_orders %v; want false, null, []",
			l.Server.TransferProgress, l.TransferWorkers, l.WedgeOrders)
	}
	for _, r := range l.Inflight {
		if r.ChunksQueued != nil {
			t.Errorf("%s: chunks_queued %d without worker queues, want null", r.RID, *r.ChunksQueued)
		}
	}
	status, answer := wedgeOrder(t, pluginURL, parityToken, pluginapi.WedgeOrderRequest{TransferQueue: 0, Chunk: 1, TTLSeconds: 5})
	if status != http.StatusNotImplemented || answer.Result != pluginapi.ResultUnsupported || answer.Error == "" {
		t.Errorf("wedge order without worker queues: %d %+v, want 501 unsupported with an error", status, answer)
	}
	status, answer = wedgeOrder(t, pluginURL, parityToken, pluginapi.WedgeOrderRequest{TransferQueue: 0, Chunk: 1})
	if status != http.StatusBadRequest || !strings.Contains(answer.Error, "ttl_seconds") {
		t.Errorf("wedge order without a ttl: %d %+v, want 400 naming ttl_seconds", status, answer)
	}
}

// TestRealCodeServerRound4 holds the plugin to round 4 on SGLang's own
// transfer workers (release realCodeRelease): a hung chunk with two rooms
// queued behind it is listed as such, a wedge order releases all three
// through SGLang's own Failed branch, its renewal reports them, and the
// order is void once the wedge clears.
func TestRealCodeServerRound4(t *testing.T) {
	src := sglangSource(t, realCodeRelease)
	for i, backend := range []string{sglangsim.BackendNIXL, sglangsim.BackendMooncake} {
		t.Run(backend, func(t *testing.T) {
			const token = "realcode-token"
			srv := startRealCodeServer(t, src, backend, tokenFile(t, token))
			room := uint64(8001 + 100*i)
			stuck, behind := fmt.Sprintf("stuck-%d", room), []string{fmt.Sprintf("behind-%d", room+1), fmt.Sprintf("behind-%d", room+2)}
			srv.admit(t, stuck, room, "hang")
			var l pluginapi.Listing
			var held *pluginapi.ChunkInFlight
			queue := -1
			waitFor(t, "a worker to hold the stuck room's chunk", 10*time.Second, func() bool {
				l = pluginapi.Listing{}
				decodeStrictly(t, "the listing", []byte(getText(t, srv.pluginURL+pluginapi.PathInflight)), &l)
				for _, w := range l.TransferWorkers {
					if w.InFlight != nil && w.InFlight.BootstrapRoom == room {
						held, queue = w.InFlight, w.TransferQueue
					}
				}
				return held != nil
			})
			for j, rid := range behind {
				srv.admit(t, rid, room+1+uint64(j), "complete")
			}
			l = pluginapi.Listing{}
			decodeStrictly(t, "the listing", []byte(getText(t, srv.pluginURL+pluginapi.PathInflight)), &l)
			if l.Server.TransferProgress == nil || !*l.Server.TransferProgress || l.TransferWorkers[queue].Depth != 2 {
				t.Fatalf("listing %+v: want transfer_progress and 2 chunks queued on queue %d", l, queue)
			}
			for _, r := range l.Inflight {
				want := map[bool]int{true: 0, false: 1}[r.RID == stuck]
				if r.ChunksQueued == nil || *r.ChunksQueued != want || r.TransferQueue == nil || *r.TransferQueue != queue {
					t.Errorf("%s: chunks_queued %v on queue %v, want %d on %d", r.RID, r.ChunksQueued, r.TransferQueue, want, queue)
				}
			}

			order := pluginapi.WedgeOrderRequest{TransferQueue: queue, Chunk: held.Chunk, TTLSeconds: 30, Reason: "e2e"}
			if status, answer := wedgeOrder(t, srv.pluginURL, token, order); status != http.StatusOK || answer.Result != pluginapi.ResultOrdered {
				t.Fatalf("wedge order: %d %+v", status, answer)
			}
			waitFor(t, "SGLang to release the three rooms", 10*time.Second, func() bool { return len(srv.state(t).reasons()) == 3 })
			want := map[string]string{stuck: "FINISH_ABORT", behind[0]: "FINISH_ABORT", behind[1]: "FINISH_ABORT"}
			if got := srv.state(t).reasons(); !equalMaps(got, want) {
				t.Errorf("released by SGLang's pass: %v, want %v", got, want)
			}
			status, answer := wedgeOrder(t, srv.pluginURL, token, order)
			if status != http.StatusOK || len(answer.Failed) != 3 || answer.ExpiresInSeconds <= 0 {
				t.Errorf("renewal: %d %+v, want ordered with the three rooms failed", status, answer)
			}

			resp, err := http.Post(srv.control+"/scenario/end_hang", "application/json",
				strings.NewReader(fmt.Sprintf(`{"room":%d,"outcome":"complete"}`, room)))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			waitFor(t, "the order to be void", 10*time.Second, func() bool {
				status, answer := wedgeOrder(t, srv.pluginURL, token, order)
				return status == http.StatusConflict && answer.Result == pluginapi.ResultWedgeCleared
			})
			if st := srv.state(t); len(st.Errors) > 0 {
				t.Errorf("SGLang's pass raised (a real scheduler would have died): %v", st.Errors)
			}
		})
	}
}
