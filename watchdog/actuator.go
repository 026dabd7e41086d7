package watchdog

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// The actuator is the only code that changes anything outside this process.
// Every rail lives here: the mode, at most one successful call per request,
// bounded retries after errors, the rate limits, the re-read of every
// stage's listing right before the call, the confirmation of the release,
// and the restart escalation.

// stageView is one PP stage of a request as seen when the decision was made.
// The rank's own fields are copied here under w.mu, so that the actuator
// (which may run for the webhook while a cycle observes) never reads them
// unlocked.
type stageView struct {
	rank          *rankState
	poll          string
	progress      int64
	inFlightKnown bool
	inFlight      bool
	tracked       bool // the listing's server.transfer_tracking
	dqueue        string
	started       bool
	age           float64
	addr          string
	pid           int
	iterations    uint64
	unsupported   bool
	leverNote     string
}

// candidate is a request to act on: stuck on one of its stages, or a
// decode request that a "stopped" verdict would release early.
type candidate struct {
	key      reqKey
	rank     *rankState // the stage the verdict was made on
	poll     string
	progress int64
	age      float64
	// early: stuck on no stage, only released early (decodeEarly). Until
	// prefill answers "stopped" it is not held but waiting: no skip is
	// counted for it.
	early bool
	// stages lists every stage of the DP rank that holds the request.
	stages []stageView
	// blocked names a stage of the DP rank that is down or whose loop is
	// wedged: the request cannot be failed on every stage now.
	blocked string
	// ppSize is the most PP stages a listing of the DP rank reports.
	ppSize int
}

// budget is a rate limit of its own: each counts its requests over any
// 60 s apart from the others.
type budget int

const (
	// budgetDeadline: prefill requests failed after their deadline
	// (MaxPerMinute).
	budgetDeadline budget = iota
	// budgetFailFast: new wedge orders (FailFastPerMinute); one order
	// fails every room behind its wedge, and its renewals are free.
	budgetFailFast
	// budgetDecode: decode releases (DecodePerMinute). Each passed the
	// safety rule (transfer never started, SGLang marked it Failed, or
	// prefill stopped sending), and each prefill release strands one
	// decode request, so they must not compete with prefill for slots.
	budgetDecode
	numBudgets
)

// budget names the rate limit a call for the request takes a slot of.
func (c candidate) budget() budget {
	if c.key.role == RoleDecode {
		return budgetDecode
	}
	return budgetDeadline
}

// candidates lists the requests that may be acted on: stuck prefill
// requests oldest first, then stuck or early decode requests youngest
// first. Rooms left to a wedge order are not among them. Caller holds w.mu.
func (w *Watchdog) candidates(now time.Time, onRank func(*rankState) bool) []candidate {
	var out []candidate
	seen := map[reqKey]int{}
	for _, rk := range w.ranks {
		// Never act on a rank whose last listing failed or whose loop is
		// not running: the observations could be stale.
		if !rk.status.up || rk.wedged || (onRank != nil && !onRank(rk)) {
			continue
		}
		for key, r := range rk.rooms {
			// A room on a queue whose wedge is ordered is failed by the
			// order, with every other room behind the same wedge; not one
			// whose share on this rank was sent (Success), which the order
			// leaves alone: another rank of its group holds it.
			if (!r.stuck && !r.early) || (w.leftToOrder(rk, r.queue) && r.poll != pluginapi.PollSuccess) {
				continue
			}
			k := reqKey{role: rk.role, dp: rk.dpLabel, roomKey: key}
			if st := w.requests[k]; st != nil && (st.done || st.acting || now.Before(st.nextAttempt)) {
				continue
			}
			c := candidate{key: k, rank: rk, poll: r.poll, progress: r.progress, age: r.age, early: !r.stuck}
			if i, ok := seen[k]; ok {
				// Another stage holds it too: decide on the oldest one;
				// stuck on any stage, it is stuck.
				early := out[i].early && c.early
				if r.age > out[i].age {
					out[i] = c
				}
				out[i].early = early
				continue
			}
			seen[k] = len(out)
			out = append(out, c)
		}
	}
	for i := range out {
		out[i].stages, out[i].blocked, out[i].ppSize = w.stages(out[i].key)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.key.role != b.key.role {
			return a.key.role == RolePrefill
		}
		if a.early != b.early {
			// A request released early answers a client that waits for
			// it since prefill's release, and gains the most over SGLang's
			// timeout: it goes before the flood of requests stranded by
			// a wedge's fail-fast, which would otherwise take the whole
			// decode budget. Its lookups cannot starve those: they stop
			// at half the interval.
			return a.early
		}
		if na, nb := needsVerdict(a), needsVerdict(b); na != nb {
			// A request that needs no verdict lookup is decided before
			// any that does: a slow prefill peer must not starve it.
			return !na
		}
		if a.age != b.age {
			// SGLang's own timeout frees a decode request at 300 s, so
			// a release saves 300 s less its age: when the budget
			// cannot take them all, the youngest gain the most (up to
			// 120 s) and the oldest almost nothing. Nothing frees a
			// stuck prefill room: the oldest has waited longest.
			if a.key.role == RoleDecode {
				return a.age < b.age
			}
			return a.age > b.age
		}
		return a.key.rid < b.key.rid
	})
	return out
}

// stages lists the PP stages of the request's DP rank that hold it, names
// a stage that cannot be acted on now, and gives the PP size the rank's
// listings report. Caller holds w.mu.
func (w *Watchdog) stages(k reqKey) (views []stageView, blocked string, ppSize int) {
	for _, rk := range w.ranks {
		if !rk.listed || rk.role != k.role || rk.dpLabel != k.dp {
			continue
		}
		ppSize = max(ppSize, rk.server.PPSize)
		if !rk.status.up || rk.wedged {
			blocked = rk.status.target
			continue
		}
		if r, ok := rk.rooms[k.roomKey]; ok {
			views = append(views, stageView{rank: rk, poll: r.poll, progress: r.progress, inFlightKnown: r.inFlightKnown, inFlight: r.inFlightKnown && r.inFlight,
				tracked: rk.server.SeesEveryWriter(), dqueue: r.dqueue, started: r.started, age: r.age, addr: r.addr, pid: rk.server.PID, iterations: rk.iterations, unsupported: rk.unsupported(), leverNote: rk.server.LeverNote})
		}
	}
	return views, blocked, ppSize
}

// request returns the bookkeeping of a request, creating it. Caller holds
// w.mu.
func (w *Watchdog) request(k reqKey) *reqState {
	st := w.requests[k]
	if st == nil {
		st = &reqState{}
		w.requests[k] = st
	}
	return st
}

// actuate walks the candidates through the rails. asAuto makes a dry-run
// watchdog act for real (the Alertmanager trigger); mode off always wins.
func (w *Watchdog) actuate(ctx context.Context, cands []candidate, trigger string, asAuto bool, until time.Time) {
	if len(cands) == 0 {
		return
	}
	w.act.Lock()
	defer w.act.Unlock()
	w.startLookups()
	flipped := map[*rankState]bool{}
	for _, c := range cands {
		if ctx.Err() != nil {
			return
		}
		// A cycle stops starting calls once its interval is spent: the rest
		// are decided again on the next cycle's listings.
		if !until.IsZero() && !w.clock.Now().Before(until) {
			return
		}
		// A deadline lever set on a prefill rank may unblock its other
		// stuck rooms: decide on them from the next listing. Decode
		// requests (each waits on its own prefill room) go on, each
		// re-read first.
		if c.budget() == budgetDeadline && flipped[c.rank] {
			continue
		}
		evs := w.actOne(ctx, c, trigger, asAuto)
		for _, e := range evs {
			if e.Kind == EventForceFail && c.budget() == budgetDeadline && (e.Result == pluginapi.ResultFlipped || e.Result == pluginapi.ResultAlreadyFailed) {
				flipped[c.rank] = true
			}
		}
		w.emit(evs)
	}
}

// stageAnswer is one stage's answer to a force-fail.
type stageAnswer struct {
	rank    *rankState
	status  int
	resp    *pluginapi.ForceFailResponse
	err     error
	outcome string
}

// Outcomes of one stage's answer, before they are combined per request.
const (
	outAwait     = "await" // flipped or already_failed: the release must be confirmed
	outSucceeded = "transfer_succeeded"
)

// actOne takes one request through the rails, in order: the checks that
// need no I/O, the decode safety rule, the re-read of every stage, the
// claim on the request, the call, and the record of its answer.
func (w *Watchdog) actOne(ctx context.Context, c candidate, trigger string, asAuto bool) []Event {
	mode, evs, ok := w.admit(c, trigger, asAuto)
	if !ok {
		return evs
	}
	// The safety rule comes before the re-reads: a held request costs its
	// plugins no listing. The re-read below cancels the call if anything
	// the rule read (poll, queue, transfer_started) changed since.
	prefillStopped := false
	if c.key.role == RoleDecode {
		var cleared bool
		prefillStopped, cleared, evs = w.decodeCleared(ctx, c, trigger)
		if !cleared {
			return evs
		}
	}
	targets, reread, evs := w.reread(ctx, c, trigger)
	if targets == nil {
		return evs
	}
	if !w.allowCall(c.budget()) {
		return w.skip(c, SkipRateLimited, trigger, w.limitDetail(c.budget()))
	}
	cl, ok := w.claim(c, &reread[0])
	if !ok {
		return nil
	}
	room := c.key.room
	order := pluginapi.ForceFailRequest{RID: c.key.rid, BootstrapRoom: &room, Reason: w.forceFailReason(c, &reread[0]),
		DryRun: mode == ModeDryRun, PrefillStopped: prefillStopped}
	answers := make([]stageAnswer, len(targets))
	for i, s := range targets {
		status, resp, err := s.rank.source.ForceFail(ctx, order)
		answers[i] = stageAnswer{rank: s.rank, status: status, resp: resp, err: err, outcome: classify(status, resp, err)}
	}
	return w.recordCall(c, cl, order, mode, trigger, answers, noChunkInFlight(targets, reread))
}

// admit runs the rails that need no I/O: the mode, one dry run per
// request, a blocked or lever-less stage, the budget. It returns the mode
// to act in, or ok false and the events of a skip.
func (w *Watchdog) admit(c candidate, trigger string, asAuto bool) (Mode, []Event, bool) {
	mode := w.Mode()
	if asAuto && mode != ModeOff {
		mode = ModeAuto
	}
	if mode == ModeOff {
		return mode, w.skip(c, SkipModeOff, trigger, "force-fail mode is off"), false
	}
	if mode == ModeDryRun && w.dryRan(c) {
		return mode, nil, false
	}
	if c.blocked != "" {
		return mode, w.skip(c, SkipSourceDown, trigger, "a stage of the request's DP rank is down or its loop is wedged: "+c.blocked), false
	}
	for _, s := range c.stages {
		if s.unsupported {
			return mode, w.skip(c, SkipUnsupported, trigger, "no lever works on "+s.rank.status.target+": "+s.leverNote), false
		}
	}
	if missing := missingDecodeStages(c); missing != "" {
		return mode, w.skip(c, SkipSourceDown, trigger, missing), false
	}
	// A request over its budget costs nothing: no verdict lookup, no
	// re-read. This matters on decode, where a flood of stranded requests
	// may all be candidates in one cycle.
	if !w.callAvailable(c.budget()) {
		return mode, w.skip(c, SkipRateLimited, trigger, w.limitDetail(c.budget())), false
	}
	return mode, nil, true
}

// missingDecodeStages names what keeps a decode request from being
// released on every PP stage of its DP rank, or "". SGLang's PP decode loop
// lets a transfer-queue request go only once every stage's poll is Success
// or Failed, and then each stage takes its own branch
// (SchedulerPPMixin._pp_pd_get_decode_transferred_ids and
// process_decode_transfer_queue, managers/scheduler_pp_mixin.py, v0.5.10
// to v0.5.18): released on some stages only, it stays queued on all, and
// once the others finish, they decode a request whose pages the released
// stages freed. So a decode release goes to every stage or to none.
func missingDecodeStages(c candidate) string {
	if c.key.role != RoleDecode || len(c.stages) >= c.ppSize {
		return ""
	}
	held := make([]string, len(c.stages))
	for i, s := range c.stages {
		held[i] = fmt.Sprintf("pp%d", s.rank.ppLabel)
	}
	return fmt.Sprintf("the DP rank has %d PP stages and only [%s] are watched and list the request: a decode request is released on every stage or on none",
		c.ppSize, strings.Join(held, " "))
}

// reread reads every stage again: the request must be there, unchanged,
// right before the call, and progress that arrived since the decision
// cancels it. It returns the stages that still hold the request with
// their entries, or nil targets and the events of a skip.
func (w *Watchdog) reread(ctx context.Context, c candidate, trigger string) (targets []stageView, reread []entry, skipped []Event) {
	for _, s := range c.stages {
		l, err := s.rank.source.Inflight(ctx)
		if err != nil {
			return nil, nil, w.skip(c, SkipSourceDown, trigger, "re-reading the listing of "+s.rank.status.target+" failed: "+err.Error())
		}
		if l.Server.Levers != nil && len(l.Server.Levers) == 0 {
			return nil, nil, w.skip(c, SkipUnsupported, trigger, "no lever works on "+s.rank.status.target+": "+l.Server.LeverNote)
		}
		if roleOf(l) != c.key.role {
			return nil, nil, w.skip(c, SkipSourceDown, trigger, s.rank.status.target+" changed its disaggregation mode since the decision")
		}
		now := findEntry(l, c.key.roomKey)
		if now == nil {
			if c.key.role == RoleDecode {
				// Called on the others alone, it would be released on some stages only.
				return nil, nil, w.skip(c, SkipProgressed, trigger, s.rank.status.target+": the request left this stage's listing since the decision")
			}
			continue
		}
		if now.poll != s.poll || now.progress != s.progress || now.health || now.waitingMemory || l.Loop.Iterations < s.iterations ||
			l.Server.PID != s.pid || (now.inFlight != nil && *now.inFlight != s.inFlight) || now.dqueue != s.dqueue || now.started != s.started {
			return nil, nil, w.skip(c, SkipProgressed, trigger, fmt.Sprintf("%s: poll %s→%s, progress %d→%d since the decision", s.rank.status.target, s.poll, now.poll, s.progress, now.progress))
		}
		targets = append(targets, s)
		reread = append(reread, *now)
	}
	if len(targets) == 0 {
		return nil, nil, w.skip(c, SkipGone, trigger, "the request left the listing before the call")
	}
	return targets, reread, nil
}

// callClaim is a request this actuator is calling for, with the baseline of
// the counter that confirms its release.
type callClaim struct {
	st       *reqState
	family   string
	baseline float64
	age      float64
}

// claim marks the request as being acted on, unless it is done or another
// call is under way. The baseline for confirming the release is taken
// before the call: a /metrics read landing between the release and the
// answer would otherwise already count it, and the counter would never
// rise past it.
func (w *Watchdog) claim(c candidate, e *entry) (callClaim, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.request(c.key)
	if st.done || st.acting {
		return callClaim{}, false
	}
	st.acting = true
	cl := callClaim{st: st, family: failureFamily(e), age: e.age}
	if w.metrics != nil {
		cl.baseline, _ = w.metrics.counter(cl.family)
	}
	return cl, true
}

// forceFailReason is the reason the plugin records with the failure.
func (w *Watchdog) forceFailReason(c candidate, e *entry) string {
	if c.early {
		return fmt.Sprintf("sglang-watchdog: decode request %.0fs in the %s queue in %s, released early: its prefill side was released with its transfer stopped", e.age, e.dqueue, c.poll)
	}
	if c.key.role == RoleDecode {
		return fmt.Sprintf("sglang-watchdog: decode request stuck %.0fs in the %s queue in %s with no progress for %s", e.age, e.dqueue, c.poll, w.cfg.StallWindow)
	}
	return fmt.Sprintf("sglang-watchdog: stuck %.0fs in %s with no progress for %s", e.age, c.poll, w.cfg.StallWindow)
}

// recordCall settles the request's state from the stages' answers: a set
// lever awaits confirmation (and enters the verdict ledger on prefill), an
// error or a group_unwatched refusal is retried with backoff up to
// MaxAttempts calls in all, a dry run is not repeated. It logs the call and
// returns its event. stopped: no chunk of the room was in flight, on any
// stage, at the decision nor at the re-read.
func (w *Watchdog) recordCall(c candidate, cl callClaim, order pluginapi.ForceFailRequest, mode Mode, trigger string, answers []stageAnswer, stopped bool) []Event {
	result := combine(answers)
	at := w.clock.Now()

	w.mu.Lock()
	defer w.mu.Unlock()
	st := cl.st
	st.acting = false
	st.lastSkip = ""
	logger := level.Info(w.logger)
	if result != outAwait && result != ResultWouldFlip {
		logger = level.Error(w.logger)
	}
	fields := []interface{}{"msg", "force-fail call", "role", c.key.role, "rid", c.key.rid, "room", c.key.room, "target", c.rank.status.target,
		"dp_rank", c.rank.dpLabel, "pp_rank", c.rank.ppLabel, "age", fmt.Sprintf("%.1f", cl.age), "poll", c.poll,
		"progress", c.progress, "mode", mode, "trigger", trigger, "reason", order.Reason}
	if c.key.role == RoleDecode {
		fields = append(fields, "prefill_stopped", order.PrefillStopped)
	}
	ev := Event{Kind: EventForceFail, Role: c.key.role, Target: c.rank.status.target, DPRank: c.rank.dpLabel, PPRank: c.rank.ppLabel,
		RID: c.key.rid, Room: c.key.room, Age: cl.age, Poll: c.poll, Progress: c.progress, Trigger: trigger}
	if len(answers) == 1 {
		fields = append(fields, answerFields(answers[0])...)
	} else {
		ev.Stages = stageDetail(answers)
		fields = append(fields, "stages", ev.Stages)
	}
	switch result {
	case outAwait:
		st.done = true
		var called []*rankState
		for _, a := range answers {
			called = append(called, a.rank)
		}
		w.pending = append(w.pending, &pending{key: c.key, rank: c.rank, stages: called, trigger: trigger, at: at, family: cl.family, baseline: cl.baseline, age: cl.age, poll: c.poll})
		if c.key.role == RolePrefill {
			w.ledger.add(c.key.roomKey, at, stopped)
		}
		// The plugin's word for a set lever (flipped or already_failed).
		ev.Result = pluginapi.ResultFlipped
		if len(answers) == 1 {
			ev.Result = answers[0].resp.Result
		}
		logger.Log(append(fields, "result", "awaiting_confirmation")...)
		return []Event{ev}
	case ResultError, ResultGroupUnwatched:
		// A stale peer file (a starved publisher thread, a wall-clock
		// step, a full /dev/shm) may be fresh again soon, and the room
		// still stuck: group_unwatched shares the error rail's bound.
		st.attempts++
		if st.attempts >= w.cfg.MaxAttempts {
			st.done = true
			if result == ResultGroupUnwatched {
				result = ResultRejected
			}
		} else {
			st.nextAttempt = at.Add(w.cfg.RetryBackoff << (st.attempts - 1))
			if result == ResultGroupUnwatched {
				logger = level.Warn(w.logger)
			}
		}
		fields = append(fields, "attempts", st.attempts, "retry", !st.done)
	case ResultWouldFlip:
		st.dryRan = true
	default:
		st.done = true
	}
	w.forceFails[[3]string{result, trigger, c.key.role}]++
	ev.Result = result
	logger.Log(append(fields, "result", result)...)
	return []Event{ev}
}

// answerFields are the log fields of a single stage's answer.
func answerFields(a stageAnswer) []interface{} {
	fields := []interface{}{"http_status", a.status}
	if a.resp != nil {
		fields = append(fields, "plugin_result", a.resp.Result, "lever", a.resp.Lever, "levers", strings.Join(a.resp.Levers, ","))
		if a.resp.Error != "" {
			fields = append(fields, "plugin_error", a.resp.Error)
		}
	}
	if a.err != nil {
		fields = append(fields, "err", a.err)
	}
	return fields
}

// failureFamily is the SGLang counter that a release of the request
// raises: decode's prealloc queue counts bootstrap failures, everything
// else transfer failures.
func failureFamily(e *entry) string {
	if e.dqueue == pluginapi.DecodeQueuePrealloc {
		return BootstrapFailedFamily
	}
	return TransferFailedFamily
}

// noChunkInFlight tells whether the plugin reported no chunk of the room
// in flight on every stage, both at the decision and at the re-read, from
// a backend whose in-flight chunks it can see (transfer_tracking): an
// untracked false only means the backend exposes nothing.
func noChunkInFlight(stages []stageView, reread []entry) bool {
	for i, s := range stages {
		if !s.tracked || !reread[i].tracked || !s.inFlightKnown || s.inFlight || reread[i].inFlight == nil || *reread[i].inFlight {
			return false
		}
	}
	return true
}

func stageDetail(answers []stageAnswer) string {
	parts := make([]string, len(answers))
	for i, a := range answers {
		res := a.outcome
		if a.resp != nil {
			res = a.resp.Result
		}
		parts[i] = fmt.Sprintf("pp%d=%s(%d)", a.rank.ppLabel, res, a.status)
		if a.resp != nil && len(a.resp.Levers) > 0 {
			parts[i] += "[" + strings.Join(a.resp.Levers, ",") + "]"
		}
		if a.err != nil {
			parts[i] += ": " + a.err.Error()
		} else if a.resp != nil && a.resp.Error != "" {
			parts[i] += ": " + a.resp.Error
		}
	}
	return strings.Join(parts, " ")
}

// dryRan tells whether the request already had its dry run: a dry run is
// made once per request, and a switch to auto mode may still act on it.
func (w *Watchdog) dryRan(c candidate) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.requests[c.key]
	return st != nil && st.dryRan
}

// classify maps one stage's answer to an outcome.
func classify(status int, resp *pluginapi.ForceFailResponse, err error) string {
	if err != nil || resp == nil {
		return ResultError
	}
	switch {
	case status == http.StatusOK && (resp.Result == pluginapi.ResultFlipped || resp.Result == pluginapi.ResultAlreadyFailed):
		return outAwait
	case status == http.StatusOK && resp.Result == pluginapi.ResultWouldFlip:
		return ResultWouldFlip
	case status == http.StatusNotFound:
		return ResultNotFound
	case status == http.StatusNotImplemented:
		return ResultUnsupported
	case status == http.StatusConflict && resp.Result == pluginapi.ResultTransferSucceeded:
		return outSucceeded
	case status == http.StatusConflict && resp.Result == pluginapi.ResultGroupUnwatched:
		return ResultGroupUnwatched
	case status == http.StatusBadRequest || status == http.StatusUnauthorized || status == http.StatusConflict:
		return ResultRejected
	default:
		return ResultError
	}
}

// combine reports a request's stages as one result. Any stage that failed
// or refused decides it (the request is not released while one stage holds
// it); otherwise a set lever awaits confirmation. A stage whose transfer
// succeeded is terminal already, so beside a set lever it does not stop
// the release; alone it is a refusal (the request releases itself).
func combine(answers []stageAnswer) string {
	has := map[string]bool{}
	for _, a := range answers {
		has[a.outcome] = true
	}
	for _, o := range []string{ResultError, ResultUnsupported, ResultRejected, ResultGroupUnwatched, ResultWouldFlip, outAwait} {
		if has[o] {
			return o
		}
	}
	if has[outSucceeded] {
		return ResultRejected
	}
	return ResultNotFound
}

func (w *Watchdog) limitDetail(b budget) string {
	switch b {
	case budgetFailFast:
		return fmt.Sprintf("%d new wedge orders in the last minute already", w.cfg.FailFastPerMinute)
	case budgetDecode:
		return fmt.Sprintf("%d decode releases in the last minute already", w.cfg.DecodePerMinute)
	}
	return fmt.Sprintf("%d force-fail requests in the last minute already", w.cfg.MaxPerMinute)
}

// callAvailable tells whether budget b would let a request through now,
// without taking the slot. Caller holds w.act.
func (w *Watchdog) callAvailable(b budget) bool {
	limit := w.cfg.MaxPerMinute
	switch b {
	case budgetFailFast:
		limit = w.cfg.FailFastPerMinute
	case budgetDecode:
		limit = w.cfg.DecodePerMinute
	}
	now := w.clock.Now()
	kept := w.callTimes[b][:0]
	for _, t := range w.callTimes[b] {
		if now.Sub(t) < time.Minute {
			kept = append(kept, t)
		}
	}
	w.callTimes[b] = kept
	return len(kept) < limit
}

// allowCall takes a slot of budget b over any 60 s. A request takes one
// slot however many PP stages it is called on. Caller holds w.act.
func (w *Watchdog) allowCall(b budget) bool {
	if !w.callAvailable(b) {
		return false
	}
	w.callTimes[b] = append(w.callTimes[b], w.clock.Now())
	return true
}

// skip counts a reason once per request, so that a request waiting out the
// rate limit is not counted every cycle. An early candidate is not stuck:
// what keeps it is only logged at debug level, and counted once it is.
func (w *Watchdog) skip(c candidate, reason, trigger, detail string) []Event {
	if c.early {
		level.Debug(w.logger).Log("msg", "decode request not released early", "rid", c.key.rid, "room", c.key.room, "target", c.rank.status.target,
			"dp_rank", c.rank.dpLabel, "pp_rank", c.rank.ppLabel, "age", fmt.Sprintf("%.1f", c.age), "poll", c.poll, "skip", reason, "trigger", trigger, "reason", detail)
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.request(c.key)
	st.lastSkip = reason
	if st.skipped == nil {
		st.skipped = map[string]bool{}
	}
	if st.skipped[reason] {
		return nil
	}
	st.skipped[reason] = true
	w.skips[[2]string{reason, c.key.role}]++
	level.Warn(w.logger).Log("msg", "stuck request not force-failed", "role", c.key.role, "rid", c.key.rid, "room", c.key.room, "target", c.rank.status.target,
		"dp_rank", c.rank.dpLabel, "pp_rank", c.rank.ppLabel, "age", fmt.Sprintf("%.1f", c.age), "poll", c.poll,
		"skip", reason, "trigger", trigger, "reason", detail)
	return []Event{{Kind: EventSkipped, Role: c.key.role, Target: c.rank.status.target, DPRank: c.rank.dpLabel, PPRank: c.rank.ppLabel,
		RID: c.key.rid, Room: c.key.room, Age: c.age, Poll: c.poll, Progress: c.progress, Reason: reason, Trigger: trigger}}
}

// confirm settles pending releases: released once the request left every
// stage's listing and SGLang's transfer-failed counter rose past its value
// at the call; unconfirmed after the confirm timeout. One rise confirms one
// release: k releases pending on one counter need a rise of k, oldest
// baseline first. Caller holds w.mu.
func (w *Watchdog) confirm(now time.Time) []Event {
	var events []Event
	if w.metrics != nil {
		for fam, claimed := range w.claimed {
			if v, ok := w.metrics.counter(fam); ok && w.metrics.status.up && v < claimed {
				// SGLang restarted and its counter began again.
				w.claimed[fam] = v
			}
		}
	}
	sort.SliceStable(w.pending, func(i, j int) bool { return w.pending[i].baseline < w.pending[j].baseline })
	kept := w.pending[:0]
	for _, p := range w.pending {
		gone := p.gone()
		rose := true
		if w.metrics != nil {
			v, ok := w.metrics.counter(p.family)
			rose = ok && w.metrics.status.up && v-max(p.baseline, w.claimed[p.family]) >= 1
		}
		ev := Event{Role: p.key.role, Target: p.rank.status.target, DPRank: p.rank.dpLabel, PPRank: p.rank.ppLabel, RID: p.key.rid, Room: p.key.room, Age: p.age, Poll: p.poll, Trigger: p.trigger}
		switch {
		case gone && rose:
			if w.metrics != nil {
				w.claimed[p.family] = max(p.baseline, w.claimed[p.family]) + 1
			}
			w.forceFails[[3]string{ResultReleased, p.trigger, p.key.role}]++
			ev.Kind, ev.Result = EventReleased, ResultReleased
			level.Info(w.logger).Log("msg", "release confirmed", "role", p.key.role, "counter", p.family, "rid", p.key.rid, "room", p.key.room, "target", p.rank.status.target,
				"dp_rank", p.rank.dpLabel, "pp_rank", p.rank.ppLabel, "stages", len(p.stages), "age", fmt.Sprintf("%.1f", p.age), "poll", p.poll, "trigger", p.trigger,
				"after", now.Sub(p.at).Round(time.Millisecond))
			events = append(events, ev)
		case now.Sub(p.at) >= w.cfg.ConfirmTimeout:
			w.forceFails[[3]string{ResultUnconfirmed, p.trigger, p.key.role}]++
			ev.Kind, ev.Result = EventUnconfirmed, ResultUnconfirmed
			level.Error(w.logger).Log("msg", "release not confirmed", "role", p.key.role, "counter", p.family, "rid", p.key.rid, "room", p.key.room, "target", p.rank.status.target,
				"dp_rank", p.rank.dpLabel, "pp_rank", p.rank.ppLabel, "stages", len(p.stages), "age", fmt.Sprintf("%.1f", p.age), "poll", p.poll, "trigger", p.trigger,
				"left_listing", gone, "counter_rose", rose, "reason", "lever set but release not seen within the confirm timeout (one counter rise per release)")
			events = append(events, ev)
		default:
			if gone {
				// The request is gone; only the counter is missing. Ask for
				// an early /metrics read rather than wait a full interval.
				select {
				case w.scrapeNow <- struct{}{}:
				default:
				}
			}
			kept = append(kept, p)
		}
	}
	w.pending = kept
	return events
}

// TriggerRank force-fails the stuck requests of one rank on behalf of a
// firing alert, through the same rails as auto mode. It returns how many
// stuck requests it walked through the rails.
func (w *Watchdog) TriggerRank(ctx context.Context, dpRank, ppRank int) (int, error) {
	w.mu.Lock()
	if w.mode == ModeOff {
		w.mu.Unlock()
		return 0, fmt.Errorf("force-fail mode is off")
	}
	found := false
	for _, rk := range w.ranks {
		if rk.listed && rk.dpLabel == dpRank && rk.ppLabel == ppRank {
			found = true
		}
	}
	// The alert is about stuck requests; early ones are the cycles' own.
	cands := slices.DeleteFunc(w.candidates(w.clock.Now(), func(rk *rankState) bool { return rk.dpLabel == dpRank && rk.ppLabel == ppRank }),
		func(c candidate) bool { return c.early })
	w.mu.Unlock()
	if !found {
		return 0, fmt.Errorf("no plugin rank with dp_rank %d and pp_rank %d", dpRank, ppRank)
	}
	w.actuate(ctx, cands, TriggerAlert, true, time.Time{})
	return len(cands), nil
}

// --- Wedge orders -------------------------------------------------------------

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
		if !rk.status.up || rk.wedged || !rk.loopAdvancing || !rk.progress || rk.unsupported() {
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
