package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"regexp"
	"slices"
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
// the one behind it still held by the wedged worker afterwards. In
// between, two more decode destinations of different speeds compare the
// per-link fields (parityLinks).
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

	// The default destination (queue 0 on the simulator), and two more on
	// queues 1 and 3 for the per-link scene.
	port, portX, portY := 17000, 17001, 17003
	sim, _ := startSim(t, sglangsim.Options{Clock: clock.Real{}, DecodePorts: []int{port, portX, portY}})
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

	// Two destinations of different speeds: the per-link fields.
	parityLinks(t, srv, sim, simSide.client, portX, portY)

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

// linkShape is what a link name of one destination looks like: SGLang
// v0.5.18's NIXL keys a destination by its decode agent's name, a uuid4
// (disaggregation/nixl/conn.py); one name, no comma, as every room here
// goes to one destination.
var linkShape = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// linkView is one side's per-link fields in the scene: per worker, the
// finished chunks of the scene's two destinations as "pages@X" or
// "pages@Y", oldest first; and the link of the chunk in flight on Y's
// worker while Y's slow chunk is held.
type linkView struct {
	Finished map[int][]string
	InFlight string
}

// linkViewOf reads a listing with names (destination name -> label).
func linkViewOf(t *testing.T, side string, l *pluginapi.Listing, names map[string]string) linkView {
	t.Helper()
	v := linkView{Finished: map[int][]string{}}
	for _, w := range l.TransferWorkers {
		var last int64 = -1
		for _, c := range w.Finished {
			if c.Chunk <= last {
				t.Errorf("%s: worker %d lists finished chunks out of order: %+v", side, w.TransferQueue, w.Finished)
			}
			last = c.Chunk
			if c.Link != "" && !linkShape.MatchString(c.Link) {
				t.Errorf("%s: worker %d: link %q is not one NIXL agent name (uuid4)", side, w.TransferQueue, c.Link)
			}
			if label, ok := names[c.Link]; ok {
				v.Finished[w.TransferQueue] = append(v.Finished[w.TransferQueue], fmt.Sprintf("%d@%s", c.Pages, label))
			}
		}
		if f := w.InFlight; f != nil && f.Pages > 0 {
			if label, ok := names[f.Link]; ok {
				v.InFlight = label
			} else {
				v.InFlight = "unknown " + f.Link
			}
		}
	}
	return v
}

// parityLinks plays two destinations on both sides: X fast on queue 1, Y
// at a quarter of a second a page on queue 3. X takes two requests of two
// 2-page chunks and one of a 4-page chunk, Y one of a 4-page chunk (1 s).
// While Y's chunk is held, and once everything finished, the per-link
// fields must agree in structure: chunk numbers ascending, pages, one
// uuid4-shaped name per destination, each chunk named by its own.
func parityLinks(t *testing.T, srv *realCodeServer, sim *sglangsim.Sim, simClient *pluginapi.Client, portX, portY int) {
	t.Helper()
	realNames, simNames := map[string]string{}, map[string]string{}
	for label, q := range map[string]int{"X": 1, "Y": 3} {
		var d struct {
			Key string `json:"key"`
		}
		perPage := map[string]float64{"X": 0.005, "Y": 0.25}[label]
		if err := json.Unmarshal(srv.post(t, "/scenario/destination", map[string]any{"link": label, "transfer_queue": q, "seconds_per_page": perPage}), &d); err != nil {
			t.Fatal(err)
		}
		realNames[d.Key] = label
	}
	simNames[sglangsim.DestinationName(sglangsim.BackendNIXL, portX)] = "X"
	simNames[sglangsim.DestinationName(sglangsim.BackendNIXL, portY)] = "Y"
	// The simulator's Y: 250 ms of planned transfer at a quarter of the
	// speed, 1 s.
	if err := sim.SetDestinationSpeed(0, -1, portY, 0.25); err != nil {
		t.Fatal(err)
	}
	room := uint64(7100)
	for _, r := range []struct {
		link   string
		chunks int
	}{{"X", 2}, {"X", 2}, {"X", 1}, {"Y", 1}} {
		room++
		rid := fmt.Sprintf("link-%s-%d", r.link, room)
		srv.post(t, "/scenario/admit", map[string]any{"rid": rid, "room": room, "link": r.link, "chunks": r.chunks})
		spec := sglangsim.RequestSpec{RID: rid, Room: room, Behavior: sglangsim.BehaviorHealthy, Transfer: 40 * time.Millisecond,
			Chunks: r.chunks, PromptTokens: 4, DecodePort: portX}
		if r.link == "Y" {
			spec.Transfer, spec.DecodePort = 250*time.Millisecond, portY
		}
		sim.Submit(spec)
	}
	realClient := pluginapi.NewClient(srv.pluginURL, pluginapi.ClientOptions{Timeout: 2 * time.Second})
	views := func() (linkView, linkView) {
		rl, err := realClient.Inflight(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		sl, err := simClient.Inflight(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return linkViewOf(t, "SGLang's own code", rl, realNames), linkViewOf(t, "simulator", sl, simNames)
	}
	time.Sleep(400 * time.Millisecond)
	real, simulated := views()
	if real.InFlight != "Y" || simulated.InFlight != "Y" {
		t.Errorf("Y's chunk held: in_flight.link is %q on SGLang's own code, %q on the simulator; want Y's name on both", real.InFlight, simulated.InFlight)
	}
	time.Sleep(1200 * time.Millisecond)
	real, simulated = views()
	want := map[int][]string{1: {"2@X", "2@X", "2@X", "2@X", "4@X"}, 3: {"4@Y"}}
	for q, seq := range want {
		if !slices.Equal(real.Finished[q], seq) || !slices.Equal(simulated.Finished[q], seq) {
			t.Errorf("worker %d's finished chunks of the two destinations: SGLang's own code %v, simulator %v, want %v",
				q, real.Finished[q], simulated.Finished[q], seq)
		}
	}
}
