package watchdog

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// A wedge order asks the plugin to fail every room queued behind one
// overdue chunk at once (fail-fast) instead of one force-fail per room,
// renewed while the wedge holds.

// orderCall is one call for a wedge order: placing it, or renewing it
// while its wedge holds.
type orderCall struct {
	rank  *rankState
	queue int
	wedge transferWedge
	order *wedgeOrder
	pid   int
	// The chunk and the link speed of the queue at the decision.
	held       pluginapi.ChunkInFlight
	speed      float64
	speedKnown bool
	chunkSeen  time.Time
	// since is the transfer-failed counter when the rooms the answer
	// reports began to be failed (the baseline of their confirmation).
	since float64
	// closing: the wedge cleared; this call only collects what the order
	// failed since its last renewal.
	closing bool
}

// leftToOrder tells whether the stuck rooms on queue q of rk are left to
// a wedge order rather than force-failed one by one: the queue has an
// actionable wedge, wedge orders are on, and the plugin takes them. Caller
// holds w.mu.
func (w *Watchdog) leftToOrder(rk *rankState, q int) bool {
	tw, ok := rk.wedges[q]
	if !ok || !wedgeActionable(tw) || !w.cfg.FailFast || w.mode == ModeOff || rk.unsupported() {
		return false
	}
	o := rk.orders[q]
	return o == nil || o.chunk != tw.chunk || !o.unsupported
}

// orderCalls lists the wedge orders to place or renew this cycle, one per
// actionable wedge. Caller holds w.mu.
func (w *Watchdog) orderCalls() []orderCall {
	if !w.cfg.FailFast || w.mode == ModeOff {
		return nil
	}
	var out []orderCall
	for _, rk := range w.ranks {
		for _, o := range rk.closing {
			if rk.status.up {
				out = append(out, orderCall{rank: rk, queue: o.queue, wedge: transferWedge{chunk: o.chunk, rule: o.rule}, order: o, pid: rk.server.PID, closing: true})
			}
		}
		rk.closing = rk.closing[:0]
		if !rk.status.up || rk.wedged || !rk.loopAdvancing || !rk.reportsTransferProgress || rk.unsupported() {
			continue
		}
		queues := make([]int, 0, len(rk.wedges))
		for q := range rk.wedges {
			queues = append(queues, q)
		}
		sort.Ints(queues)
		for _, q := range queues {
			tw := rk.wedges[q]
			if !wedgeActionable(tw) {
				continue
			}
			o := rk.orders[q]
			if o == nil || o.chunk != tw.chunk {
				o = &wedgeOrder{queue: q, chunk: tw.chunk, rule: tw.rule}
				rk.orders[q] = o
			}
			if o.unsupported || o.cleared || (o.dryRun && w.mode == ModeDryRun) {
				continue
			}
			ws := rk.workers[q]
			out = append(out, orderCall{rank: rk, queue: q, wedge: *tw, order: o, pid: rk.server.PID, held: *ws.inFlight, speed: ws.speed, speedKnown: ws.speedKnown, chunkSeen: ws.chunkSeen})
		}
	}
	return out
}

// orderTTL is how long an order stands without renewal: three cycles, so
// that one slow cycle does not let it lapse, and at least 10 s.
func (w *Watchdog) orderTTL() time.Duration {
	return max(3*w.cfg.Interval, 10*time.Second)
}

// placeOrders sends the cycle's wedge orders. A new order (and the first
// real one after a dry run, or a retry of one never placed) is sent only if
// a fresh listing still shows the chunk in the worker's hands and overdue,
// and takes a slot of the fail-fast budget once; renewals are free, and
// need no re-read, since the plugin voids an order whose chunk left the
// worker (409 wedge_cleared).
func (w *Watchdog) placeOrders(ctx context.Context, calls []orderCall) []Event {
	if len(calls) == 0 {
		return nil
	}
	w.act.Lock()
	defer w.act.Unlock()
	var events []Event
	for _, c := range calls {
		if ctx.Err() != nil {
			break
		}
		events = append(events, w.placeOrder(ctx, c)...)
	}
	return events
}

// placeOrder takes one wedge order through the rails. Caller holds w.act.
func (w *Watchdog) placeOrder(ctx context.Context, c orderCall) []Event {
	mode := w.Mode()
	if mode == ModeOff {
		return nil
	}
	rk := c.rank
	w.mu.Lock()
	placed, budgeted := c.order.placed, c.order.budgeted
	w.mu.Unlock()
	src, ok := rk.source.(WedgeOrderer)
	if !ok {
		return w.recordOrder(c, mode, 0, nil, errNoWedgeOrders)
	}
	if !placed && !c.closing {
		if !budgeted && !w.callAvailable(budgetFailFast) {
			return w.recordOrder(c, mode, 0, nil, errRateLimited)
		}
		if reason := w.rereadWedge(ctx, c); reason != "" {
			level.Info(w.logger).Log("msg", "wedge order not sent", "target", rk.status.target, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel,
				"transfer_queue", c.queue, "chunk", c.wedge.chunk, "reason", reason)
			return nil
		}
		if !budgeted {
			w.allowCall(budgetFailFast)
			w.mu.Lock()
			c.order.budgeted = true
			w.mu.Unlock()
		}
	}
	w.mu.Lock()
	if w.metrics != nil {
		// The rooms an answer reports were failed since the previous call:
		// their confirmation counts the counter's rises from then.
		v, _ := w.metrics.counter(TransferFailedFamily)
		c.since = v
		if placed {
			c.since = c.order.baseline
		}
		c.order.baseline = v
	}
	w.mu.Unlock()
	req := pluginapi.WedgeOrderRequest{TransferQueue: c.queue, Chunk: c.wedge.chunk, TTLSeconds: w.orderTTL().Seconds(),
		MinAgeSeconds: w.cfg.FailFastMinAge.Seconds(), DryRun: mode == ModeDryRun,
		Reason: fmt.Sprintf("sglang-watchdog: transfer queue %d wedged (%s): chunk %d (%d pages) held %.0fs, past its allowance of %s", c.queue, c.wedge.rule,
			c.wedge.chunk, c.held.Pages, c.held.Seconds, chunkAllowance(c.held.Pages, c.speed, c.speedKnown, &w.cfg).Round(time.Second))}
	if c.closing {
		req.Reason = fmt.Sprintf("sglang-watchdog: chunk %d left transfer queue %d's worker; collecting what its order failed", c.wedge.chunk, c.queue)
	}
	status, resp, err := src.PostWedgeOrder(ctx, req)
	return w.recordOrder(c, mode, status, resp, err)
}

// Answers of an order that was not sent: the budget kept it back, or the
// source takes no wedge orders.
var (
	errRateLimited   = errors.New("rate limited")
	errNoWedgeOrders = errors.New("this source takes no wedge orders")
)

// rereadWedge reads the rank's listing again right before a new order: the
// same process must still hold the wedge's chunk in the worker's hands,
// overdue at the speed the decision used. It returns why not, or "".
func (w *Watchdog) rereadWedge(ctx context.Context, c orderCall) string {
	l, err := c.rank.source.Inflight(ctx)
	switch {
	case err != nil:
		return "re-reading the listing failed: " + err.Error()
	case l.Server.PID != c.pid:
		return "the scheduler restarted"
	case l.Server.TransferProgress == nil || !*l.Server.TransferProgress:
		return "the listing no longer reports transfer_progress"
	}
	for _, tw := range l.TransferWorkers {
		if tw.TransferQueue != c.queue {
			continue
		}
		ws := &workerState{tracked: tw.Tracked, inFlight: tw.InFlight, speed: c.speed, speedKnown: c.speedKnown, chunkSeen: c.chunkSeen}
		if tw.InFlight == nil || tw.InFlight.Chunk != c.wedge.chunk || !chunkOverdue(ws, w.cfg.Clock.Now(), &w.cfg) {
			return "the worker no longer holds the overdue chunk"
		}
		return ""
	}
	return "the listing no longer has the transfer queue"
}

// Wedge order results, the `result` label of
// sglang_watchdog_wedge_orders_total.
const (
	OrderPlaced      = "ordered"       // a new order stands
	OrderRenewed     = "renewed"       // a standing order renewed
	OrderWouldOrder  = "would_order"   // dry run
	OrderCleared     = "wedge_cleared" // 409: the worker no longer holds the chunk
	OrderRateLimited = "rate_limited"  // not sent: the fail-fast budget is spent
	OrderUnsupported = "unsupported"   // 404, 501: no wedge orders on this plugin
	OrderRejected    = "rejected"      // 400, 401, 404 not_found
	OrderError       = "error"         // no usable answer, 5xx
)

// OrderResults lists every wedge order result.
var OrderResults = []string{OrderPlaced, OrderRenewed, OrderWouldOrder, OrderCleared, OrderRateLimited, OrderUnsupported, OrderRejected, OrderError}

// classifyOrder maps a wedge order's answer to a result.
func classifyOrder(renewal bool, status int, resp *pluginapi.WedgeOrderResponse, err error) string {
	switch {
	case errors.Is(err, errRateLimited):
		return OrderRateLimited
	case status == http.StatusInternalServerError && resp != nil && resp.Result == pluginapi.ResultLeverIneffective:
		// The levers were pulled and SGLang does not release the rooms:
		// asking again changes nothing.
		return OrderUnsupported
	case errors.Is(err, errNoWedgeOrders) || status == http.StatusNotImplemented || (status == http.StatusNotFound && (resp == nil || resp.Result != pluginapi.ResultNotFound)):
		// A 404 without the contract's body is an older plugin.
		return OrderUnsupported
	case err != nil || resp == nil:
		return OrderError
	case status == http.StatusOK && resp.Result == pluginapi.ResultOrdered && renewal:
		return OrderRenewed
	case status == http.StatusOK && resp.Result == pluginapi.ResultOrdered:
		return OrderPlaced
	case status == http.StatusOK && resp.Result == pluginapi.ResultWouldOrder:
		return OrderWouldOrder
	case status == http.StatusConflict && resp.Result == pluginapi.ResultWedgeCleared:
		return OrderCleared
	case status == http.StatusBadRequest || status == http.StatusUnauthorized || status == http.StatusNotFound:
		return OrderRejected
	}
	return OrderError
}

// recordOrder settles a wedge order's state from its answer, logs and
// counts it, and takes every room it failed through the confirmation of
// a force-fail release (trigger fail_fast): one audit line per room.
func (w *Watchdog) recordOrder(c orderCall, mode Mode, status int, resp *pluginapi.WedgeOrderResponse, err error) []Event {
	rk := c.rank
	at := w.clock.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	o := c.order
	result := classifyOrder(o.placed, status, resp, err)
	if result == OrderRateLimited {
		// Said and counted once per wedge; it is tried again each cycle.
		if o.rateLimited {
			return nil
		}
		o.rateLimited = true
	}
	w.wedgeOrders[result]++
	fields := []interface{}{"msg", "wedge order", "target", rk.status.target, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "pid", c.pid,
		"transfer_queue", c.queue, "chunk", c.wedge.chunk, "rule", c.wedge.rule, "room", c.wedge.room, "mode", mode,
		"http_status", status, "result", result}
	if c.closing {
		fields = append(fields, "closing", true)
	}
	if resp != nil {
		fields = append(fields, "rooms_failed", len(resp.Failed))
		if resp.Error != "" {
			fields = append(fields, "plugin_error", resp.Error)
		}
		if resp.LeverNote != "" {
			fields = append(fields, "lever_note", resp.LeverNote)
		}
	}
	logger := level.Error(w.logger)
	switch result {
	case OrderPlaced, OrderRenewed:
		o.placed = true
		logger = level.Warn(w.logger)
		if result == OrderRenewed && len(resp.Failed) == 0 {
			logger = level.Debug(w.logger)
		}
	case OrderWouldOrder:
		o.dryRun = true
		logger = level.Warn(w.logger)
	case OrderCleared:
		// The wedge cleared between the listing and the call: its chunk
		// left the worker, and the next listing shows it.
		o.cleared = true
		logger = level.Info(w.logger)
	case OrderRateLimited:
		fields = append(fields, "reason", w.limitDetail(budgetFailFast))
		logger = level.Warn(w.logger)
	case OrderUnsupported, OrderRejected:
		// Not asked again for this wedge: its rooms go the deadline path.
		o.unsupported = true
	}
	if err != nil && result != OrderRateLimited {
		fields = append(fields, "err", err)
	}
	logger.Log(fields...)
	events := []Event{{Kind: EventWedgeOrder, Role: RolePrefill, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel,
		Room: c.wedge.room, Queue: c.queue, Result: result, Reason: c.wedge.rule}}
	if resp != nil {
		// Every answer reports the rooms failed since the previous call,
		// a 409 (the wedge cleared meanwhile) and a 500 too.
		for _, f := range resp.Failed {
			events = append(events, w.orderFailed(c, f, result == OrderWouldOrder, at))
		}
	}
	return events
}

// orderFailed audits one room a wedge order failed (or would fail) and,
// for a real order, awaits its confirmation like a force-fail's. Caller
// holds w.mu.
func (w *Watchdog) orderFailed(c orderCall, f pluginapi.FailedRoom, dry bool, at time.Time) Event {
	rk := c.rank
	key := reqKey{role: RolePrefill, dp: rk.dpLabel, roomKey: roomKey{rid: f.RID, room: f.BootstrapRoom}}
	var age float64
	var poll string
	r := rk.rooms[key.roomKey]
	if r == nil {
		r = rk.departed[key.roomKey]
	}
	if r != nil {
		age, poll = r.age, r.poll
	}
	ev := Event{Kind: EventForceFail, Role: RolePrefill, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel,
		RID: f.RID, Room: f.BootstrapRoom, Age: age, Poll: poll, Trigger: TriggerFailFast, Queue: c.queue}
	msg := "wedge order failed a room"
	if dry {
		msg = "wedge order would fail a room"
		w.forceFails[[3]string{ResultWouldFlip, TriggerFailFast, RolePrefill}]++
		ev.Result = ResultWouldFlip
	} else {
		ev.Result = pluginapi.ResultFlipped
		if st := w.request(key); !st.done {
			st.done = true
			w.pending = append(w.pending, &pending{key: key, rank: rk, stages: []*rankState{rk}, trigger: TriggerFailFast, at: at,
				family: TransferFailedFamily, baseline: c.since, age: age, poll: poll})
			// Decode may free the room's pages only if prefill stopped
			// sending: never for the room of the wedged chunk, nor for one
			// whose chunks in flight the plugin cannot see on every rank.
			stopped := r != nil && f.BootstrapRoom != c.wedge.room && r.chunk == noChunk && r.inFlightKnown && !r.inFlight &&
				rk.server.SeesEveryWriter()
			w.ledger.add(roomKey{rid: f.RID, room: f.BootstrapRoom}, at, stopped)
		}
	}
	fields := []interface{}{"msg", msg, "rid", f.RID, "room", f.BootstrapRoom, "transfer_queue", c.queue, "chunk", c.wedge.chunk,
		"target", rk.status.target, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "levers", strings.Join(f.Levers, ",")}
	if r != nil {
		// A room the watchdog never saw listed has no known age.
		fields = append(fields, "age", fmt.Sprintf("%.1f", age), "poll", poll)
	}
	level.Info(w.logger).Log(fields...)
	return ev
}
