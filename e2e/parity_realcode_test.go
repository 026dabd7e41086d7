package e2e

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// parityView is what must agree between SGLang's own code and the
// simulator for one request at one moment: whether it is listed, whether a
// chunk of it is in flight, and whether its listed progress moved since it
// was first listed. Poll names differ where SGLang's own do (a NIXL room
// waiting behind a busy worker reads WaitingForInput on v0.5.18, Transferring
// once its chunk is picked up), so they are compared only where both sides
// are terminal: gone, and how.
type parityView struct {
	Listed   bool
	InFlight bool
	Moved    bool
}

type paritySide struct {
	name     string
	client   *pluginapi.Client
	admit    func(t *testing.T, rid string, room uint64, behaviour string)
	first    map[string]int64
	released func(t *testing.T) map[string]string // rid -> "success" or "abort"
}

func (p *paritySide) view(t *testing.T, rids ...string) map[string]parityView {
	t.Helper()
	l, err := p.client.Inflight(context.Background())
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	out := map[string]parityView{}
	for _, rid := range rids {
		out[rid] = parityView{}
	}
	for _, r := range l.Inflight {
		if _, ok := out[r.RID]; !ok {
			continue
		}
		if _, ok := p.first[r.RID]; !ok {
			p.first[r.RID] = r.Progress
		}
		out[r.RID] = parityView{Listed: true, InFlight: r.TransferInFlight != nil && *r.TransferInFlight,
			Moved: r.Progress != p.first[r.RID]}
	}
	return out
}

// TestSimulatorParityWithSGLangsOwnCode plays one fixed scene on the
// real-code server (SGLang v0.5.18's own NIXL prefill code) and on the
// simulator, and compares what the watchdog's rules read: a slow healthy
// transfer whose progress stands still and which completes untouched; a
// hung handle and a healthy request queued behind it on the same serial
// transfer worker; the hung one force-failed and released as an abort,
// the one behind it still held by the wedged worker afterwards.
func TestSimulatorParityWithSGLangsOwnCode(t *testing.T) {
	if testing.Short() {
		t.Skip("starts SGLang's own code")
	}
	src := sglangSource(t, realCodeRelease)
	const token = "parity-token"
	srv := startRealCodeServer(t, src, "nixl", tokenFile(t, token))
	real := &paritySide{name: "SGLang " + realCodeRelease, client: pluginapi.NewClient(srv.pluginURL,
		pluginapi.ClientOptions{Timeout: 2 * time.Second, AdminTimeout: 10 * time.Second, Token: token}),
		admit: srv.admit, first: map[string]int64{},
		released: func(t *testing.T) map[string]string {
			out := map[string]string{}
			for rid, reason := range srv.state(t).reasons() {
				out[rid] = map[bool]string{true: "abort", false: "success"}[reason == "FINISH_ABORT"]
			}
			return out
		}}

	port := 17000
	sim, _ := startSim(t, sglangsim.Options{Clock: clock.Real{}, DecodePorts: []int{port}})
	plugin := httptest.NewServer(sim.PluginHandler(0))
	t.Cleanup(plugin.Close)
	simURL := plugin.URL
	behaviours := map[string]sglangsim.RequestSpec{
		"complete": {Behavior: sglangsim.BehaviorHealthy, Transfer: 300 * time.Millisecond},
		"slow:3":   {Behavior: sglangsim.BehaviorSlow, Transfer: 3 * time.Second, ChunkEvery: 500 * time.Millisecond},
		"hang":     {Behavior: sglangsim.BehaviorPinStuckHandle, FreezeAt: -1},
	}
	simSide := &paritySide{name: "simulator", client: pluginapi.NewClient(simURL,
		pluginapi.ClientOptions{Timeout: 2 * time.Second, AdminTimeout: 10 * time.Second}),
		first: map[string]int64{},
		admit: func(t *testing.T, rid string, room uint64, behaviour string) {
			spec := behaviours[behaviour]
			spec.RID, spec.Room, spec.DecodePort, spec.PromptTokens = rid, room, port, 4
			sim.Submit(spec)
			deadline := time.Now().Add(5 * time.Second)
			for time.Now().Before(deadline) {
				l, err := pluginapi.NewClient(simURL, pluginapi.ClientOptions{Timeout: time.Second}).Inflight(context.Background())
				if err == nil {
					for _, r := range l.Inflight {
						if r.RID == rid {
							return
						}
					}
				}
				time.Sleep(20 * time.Millisecond)
			}
			t.Fatalf("simulator: %s was never listed", rid)
		},
		released: func(t *testing.T) map[string]string {
			out := map[string]string{}
			for _, r := range sim.Records() {
				if r.Left.IsZero() {
					continue
				}
				out[r.RID] = map[bool]string{true: "abort", false: "success"}[!r.ForcedAt.IsZero()]
			}
			return out
		}}
	sides := []*paritySide{real, simSide}

	compare := func(phase string, rids ...string) {
		t.Helper()
		want := real.view(t, rids...)
		got := simSide.view(t, rids...)
		for _, rid := range rids {
			if want[rid] != got[rid] {
				t.Errorf("%s: %s: SGLang's own code %+v, simulator %+v", phase, rid, want[rid], got[rid])
			}
		}
	}

	// A slow healthy transfer: listed, its progress still, then gone as a success.
	for _, s := range sides {
		s.admit(t, "slow", 7001, "slow:3")
	}
	time.Sleep(time.Second)
	compare("slow transfer, 1 s in", "slow")
	time.Sleep(3 * time.Second)
	compare("slow transfer, done", "slow")

	// A hung handle, then a healthy request behind it on the same worker.
	for _, s := range sides {
		s.admit(t, "hung", 7002, "hang")
		s.admit(t, "behind", 7003, "complete")
	}
	time.Sleep(1500 * time.Millisecond)
	compare("hung handle and a request behind it", "hung", "behind")
	for _, s := range sides {
		room := uint64(7002)
		status, resp, err := s.client.ForceFail(context.Background(), pluginapi.ForceFailRequest{RID: "hung", BootstrapRoom: &room, Reason: "parity"})
		if err != nil || status != 200 || resp.Result != pluginapi.ResultFlipped {
			t.Fatalf("%s: force-fail of the hung request: %d %+v %v", s.name, status, resp, err)
		}
	}
	time.Sleep(1500 * time.Millisecond)
	compare("after the force-fail", "hung", "behind")

	for _, s := range sides {
		got := s.released(t)
		want := map[string]string{"slow": "success", "hung": "abort"}
		for rid, how := range want {
			if got[rid] != how {
				t.Errorf("%s: %s released as %q, want %q", s.name, rid, got[rid], how)
			}
		}
		if _, ok := got["behind"]; ok {
			t.Errorf("%s: the request behind the wedged worker was released (%s); the worker still waits on the dead handle", s.name, got["behind"])
		}
	}
	t.Logf("parity scene compared at %s", fmt.Sprint(time.Now().Format(time.RFC3339)))
}
