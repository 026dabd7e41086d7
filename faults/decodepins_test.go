package faults

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/go-kit/log"

	"github.com/sglang-watchdog/sglang-watchdog/bench/simplugin"
	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// decodeSource is one decode rank of a Step-driven Sim seen through the
// plugin API, recording the orders it gets.
type decodeSource struct {
	sim  *sglangsim.Sim
	rank int

	mu     sync.Mutex
	orders []pluginapi.ForceFailRequest
}

func (d *decodeSource) Target() string { return fmt.Sprintf("sim://decode%d", d.rank) }

func (d *decodeSource) Inflight(context.Context) (*pluginapi.Listing, error) {
	l := d.sim.DecodeListing(d.rank)
	return &l, nil
}

func (d *decodeSource) ForceFail(ctx context.Context, order pluginapi.ForceFailRequest) (int, *pluginapi.ForceFailResponse, error) {
	d.mu.Lock()
	d.orders = append(d.orders, order)
	d.mu.Unlock()
	st, resp := d.sim.DecodeForceFail(ctx, d.rank, order, "")
	return st, &resp, nil
}

// pinnedDecodeRun runs the three pins and healthy traffic on the newest
// NIXL for 6 minutes of fake time, with one watchdog over the prefill and
// the decode rank (nil: stock SGLang alone), and returns the simulator and
// the decode source.
func pinnedDecodeRun(t *testing.T, withWatchdog bool) (*sglangsim.Sim, map[sglangsim.PinKind]string, *decodeSource) {
	t.Helper()
	c := clock.NewFake(time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC))
	sim, err := sglangsim.New(sglangsim.Options{Clock: c, Era: sglangsim.EraNewest, Backend: sglangsim.BackendNIXL})
	if err != nil {
		t.Fatal(err)
	}
	pins := map[sglangsim.PinKind]string{}
	for _, pin := range []sglangsim.PinKind{sglangsim.PinAbortBeforeRegister, sglangsim.PinResurrection, sglangsim.PinStuckHandle} {
		pins[pin], _ = sim.Inject(0, pin)
	}
	dec := &decodeSource{sim: sim}
	var wd *watchdog.Watchdog
	if withWatchdog {
		cfg := productionConfig()
		cfg.Clock = c
		cfg.Logger = log.NewNopLogger()
		for _, p := range simplugin.New(sim, true) {
			p.Live = true
			cfg.Plugins = append(cfg.Plugins, p)
		}
		cfg.Plugins = append(cfg.Plugins, dec)
		if wd, err = watchdog.New(cfg); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	for step := 1; step <= 3600; step++ {
		c.Advance(100 * time.Millisecond)
		sim.Step()
		// Healthy requests keep preallocating, so a slot freed under a
		// live transfer is handed on and a late write lands in it.
		if step%50 == 0 {
			sim.Submit(sglangsim.RequestSpec{Transfer: time.Second})
		}
		if wd != nil && step%10 == 0 {
			wd.RunCycle(ctx)
		}
	}
	return sim, pins, dec
}

// TestWatchdogFreesNoDecodePagesUnderALiveTransfer is the issue's "a test
// must fail if the watchdog ever frees such pages" at full integration: the
// real watchdog, watching the prefill and decode ranks of one simulated
// deployment (newest NIXL, whose prefill listing has transfer_tracking),
// releases the decode requests of the abort-before-register pin (no chunk
// ever posted) and of the resurrection pin (asserting prefill_stopped, which
// needs transfer_tracking) early, and never the one
// whose prefill stuck handle can still write into its pages.
func TestWatchdogFreesNoDecodePagesUnderALiveTransfer(t *testing.T) {
	stock, stockPins, _ := pinnedDecodeRun(t, false)
	sim, pins, dec := pinnedDecodeRun(t, true)
	records := func(s *sglangsim.Sim) map[string]sglangsim.Record {
		out := map[string]sglangsim.Record{}
		for _, r := range s.Records() {
			out[r.RID] = r
		}
		return out
	}
	stockRecs, recs := records(stock), records(sim)
	for _, c := range sim.Corruptions() {
		if c.Cause == sglangsim.DecodeForceFail {
			t.Errorf("a decode force-fail freed pages a late write landed in: %+v", c)
		}
	}
	ordered := map[string]pluginapi.ForceFailRequest{}
	for _, o := range dec.orders {
		ordered[o.RID] = o
	}
	names := map[sglangsim.PinKind]string{sglangsim.PinAbortBeforeRegister: "abort-before-register",
		sglangsim.PinResurrection: "resurrection", sglangsim.PinStuckHandle: "stuck handle"}
	for pin, name := range names {
		r, s := recs[pins[pin]], stockRecs[stockPins[pin]]
		t.Logf("%s: decode hold %s (%s) with the watchdog, %s (%s) stock", name, r.DecodeHold(), r.DecodeEnd, s.DecodeHold(), s.DecodeEnd)
		o, called := ordered[pins[pin]]
		if pin == sglangsim.PinStuckHandle {
			if called {
				t.Errorf("%s: the watchdog called decode for a room prefill may still write: %+v", name, o)
			}
			if r.DecodeEnd == sglangsim.DecodeForceFail || r.UnsafeFree == sglangsim.DecodeForceFail {
				t.Errorf("%s: record %+v", name, r)
			}
			continue
		}
		// The abort-before-register room was never registered on prefill,
		// so no chunk was posted and the release needs no prefill verdict;
		// the resurrection's transfer started, so it needs prefill_stopped.
		if !called || (pin == sglangsim.PinResurrection && !o.PrefillStopped) || r.DecodeEnd != sglangsim.DecodeForceFail || r.UnsafeFree != "" {
			t.Errorf("%s: order %+v (called %v), record %+v; want a release (with prefill_stopped once the transfer started)", name, o, called, r)
		}
		if s.DecodeHold() != 0 && r.DecodeHold() >= s.DecodeHold() {
			t.Errorf("%s: hold %s with the watchdog, %s stock; want shorter", name, r.DecodeHold(), s.DecodeHold())
		}
	}
}
