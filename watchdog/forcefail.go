package watchdog

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// The force-fail path takes one request through the rails: the mode,
// the decode safety rule, the re-read of every stage, the claim on the
// request, the call to every stage, and the record of their answers.

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
		if RoleOf(l) != c.key.role {
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
