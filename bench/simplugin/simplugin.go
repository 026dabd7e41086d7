// Package simplugin adapts an in-process, Step-driven sglangsim.Sim to the
// watchdog's PluginSource and Restarter interfaces (Target, Inflight,
// ForceFail, Restart, and round 4's PostWedgeOrder), and its decode ranks to PluginSource, without
// HTTP, for benchmarks and the detection-quality replay. It depends only on
// sglangsim and pluginapi, so that the watchdog's own package-internal
// benchmarks can use it.
package simplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// Source is one rank of a Sim seen through the plugin API.
type Source struct {
	Sim  *sglangsim.Sim
	Rank int
	// Wire makes Inflight go through the wire format: the listing is
	// marshalled to JSON by Snapshot (outside any timed region) and every
	// Inflight decodes it with pluginapi.DecodeListing, as the HTTP client
	// does after reading the body. Without Wire, Inflight returns a copy of
	// the Listing taken by Snapshot, or a fresh Sim.Listing if there is no
	// snapshot (Live).
	Wire bool
	// Live makes every Inflight read the simulator afresh (Sim.Listing),
	// ignoring snapshots; the replay harness uses it, so that the
	// actuator's re-read right before a call sees the current state.
	Live bool

	body    []byte
	listing *pluginapi.Listing
}

// New returns the sources of every rank of sim.
func New(sim *sglangsim.Sim, wire bool) []*Source {
	out := make([]*Source, sim.Ranks())
	for i := range out {
		out[i] = &Source{Sim: sim, Rank: i, Wire: wire}
	}
	return out
}

// Target names the rank.
func (s *Source) Target() string { return fmt.Sprintf("sim://rank%d", s.Rank) }

// Snapshot takes the rank's current listing for the next Inflight calls,
// and in Wire mode serialises it. Call it after each Step.
func (s *Source) Snapshot() error {
	l := s.Sim.Listing(s.Rank)
	s.listing = &l
	if !s.Wire {
		return nil
	}
	b, err := json.Marshal(&l)
	if err != nil {
		return err
	}
	s.body = b
	return nil
}

// Body is the last snapshot's JSON.
func (s *Source) Body() []byte { return s.body }

// ErrBooting is what a read gets while the simulated server boots after a
// restart: the real listener refuses the connection.
var ErrBooting = errors.New("connection refused: the server is booting")

// Inflight returns the listing, or ErrBooting while the server boots.
func (s *Source) Inflight(ctx context.Context) (*pluginapi.Listing, error) {
	if s.Sim.Booting() {
		return nil, ErrBooting
	}
	if s.Live {
		l := s.Sim.Listing(s.Rank)
		if s.Wire {
			b, err := json.Marshal(&l)
			if err != nil {
				return nil, err
			}
			return pluginapi.DecodeListing(b)
		}
		return &l, nil
	}
	if s.Wire {
		if s.body == nil {
			if err := s.Snapshot(); err != nil {
				return nil, err
			}
		}
		return pluginapi.DecodeListing(s.body)
	}
	if s.listing == nil {
		if err := s.Snapshot(); err != nil {
			return nil, err
		}
	}
	l := *s.listing
	return &l, nil
}

// ForceFail applies the order through the simulator (inline when
// Step-driven, exactly as its next pass would).
func (s *Source) ForceFail(ctx context.Context, order pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
	if s.Sim.Booting() {
		return 0, nil, ErrBooting
	}
	st, resp := s.Sim.ForceFail(ctx, s.Rank, order, authorization(s.Sim))
	return st, &resp, nil
}

// PostWedgeOrder posts a standing wedge order through the simulator (POST
// /admin/wedge_order, round 4), with the signature of
// pluginapi.Client.PostWedgeOrder. The simulator takes it at once, as
// between two scheduler passes.
func (s *Source) PostWedgeOrder(ctx context.Context, order pluginapi.WedgeOrderRequest) (int, *pluginapi.WedgeOrderResponse, error) {
	if s.Sim.Booting() {
		return 0, nil, ErrBooting
	}
	st, resp := s.Sim.WedgeOrder(s.Rank, order, authorization(s.Sim))
	return st, &resp, nil
}

// Restart posts the restart order through the simulator (POST
// /admin/restart): on 202 the whole simulated server restarts at once
// and boots for its BootTime. A real force-fail answers only after the
// scheduler's pass applied it, and that pass releases the request; a
// Step-driven simulator applies the order inline and releases on its next
// Step. So that a restart asked right after force-fails does not take
// the requests they released, one Step (at the same clock time) runs
// first.
func (s *Source) Restart(ctx context.Context, order pluginapi.RestartRequest) (int, *pluginapi.RestartResponse, error) {
	if s.Sim.Booting() {
		return 0, nil, ErrBooting
	}
	s.Sim.Step()
	st, resp := s.Sim.AdminRestart(s.Rank, order, authorization(s.Sim))
	return st, &resp, nil
}

// authorization is the header the watchdog would send: the simulator's
// token, if it has one.
func authorization(sim *sglangsim.Sim) string {
	if t := sim.Options().Token; t != "" {
		return "Bearer " + t
	}
	return ""
}

// DecodeSource is one decode rank of a Sim seen through the plugin API
// (round 3), always read afresh.
type DecodeSource struct {
	Sim  *sglangsim.Sim
	Rank int
}

// NewDecode returns the sources of every decode rank of sim.
func NewDecode(sim *sglangsim.Sim) []*DecodeSource {
	out := make([]*DecodeSource, sim.DecodeRanks())
	for i := range out {
		out[i] = &DecodeSource{Sim: sim, Rank: i}
	}
	return out
}

// Target names the decode rank.
func (d *DecodeSource) Target() string { return fmt.Sprintf("sim://decode%d", d.Rank) }

// Inflight returns the decode listing, or ErrBooting while the decode
// server boots.
func (d *DecodeSource) Inflight(context.Context) (*pluginapi.Listing, error) {
	if d.Sim.DecodeBooting() {
		return nil, ErrBooting
	}
	l := d.Sim.DecodeListing(d.Rank)
	return &l, nil
}

// ForceFail applies the order through the simulator's decode lever.
func (d *DecodeSource) ForceFail(ctx context.Context, order pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
	if d.Sim.DecodeBooting() {
		return 0, nil, ErrBooting
	}
	st, resp := d.Sim.DecodeForceFail(ctx, d.Rank, order, authorization(d.Sim))
	return st, &resp, nil
}
