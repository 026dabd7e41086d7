package watchdog

import (
	"fmt"
	"slices"
	"time"

	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// KV manager threads (issue 24). SGLang starts threads in each KV manager
// and never looks at them again: prefill's bootstrap_thread, which reads
// decode's frames, one transfer_worker per transfer queue, decode's
// decode_thread and heartbeat_checker (SGLang v0.5.18:
// disaggregation/mooncake/conn.py, disaggregation/nixl/conn.py). One that
// raises dies silently: a dead transfer worker never drains its queue
// again (Mooncake's transfer_worker re-raises what it does not handle), a
// dead bootstrap thread leaves every later request in the bootstrap queue
// (NIXL from v0.5.11 to v0.5.18 asserts on decode's ABORT frame, "First
// message should be b'NixlMsgGuard'"), a dead decode_thread leaves every
// decode request short of Success. Nothing of that process recovers it:
// a dead thread is a wedge of its own.

// threadKey names one KV thread of a rank across listings.
type threadKey struct {
	role, function string
	queue          int // unknownQueue unless a transfer_worker's queue is known
}

func keyOf(th *pluginapi.KVThread) threadKey {
	k := threadKey{role: th.Role, function: th.Function, queue: unknownQueue}
	if th.Role == pluginapi.ThreadTransferWorker {
		k.queue = queueIndex(th.TransferQueue)
	}
	return k
}

// String names the thread in logs and restart reasons.
func (k threadKey) String() string {
	if k.queue != unknownQueue {
		return fmt.Sprintf("%s %s of transfer queue %d", k.role, k.function, k.queue)
	}
	return k.role + " " + k.function
}

// observeThreads folds a listing's kv_threads into the rank: which are
// dead, and since when this watchdog has seen each dead. A listing
// without kv_threads says nothing of them (an older plugin): the rank
// then has no verdict on its threads, never a dead one.
func observeThreads(rk *rankState, listed []pluginapi.KVThread, now time.Time) {
	rk.threadsKnown = listed != nil
	dead := make(map[threadKey]bool, len(rk.deadSince))
	for i := range listed {
		if th := &listed[i]; !th.Alive {
			dead[keyOf(th)] = true
		}
	}
	for k := range rk.deadSince {
		if !dead[k] {
			delete(rk.deadSince, k)
		}
	}
	for k := range dead {
		if _, ok := rk.deadSince[k]; !ok {
			rk.deadSince[k] = now
		}
	}
}

// deadWorker tells whether the transfer worker of queue q is dead as of
// the last listing.
func (rk *rankState) deadWorker(q int) bool {
	if q == unknownQueue {
		return false
	}
	for k := range rk.deadSince {
		if k.role == pluginapi.ThreadTransferWorker && k.queue == q {
			return true
		}
	}
	return false
}

// deadThreads counts the rank's dead threads by role, every
// pluginapi.ThreadRoles value present; nil when the plugin does not
// report its threads.
func (rk *rankState) deadThreads() map[string]int {
	if !rk.threadsKnown {
		return nil
	}
	out := make(map[string]int, len(pluginapi.ThreadRoles))
	for _, role := range pluginapi.ThreadRoles {
		out[role] = 0
	}
	for k := range rk.deadSince {
		out[k.role]++
	}
	return out
}

// deadThreadEscalates picks the dead thread that makes the rank a restart
// candidate: one of a role that serves requests (threadServes), seen
// dead by this watchdog for the stall
// window, first in pluginapi.ThreadRoles order. A thread's aliveness is
// read when the listing is served, so unlike a chunk's progress it needs
// no running loop to be fresh.
func deadThreadEscalates(rk *rankState, now time.Time, cfg *Config) (threadKey, time.Time, bool) {
	var (
		best  threadKey
		since time.Time
		found bool
	)
	// The map's order is random; the log and the restart reason must
	// not be.
	before := func(a, b threadKey) bool {
		if ra, rb := slices.Index(pluginapi.ThreadRoles, a.role), slices.Index(pluginapi.ThreadRoles, b.role); ra != rb {
			return ra < rb
		}
		if a.queue != b.queue {
			return a.queue < b.queue
		}
		return a.function < b.function
	}
	for k, t := range rk.deadSince {
		if !threadServes(k.role) || now.Sub(t) < cfg.StallWindow {
			continue
		}
		if !found || before(k, best) {
			best, since, found = k, t, true
		}
	}
	return best, since, found
}

// threadServes tells whether requests stop being served without a thread
// of this role: a dead heartbeat checker only stops SGLang noticing dead
// peers, and an "other" thread may not matter at all, so neither restarts
// the server (their alert is a warning, not a page).
func threadServes(role string) bool {
	return role != pluginapi.ThreadOther && role != pluginapi.ThreadHeartbeat
}

// threadDeadEvidence tells whether a re-read listing still shows the
// thread dead.
func threadDeadEvidence(l *pluginapi.Listing, k threadKey) bool {
	for i := range l.KVThreads {
		if th := &l.KVThreads[i]; keyOf(th) == k && !th.Alive {
			return true
		}
	}
	return false
}

// evaluateThreads logs each KV thread newly seen dead, and each seen
// alive again. Caller holds w.mu.
func (w *Watchdog) evaluateThreads(rk *rankState) []Event {
	var events []Event
	for k := range rk.deadSince {
		if rk.deadLogged[k] {
			continue
		}
		rk.deadLogged[k] = true
		level.Error(w.logger).Log("msg", "KV manager thread dead: nothing in SGLang restarts it; only a restart of the server does", "target", rk.status.target,
			"role", rk.role, "dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "pid", rk.server.PID, "thread", k.role, "function", k.function, "transfer_queue", k.queue,
			"effect", threadEffect(k))
		events = append(events, Event{Kind: EventKVThreadDead, Role: rk.role, Target: rk.status.target, DPRank: rk.dpLabel, PPRank: rk.ppLabel,
			Queue: k.queue, Reason: k.role})
	}
	for k := range rk.deadLogged {
		if _, ok := rk.deadSince[k]; !ok {
			delete(rk.deadLogged, k)
			level.Info(w.logger).Log("msg", "KV manager thread no longer listed dead", "target", rk.status.target, "role", rk.role,
				"dp_rank", rk.dpLabel, "pp_rank", rk.ppLabel, "pid", rk.server.PID, "thread", k.role, "function", k.function, "transfer_queue", k.queue)
		}
	}
	return events
}

// threadEffect says, for the log, what a dead thread of that role does to
// the requests.
func threadEffect(k threadKey) string {
	switch k.role {
	case pluginapi.ThreadBootstrap:
		return "no new request gets past the bootstrap queue"
	case pluginapi.ThreadTransferWorker:
		return "the rooms queued on its transfer queue are never sent; they are force-failed past the deadline"
	case pluginapi.ThreadDecodeListener:
		return "no decode request hears that its KV arrived"
	case pluginapi.ThreadHeartbeat:
		return "a prefill peer that dies is no longer noticed"
	}
	return "unknown"
}
