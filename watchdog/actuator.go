package watchdog

import (
	"context"
	"sort"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// The actuator is the only code that changes anything outside this process.
// It acts on the verdicts of the cycle: this file picks the requests to act
// on (candidates) and walks them through the rails, one job per file: the
// force-fail path (forcefail.go: the mode, at most one successful call per
// request, bounded retries after errors, the re-read of every stage's
// listing right before the call), the rate limits (budget.go), the
// confirmation of the release and the alert trigger (confirm.go), wedge
// orders (wedgeorder.go) and the restart escalation (restart.go).

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
	prefillAddrs  []string
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
				tracked: rk.server.SeesEveryWriter(), dqueue: r.dqueue, started: r.started, age: r.age, addr: r.addr, prefillAddrs: r.prefillAddrs, pid: rk.server.PID, iterations: rk.iterations, unsupported: rk.unsupported(), leverNote: rk.server.LeverNote})
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
