package watchdog

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"time"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Restart escalation: a transfer worker wedged on a handle that never
// completes has no in-process fix (SGLang v0.5.18,
// python/sglang/srt/disaggregation/nixl/conn.py: NixlKVManager.transfer_worker
// polls its handles with no deadline), and SGLang's own answer to a
// scheduler it cannot recover is to end the server so that the orchestrator
// restarts it (run_scheduler_process in managers/scheduler.py sends SIGQUIT
// to its parent process; the plugin sends it to SGLang's launcher, the top of
// the tree, since under DP the parent is the DataParallelController, which
// has no SIGQUIT handler). The watchdog asks the plugin to do the same,
// only for an actionable wedge (a chunk overdue for its size at the link's
// measured speed, its room past the deadline: wedgeActionable) that held
// for the restart window (the stall window) and that a re-read still
// shows, at most once per RestartMinInterval for the pod and never twice
// for the same process. A wedge diagnosed without transfer_progress is
// never escalated: those rules take a slow healthy chunk for a wedge.
//
// A KV manager thread that died (threads.go) is escalated the same way,
// under the same mode, interval and once-per-process rules: one of a role
// that serves requests, seen dead for the stall window and still dead on
// re-read. Nothing in the process starts it again.

// procKey names one scheduler process: a restart that reuses the pid is
// still a new process (rankState.gen).
type procKey struct {
	target string
	pid    int
	gen    uint64
}

// escalation is a rank whose diagnosed wedge, or dead KV thread, may be
// escalated.
type escalation struct {
	rank       *rankState
	proc       procKey
	iterations uint64
	queue      int
	wedge      transferWedge
	mode       Mode
	// thread is set for a dead KV thread (wedge is then zero), dead
	// since deadSince as this watchdog saw it.
	thread    *threadKey
	deadSince time.Time
}

// Reason of a restart event for a dead KV thread (for a wedge it is the
// wedge's rule).
const ruleThreadDead = "kv_thread_dead"

// evidence tells whether a re-read listing still shows what the
// escalation was decided on.
func (e *escalation) evidence(l *pluginapi.Listing) bool {
	if e.thread != nil {
		return threadDeadEvidence(l, *e.thread)
	}
	return wedgeEvidence(l, e.queue, e.wedge.chunk)
}

// fields are the escalation's log fields, what it was decided on.
func (e *escalation) fields() []interface{} {
	if e.thread != nil {
		return []interface{}{"thread", e.thread.role, "function", e.thread.function, "transfer_queue", e.thread.queue, "rule", ruleThreadDead}
	}
	return []interface{}{"transfer_queue", e.queue, "chunk", e.wedge.chunk, "rule", e.wedge.rule, "room", e.wedge.room}
}

// reason is what the plugin records with the restart.
func (e *escalation) reason(now time.Time) string {
	if e.thread != nil {
		return fmt.Sprintf("sglang-watchdog: KV manager thread %s dead for %s", e.thread, now.Sub(e.deadSince).Round(time.Second))
	}
	return fmt.Sprintf("sglang-watchdog: transfer queue %d wedged (%s, chunk %d of room %d) for %s", e.queue, e.wedge.rule, e.wedge.chunk, e.wedge.room, now.Sub(e.wedge.since).Round(time.Second))
}

// restartCandidate picks the rank to restart this cycle, if any. Caller
// holds w.mu.
func (w *Watchdog) restartCandidate() *escalation {
	mode := w.restartMode
	if mode == ModeOff {
		return nil
	}
	if mode == ModeAuto && !w.lastRestart.IsZero() && w.clock.Now().Sub(w.lastRestart) < w.cfg.RestartMinInterval {
		return nil
	}
	now := w.clock.Now()
	for _, rk := range w.ranks {
		if !rk.status.up {
			continue
		}
		proc := procKey{target: rk.status.target, pid: rk.server.PID, gen: rk.gen}
		if done, ok := w.restarted[proc]; ok && modeRank(done) >= modeRank(mode) {
			continue
		}
		if k, since, ok := deadThreadEscalates(rk, now, &w.cfg); ok {
			return &escalation{rank: rk, proc: proc, iterations: rk.iterations, queue: k.queue, mode: mode, thread: &k, deadSince: since}
		}
		if rk.wedged || !rk.loopAdvancing {
			continue
		}
		queues := make([]int, 0, len(rk.wedges))
		for q, tw := range rk.wedges {
			if wedgeActionable(tw) && w.clock.Now().Sub(tw.since) >= w.cfg.StallWindow {
				queues = append(queues, q)
			}
		}
		if len(queues) == 0 {
			continue
		}
		sort.Ints(queues)
		return &escalation{rank: rk, proc: proc, iterations: rk.iterations, queue: queues[0], wedge: *rk.wedges[queues[0]], mode: mode}
	}
	return nil
}

// restart re-reads the rank and, if the wedge's evidence is still there
// in the same process, asks the plugin to end it.
func (w *Watchdog) restart(ctx context.Context, e *escalation) []Event {
	w.act.Lock()
	defer w.act.Unlock()
	rk := e.rank
	l, err := rk.source.Inflight(ctx)
	if err != nil {
		level.Warn(w.logger).Log("msg", "restart not requested: re-reading the listing failed", "target", rk.status.target, "err", err)
		return nil
	}
	if l.Server.PID != e.proc.pid || l.Loop.Iterations < e.iterations || !e.evidence(l) {
		level.Info(w.logger).Log(append([]interface{}{"msg", "restart not requested: the evidence is gone on re-read", "target", rk.status.target,
			"pid", l.Server.PID}, e.fields()...)...)
		return nil
	}
	dry := e.mode == ModeDryRun
	reason := e.reason(w.clock.Now())
	var (
		status int
		resp   *pluginapi.RestartResponse
	)
	r, ok := rk.source.(Restarter)
	// The restart is recorded before it is asked for: a watchdog that
	// crashes right after must still wait out the interval. A restart that
	// cannot be recorded is not asked for.
	var saveErr error
	if ok && !dry && w.cfg.RestartStateFile != "" {
		saveErr = saveRestartState(w.cfg.RestartStateFile, stateOf(w.clock.Now(), e.proc.pid))
	}
	if ok && saveErr == nil {
		status, resp, err = r.Restart(ctx, pluginapi.RestartRequest{PID: e.proc.pid, Reason: reason, DryRun: dry})
	}
	result := classifyRestart(ok, status, resp, errors.Join(saveErr, err))

	w.mu.Lock()
	defer w.mu.Unlock()
	// One call per process and mode, whatever the answer: a timeout may
	// hide a restart under way, and a refusal will not change for this
	// process. A dry run leaves room for one real call after a switch to
	// auto.
	w.restarted[e.proc] = e.mode
	if !dry {
		w.lastRestart = w.clock.Now()
	}
	w.restarts[result]++
	fields := append([]interface{}{"msg", "restart escalation", "target", rk.status.target, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel,
		"pid", e.proc.pid}, e.fields()...)
	fields = append(fields, "mode", e.mode, "http_status", status, "result", result, "reason", reason)
	if resp != nil && resp.Error != "" {
		fields = append(fields, "plugin_error", resp.Error)
	}
	if err := errors.Join(saveErr, err); err != nil {
		fields = append(fields, "err", err)
	}
	switch result {
	case RestartWouldRestart:
		level.Warn(w.logger).Log(fields...)
	case RestartTooSoon:
		// The plugin's own floor held, as designed (typically after this
		// watchdog lost its memory of the last restart): a warning, not an
		// error. As after any answer, this process is not asked again.
		level.Warn(w.logger).Log(append(fields, "retry_after_s", resp.RetryAfterS)...)
	default:
		level.Error(w.logger).Log(fields...)
	}
	rule := e.wedge.rule
	if e.thread != nil {
		rule = ruleThreadDead
	}
	return []Event{{Kind: EventRestart, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel, Room: e.wedge.room,
		Queue: e.queue, Result: result, Reason: rule}}
}

// wedgeEvidence tells whether a listing still shows the wedged chunk in
// the hands of queue's worker: the worker took nothing since.
func wedgeEvidence(l *pluginapi.Listing, queue int, chunk int64) bool {
	for _, tw := range l.TransferWorkers {
		if tw.TransferQueue == queue {
			return tw.InFlight != nil && tw.InFlight.Chunk == chunk
		}
	}
	return false
}

func classifyRestart(supported bool, status int, resp *pluginapi.RestartResponse, err error) string {
	switch {
	case !supported || status == http.StatusNotFound:
		return RestartUnsupported
	case status == http.StatusNotImplemented && resp != nil && resp.Result == pluginapi.ResultRestartUnsupported:
		return RestartUnsupported
	case err != nil || resp == nil:
		return RestartError
	case status == http.StatusAccepted && resp.Result == pluginapi.ResultRestarting:
		return RestartRestarted
	case status == http.StatusOK && resp.Result == pluginapi.ResultWouldRestart:
		return RestartWouldRestart
	case status == http.StatusForbidden:
		return RestartDisabled
	case status == http.StatusBadRequest || status == http.StatusUnauthorized || status == http.StatusConflict:
		return RestartRejected
	case status == http.StatusTooManyRequests && resp.Result == pluginapi.ResultTooSoon:
		return RestartTooSoon
	default:
		return RestartError
	}
}
