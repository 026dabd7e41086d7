package sglangsim

import (
	"encoding/json"
	"math"
	"strconv"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// wedgeOrder is a standing order for one wedged transfer queue (round 4
// POST /admin/wedge_order).
type wedgeOrder struct {
	chunk   int64
	expires time.Time
	minAge  time.Duration
	failed  []pluginapi.FailedRoom // since the previous call
	total   int
}

// maxWedgeTTL bounds ttl_seconds: nothing fails traffic on its own for
// longer than this without a renewal.
const maxWedgeTTL = 300

// roundFour tells whether the plugin reports transfer progress and takes
// wedge orders here: a round-4 plugin on a manager with worker queues it
// can watch.
func (s *Sim) roundFour() bool {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return !s.opts.PreRound4Plugin && s.opts.LeverEra != LeversNIXLMid2025 && !s.unwatched
}

// listsThreads tells whether the plugin lists kv_threads: a plugin of
// issue 24, except in the parity scene, whose Python stand-in's managers
// start no threads for it to find.
func (s *Sim) listsThreads() bool {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return !s.opts.PreRound4Plugin && !s.unwatched
}

// applyWedgeOrders runs the standing orders at the start of the inflight
// pass, before the poll: an order that expired, or whose worker took
// another chunk, is dropped; the others fail their queue's rooms.
func (r *rank) applyWedgeOrders(s *Sim, now time.Time) {
	for qi := range r.orders {
		if o := r.standing(qi, now); o != nil {
			o.failed = append(o.failed, r.wedgeFail(s, qi, o.minAge, now, false)...)
		}
	}
}

// standing is queue qi's order if it still stands at now: not expired and
// its worker still holds its chunk. Otherwise it drops it. Callers hold
// r.mu.
func (r *rank) standing(qi int, now time.Time) *wedgeOrder {
	o := r.orders[qi]
	if o != nil && (!now.Before(o.expires) || !r.holds(qi, o.chunk, now)) {
		r.orders[qi], o = nil, nil
	}
	return o
}

// wedgeFail fails (dry: lists) every room of the inflight queue bound for
// queue qi except health checks and warm-ups, rooms whose sender reads
// Success, rooms younger than minAge and rooms already failed, with the
// force-fail levers. Callers hold r.mu.
func (r *rank) wedgeFail(s *Sim, qi int, minAge time.Duration, now time.Time, dry bool) []pluginapi.FailedRoom {
	levers, _ := s.levers()
	var out []pluginapi.FailedRoom
	for _, q := range r.inflight {
		if q.fake || q.queue != qi || q.healthCheck() || now.Sub(q.entered) < minAge {
			continue
		}
		sd := q.senders[r.pp]
		if st, _ := r.status(s, sd, now); st == pollSuccess || st == pollFailed || sd.local == pollFailed ||
			len(sd.leversSet(levers)) == len(levers) {
			continue
		}
		out = append(out, pluginapi.FailedRoom{RID: q.rid, BootstrapRoom: q.room, Levers: levers})
		if dry {
			continue
		}
		r.pull(s, q, levers, now)
		r.g.records[q.rec].wedgeOrdered = true
		if o := r.orders[qi]; o != nil {
			o.total++
		}
	}
	return out
}

// wedgeOrderStates lists the standing orders (listing wedge_orders) at
// now; an order that lapsed or whose worker took another chunk since the
// last pass is gone. Callers hold r.mu.
func (r *rank) wedgeOrderStates(now time.Time) []pluginapi.WedgeOrderState {
	out := []pluginapi.WedgeOrderState{}
	for qi := range r.orders {
		o := r.standing(qi, now)
		if o == nil {
			continue
		}
		out = append(out, pluginapi.WedgeOrderState{TransferQueue: qi, Chunk: o.chunk,
			ExpiresInSeconds: o.expires.Sub(now).Seconds(), RoomsFailed: o.total})
	}
	return out
}

func wedgeAnswer(status int, result, msg string) (int, pluginapi.WedgeOrderResponse) {
	return status, pluginapi.WedgeOrderResponse{Result: result, Failed: []pluginapi.FailedRoom{}, Error: msg}
}

// WedgeOrder does what POST /admin/wedge_order does on one prefill rank
// (docs/plugin-api.md, round 4), with an already decoded body: 401, 400,
// 503 while the server boots or the rank's loop is paused, 501 without
// transfer progress or without a lever, 404 for an unknown queue, 409
// wedge_cleared when the worker does not hold the chunk, 200 would_order
// for a dry run, else 200 ordered. The order is taken under the
// scheduler's lock and applied from the next pass on, as the plugin's
// scheduler thread applies it: the answer lists the rooms it failed since
// the previous call for that queue (none on the first call). Every pass
// applies it until it expires or the worker takes another chunk.
func (s *Sim) WedgeOrder(rank int, req pluginapi.WedgeOrderRequest, authorization string) (int, pluginapi.WedgeOrderResponse) {
	if !s.authorized(authorization) {
		return wedgeAnswer(401, pluginapi.ResultUnauthorized, "a valid Authorization: Bearer token is required for /admin/*")
	}
	if msg := checkWedgeOrder(req); msg != "" {
		return wedgeAnswer(400, pluginapi.ResultBadRequest, msg)
	}
	if rank < 0 || rank >= len(s.ranks) {
		return wedgeAnswer(404, pluginapi.ResultNotFound, "no such rank "+strconv.Itoa(rank))
	}
	if s.opts.PreRound4Plugin {
		// An older plugin has no such path.
		return wedgeAnswer(404, pluginapi.ResultNotFound, "no "+pluginapi.PathWedgeOrder+" on this plugin")
	}
	if s.Booting() {
		return wedgeAnswer(503, pluginapi.ResultSchedulerUnresponsive, "the server is restarting")
	}
	if !s.roundFour() {
		return wedgeAnswer(501, pluginapi.ResultUnsupported, "no transfer worker queues are watched here (transfer_progress false)")
	}
	levers, note := s.levers()
	if len(levers) == 0 {
		st, resp := wedgeAnswer(501, pluginapi.ResultUnsupported, "no lever releases a request on this SGLang: "+note)
		resp.LeverNote = note
		return st, resp
	}
	if req.TransferQueue >= TransferQueues {
		return wedgeAnswer(404, pluginapi.ResultNotFound, "no transfer queue "+strconv.Itoa(req.TransferQueue))
	}
	r := s.ranks[rank]
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.paused {
		return wedgeAnswer(503, pluginapi.ResultSchedulerUnresponsive, "the scheduler loop does not answer")
	}
	now := s.clock.Now()
	qi := req.TransferQueue
	if !r.holds(qi, req.Chunk, now) {
		r.orders[qi] = nil
		return wedgeAnswer(409, pluginapi.ResultWedgeCleared,
			"worker "+strconv.Itoa(qi)+" does not hold chunk "+strconv.FormatInt(req.Chunk, 10))
	}
	minAge := time.Duration(req.MinAgeSeconds * float64(time.Second))
	ttl := time.Duration(req.TTLSeconds * float64(time.Second))
	if req.DryRun {
		failed := r.wedgeFail(s, qi, minAge, now, true)
		if failed == nil {
			failed = []pluginapi.FailedRoom{}
		}
		return 200, pluginapi.WedgeOrderResponse{Result: pluginapi.ResultWouldOrder, Failed: failed}
	}
	o := r.orders[qi]
	if o == nil || o.chunk != req.Chunk {
		o = &wedgeOrder{chunk: req.Chunk}
		r.orders[qi] = o
	}
	o.expires, o.minAge = now.Add(ttl), minAge
	failed := o.failed
	o.failed = nil
	if failed == nil {
		failed = []pluginapi.FailedRoom{}
	}
	return 200, pluginapi.WedgeOrderResponse{Result: pluginapi.ResultOrdered, ExpiresInSeconds: ttl.Seconds(), Failed: failed}
}

// checkWedgeOrder applies the contract's bounds to a decoded order.
func checkWedgeOrder(req pluginapi.WedgeOrderRequest) string {
	switch {
	case req.TransferQueue < 0:
		return "transfer_queue must be an integer >= 0"
	case req.Chunk < 0:
		return "chunk must be an integer >= 0"
	case math.IsNaN(req.TTLSeconds) || req.TTLSeconds <= 0 || req.TTLSeconds > maxWedgeTTL:
		return "ttl_seconds must be a number in (0, 300]"
	case math.IsNaN(req.MinAgeSeconds) || math.IsInf(req.MinAgeSeconds, 0) || req.MinAgeSeconds < 0:
		return "min_age_seconds must be a number >= 0"
	}
	return ""
}

// ParseWedgeOrder decodes a wedge-order body. It returns a non-empty
// message, naming the field, when the body is a bad request.
func ParseWedgeOrder(body []byte) (pluginapi.WedgeOrderRequest, string) {
	var req pluginapi.WedgeOrderRequest
	obj, msg := jsonObject(body)
	if msg != "" {
		return req, msg
	}
	integer := func(name string) (int64, string) {
		n, ok := obj[name].(json.Number)
		if !ok {
			return 0, name + " is required and must be an integer >= 0"
		}
		v, err := strconv.ParseInt(n.String(), 10, 64)
		if err != nil || v < 0 {
			return 0, name + " is required and must be an integer >= 0"
		}
		return v, ""
	}
	number := func(name string) (float64, bool, string) {
		raw, present := obj[name]
		if !present {
			return 0, false, ""
		}
		n, ok := raw.(json.Number)
		if !ok {
			return 0, true, name + " must be a number"
		}
		v, err := n.Float64()
		if err != nil {
			return 0, true, name + " must be a number"
		}
		return v, true, ""
	}
	tq, msg := integer("transfer_queue")
	if msg != "" {
		return req, msg
	}
	if tq > math.MaxInt32 {
		return req, "transfer_queue is out of range"
	}
	req.TransferQueue = int(tq)
	if req.Chunk, msg = integer("chunk"); msg != "" {
		return req, msg
	}
	ttl, present, msg := number("ttl_seconds")
	if msg != "" || !present {
		return req, "ttl_seconds is required and must be a number in (0, 300]"
	}
	req.TTLSeconds = ttl
	if req.MinAgeSeconds, _, msg = number("min_age_seconds"); msg != "" {
		return req, msg
	}
	if msg := boolField(obj, "dry_run", &req.DryRun); msg != "" {
		return req, msg
	}
	if raw, ok := obj["reason"]; ok {
		reason, isString := raw.(string)
		if !isString {
			return req, "reason must be a string"
		}
		req.Reason = reason
	}
	return req, checkWedgeOrder(req)
}
