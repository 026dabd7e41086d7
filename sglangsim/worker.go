package sglangsim

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// recentChunks is how many finished chunks a worker's listing keeps
// (round 4 transfer_workers recent, and finished).
const recentChunks = 32

// finishedChunk is one chunk the worker finished with pages: what the
// listing's finished and recent show of it.
type finishedChunk struct {
	number  int64 // as in_flight.chunk listed it
	pages   int
	seconds float64
	link    string
}

// worker is one transfer worker thread and its queue (SGLang v0.5.18:
// disaggregation/nixl/conn.py transfer_worker, mooncake/conn.py
// transfer_worker): it takes one chunk at a time off its queue, posts it
// and waits for its handles before it takes the next. The rooms' chunks
// are queued whole as each room enters the inflight queue, so the queue
// holds the rooms in that order; fifo[0] is the room whose chunk the
// worker holds.
type worker struct {
	fifo  []*sender
	clock time.Time // the worker's time has been played up to here

	taken   int64  // chunks_taken: chunks taken since the process started
	holding bool   // a chunk of fifo[0] is in the worker's hands
	pages   int    // the held chunk's pages
	last    bool   // the held chunk is its room's last
	link    string // the held chunk's destination
	since   time.Time

	// dying: the thread was killed (KillTransferWorker) and dies as it
	// lets go of the chunk it holds; dead: it has died, and takes no
	// chunk again.
	dying, dead bool

	// recent is a ring of the last finished chunks that carried pages.
	recent  [recentChunks]finishedChunk
	nRecent int
	head    int // where the next one goes
}

// take puts sd's next chunk in the worker's hands at `at`.
func (w *worker) take(sd *sender, at time.Time) {
	q := sd.q
	w.taken++
	w.holding = true
	w.pages = q.chunkPages(sd.taken)
	sd.taken++
	w.last = q.nChunks >= 0 && sd.taken == q.nChunks
	w.link = q.link
	w.since = at
}

// finish lets go of the held chunk at `at`, whatever became of it (sent,
// failed, skipped): the worker asks its queue for the next one.
func (w *worker) finish(at time.Time) {
	if !w.holding {
		return
	}
	w.holding = false
	if w.pages <= 0 {
		return // recent lists only chunks that carried pages
	}
	w.recent[w.head] = finishedChunk{number: w.taken, pages: w.pages, seconds: at.Sub(w.since).Seconds(), link: w.link}
	w.head = (w.head + 1) % recentChunks
	w.nRecent = min(w.nRecent+1, recentChunks)
}

// skipRest takes and drops every chunk of sd not taken yet, at once: the
// worker skips the chunks of a Failed room (SGLang v0.5.18:
// disaggregation/nixl/conn.py transfer_worker: check_status(room) ==
// Failed, continue), and a room released as Failed is one.
func (w *worker) skipRest(sd *sender, at time.Time) {
	for sd.taken < sd.q.nChunks {
		w.take(sd, at)
		w.finish(at)
	}
}

func (w *worker) pop() {
	n := copy(w.fifo, w.fifo[1:])
	w.fifo[n] = nil
	w.fifo = w.fifo[:n]
}

// chunkPages is the KV pages of the room's chunk i (page size 1: tokens):
// the prompt split evenly over its chunks; an endless transfer sends
// chunkTokens-page chunks.
func (q *request) chunkPages(i int64) int {
	if q.nChunks <= 0 {
		return min(q.prompt, chunkTokens)
	}
	n, p := q.nChunks, int64(q.prompt)
	return int(p*(i+1)/n - p*i/n)
}

// chunksQueued is how many of sd's chunks wait in its queue, not taken.
// An endless transfer lists none, an unregistered room (never queued) too.
func (sd *sender) chunksQueued() int {
	if sd.q.nChunks < 0 || (sd.pinned && sd.q.behavior == BehaviorPinAbortBeforeRegister) {
		return 0
	}
	return int(sd.q.nChunks - sd.taken)
}

// realTime is how long the worker takes for `work` of planned transfer
// time over a link at speed (a factor of the planned speed); -1: never.
func realTime(work time.Duration, speed float64) time.Duration {
	switch {
	case speed == 1:
		return work
	case speed <= 0:
		return -1
	}
	d := math.Ceil(float64(work) / speed)
	if d >= math.MaxInt64 {
		return -1 // longer than time.Duration holds: never, as far as anyone can tell
	}
	return time.Duration(d)
}

// workTime is the planned transfer time done in `real` at speed.
func workTime(real time.Duration, speed float64) time.Duration {
	if speed == 1 {
		return real
	}
	return time.Duration(float64(real) * max(speed, 0))
}

// xfer is one attention-TP rank's transfer side of a scheduler process:
// its KV manager's worker queues, the stuck handle each waits on, and the
// rooms released with a chunk still in flight. Every rank of the group has
// its own (SGLang v0.5.18: disaggregation/nixl/conn.py and mooncake/conn.py
// start transfer workers in each rank's KV manager).
type xfer struct {
	wedge   [TransferQueues]*sender // the stuck handle each worker waits on
	workers [TransferQueues]worker
	orphans []orphan
	links   links
}

// links are the speeds of one attention-TP rank's links to its decode
// destinations, each a factor of the planned speed: each TP rank writes to
// its own decode peer over its own link. A property of the network, so a
// restart keeps them.
type links struct {
	// queue is the speed of the destinations on each queue that have no
	// speed of their own (SetLinkSpeed).
	queue [TransferQueues]float64
	// dest is a destination's own speed, by decode port
	// (SetDestinationSpeed).
	dest map[int]float64
}

// speedOf is the speed of the link q's chunks take now.
func (l *links) speedOf(q *request) float64 {
	if v, ok := l.dest[q.decodePort]; ok {
		return v
	}
	return l.queue[q.queue]
}

// DestinationName is the name a backend's transfer_infos keys a decode
// destination by, as the plugin lists it for a link: Mooncake's decode
// session id (host:port); a NIXL decode agent's name (a uuid4 in SGLang
// v0.5.18: disaggregation/nixl/conn.py), made here from the port so that
// one endpoint keeps one name.
func DestinationName(backend string, port int) string {
	if backend == BackendMooncake {
		return fmt.Sprintf("127.0.0.1:%d", port)
	}
	return fmt.Sprintf("5eed0000-0000-4000-8000-%012d", port)
}

// xf is attention-TP rank tp's transfer side: the leader's (0) or a peer's.
func (r *rank) xf(tp int) *xfer {
	if tp == 0 {
		return &r.xfer
	}
	return r.peers[tp-1]
}

// runWorker plays the leader's queue qi up to now (see run).
func (r *rank) runWorker(qi int, now time.Time) { r.run(&r.xfer, qi, now) }

// run plays queue qi's worker of x up to now, chunk by chunk: the room at
// the head gets the worker's time until it is done, then the next; the
// rooms behind wait in WaitingForInput with nothing sent. A room's chunk i
// ends at pickup + (i+1) x chunkEvery of its planned transfer time (its
// first chunk includes the pickup), played at the speed of the room's link
// to its destination. A
// slow chunk holds every room behind it; a stuck handle holds them until
// the process restarts.
func (r *rank) run(x *xfer, qi int, now time.Time) {
	if qi < 0 {
		return
	}
	play(x, &x.workers[qi], &x.wedge[qi], func() { r.markBehind(x, qi) }, now)
}

// play plays worker w of x up to now (see run); wedge is where its stuck
// handle is kept, blocked marks the rooms behind one.
func play(x *xfer, w *worker, wedge **sender, blocked func(), now time.Time) {
	for w.clock.Before(now) {
		if w.dying && !w.holding {
			w.dead = true
		}
		if *wedge != nil || w.dead {
			blocked()
			w.clock = now
			return
		}
		if len(w.fifo) == 0 {
			w.clock = now
			return
		}
		sd := w.fifo[0]
		q := sd.q
		speed := x.links.speedOf(q)
		if !sd.started {
			sd.started = true
			w.take(sd, w.clock)
		}
		end := sd.doneAt()
		target := q.pickup + time.Duration(sd.taken)*q.chunkEvery // the held chunk's end
		if end >= 0 && end < target {
			target = end
		}
		if target > sd.work {
			need := realTime(target-sd.work, speed)
			if avail := now.Sub(w.clock); need < 0 || need > avail {
				sd.work += workTime(avail, speed)
				w.clock = now
				return
			}
			w.clock = w.clock.Add(need)
			sd.work = target
		}
		if end < 0 || target < end {
			// The held chunk settled; the room's next one, unless the
			// thread dies here.
			w.finish(w.clock)
			if !w.dying {
				w.take(sd, w.clock)
			}
			continue
		}
		if sd.pinned && q.behavior == BehaviorPinStuckHandle && !sd.statusFailed {
			// A handle that stays PROC: the worker takes chunk freezeAt and
			// waits on it with no deadline, whatever happens to the room
			// (SGLang v0.5.18: disaggregation/nixl/conn.py).
			if sd.taken <= q.freezeAt {
				w.finish(w.clock)
				w.take(sd, w.clock)
			}
			sd.progress = max(sd.progress, q.freezeAt)
			sd.frozen = true
			sd.outstanding = 1
			sd.wedging = true
			*wedge = sd
			continue
		}
		w.finish(w.clock)
		x.settleOrphan(sd, w.clock)
		w.skipRest(sd, w.clock)
		w.pop()
	}
}

// markBehind marks every room waiting behind queue qi's stuck handle of x,
// or on the queue of a dead worker, blocked: it will never be served.
// Callers hold r.mu.
func (r *rank) markBehind(x *xfer, qi int) {
	wd := x.wedge[qi]
	if wd == nil && !x.workers[qi].dead {
		return
	}
	for _, sd := range x.workers[qi].fifo {
		if sd != wd && !sd.blocked && !sd.released {
			sd.blocked = true
			r.g.markBlocked(sd.q)
		}
	}
}

// settleOrphan marks the chunk a released room left in flight settled at
// `at`: the release guessed when, at the link speed of the time.
func (x *xfer) settleOrphan(sd *sender, at time.Time) {
	if !sd.orphaned {
		return
	}
	sd.orphaned = false
	for i := range x.orphans {
		if o := &x.orphans[i]; o.room == sd.q.room && o.queue == sd.q.queue {
			o.until = at
		}
	}
	sd.orphanUntil = at
}

// transferWorkersOf lists every worker of x, the leader's or a peer's, at
// now (round 4). Callers hold r.mu.
func (r *rank) transferWorkersOf(x *xfer, now time.Time) []pluginapi.TransferWorker {
	out := make([]pluginapi.TransferWorker, TransferQueues)
	for qi := range x.workers {
		r.run(x, qi, now)
		w := &x.workers[qi]
		tw := pluginapi.TransferWorker{TransferQueue: qi, Tracked: true, ChunksTaken: w.taken,
			Recent: make([][2]float64, 0, w.nRecent), Finished: make([]pluginapi.FinishedChunk, 0, w.nRecent)}
		for _, sd := range w.fifo {
			tw.Depth += sd.chunksQueued()
		}
		if w.holding {
			tw.InFlight = &pluginapi.ChunkInFlight{Chunk: w.taken, BootstrapRoom: w.fifo[0].q.room,
				Pages: w.pages, LastChunk: w.last, Seconds: now.Sub(w.since).Seconds(), Link: w.link}
		}
		for i := range w.nRecent {
			c := w.recent[(w.head-w.nRecent+i+recentChunks)%recentChunks]
			tw.Recent = append(tw.Recent, [2]float64{float64(c.pages), c.seconds})
			tw.Finished = append(tw.Finished, pluginapi.FinishedChunk{Chunk: c.number, Pages: c.pages, Seconds: c.seconds, Link: c.link})
		}
		out[qi] = tw
	}
	return out
}

// holds tells whether queue qi's worker holds chunk number chunk at now.
// Callers hold r.mu.
func (r *rank) holds(qi int, chunk int64, now time.Time) bool {
	r.runWorker(qi, now)
	w := &r.workers[qi]
	return w.holding && w.taken == chunk
}

// SetLinkSpeed sets the speed of the links behind transfer queue `queue`
// of rank `rank` to `speed` times the planned one, from the clock's present
// time on: 0.01 makes each chunk take 100 times as long, 0 stops it until
// the speed changes again. A rank or queue of -1 means all of them, on
// every attention-TP rank. It sets every destination on that queue: those
// whose rooms all take it (QueueKeyDecodePorts) lose a speed of their own
// (SetDestinationSpeed), and so does every destination for a queue of -1;
// under QueueKeyRoom a destination spans the queues and keeps its own. The
// speed survives restarts (it is the network's).
func (s *Sim) SetLinkSpeed(rank, queue int, speed float64) error {
	return s.SetTPLinkSpeed(rank, -1, queue, speed)
}

// SetTPLinkSpeed is SetLinkSpeed for the links of attention-TP rank tp
// alone (0: the leader; -1: every one): each rank of the group writes to
// its own decode peer, so one rank's link can be slow while the others'
// are not.
func (s *Sim) SetTPLinkSpeed(rank, tp, queue int, speed float64) error {
	if queue < -1 || queue >= TransferQueues {
		return errors.New("sglangsim: no such transfer queue")
	}
	return s.setLinks(rank, tp, speed, func(l *links) {
		for qi := range l.queue {
			if queue == -1 || queue == qi {
				l.queue[qi] = speed
			}
		}
		for port := range l.dest {
			if queue == -1 || (s.opts.QueueKey == QueueKeyDecodePorts && transferQueue(s.opts.QueueKey, 0, port) == queue) {
				delete(l.dest, port)
			}
		}
	})
}

// SetDestinationSpeed sets the speed of the link from rank `rank` (-1:
// every one) and attention-TP rank tp (-1: every one) to the decode
// endpoint at port `port` to `speed` times the planned one, from the
// clock's present time on, whatever queue its rooms take: a link is a
// destination, and destinations of different speeds share a queue
// (QueueKeyDecodePorts hashes their port sums onto four). It holds until
// this or SetLinkSpeed changes it, restarts included.
func (s *Sim) SetDestinationSpeed(rank, tp, port int, speed float64) error {
	if port <= 0 || port > 65535 {
		return fmt.Errorf("sglangsim: decode port %d is not a port", port)
	}
	return s.setLinks(rank, tp, speed, func(l *links) {
		if l.dest == nil {
			l.dest = map[int]float64{}
		}
		l.dest[port] = speed
	})
}

// setLinks applies set to the links of rank (-1: every one) and
// attention-TP rank tp (-1: every one), once their workers have played up
// to the present: the worker's time so far went at the old speeds.
func (s *Sim) setLinks(rank, tp int, speed float64, set func(*links)) error {
	if math.IsNaN(speed) || math.IsInf(speed, 0) || speed < 0 {
		return errors.New("sglangsim: a link speed is a finite number >= 0")
	}
	if tp < -1 || tp >= s.opts.AttnTP {
		return errors.New("sglangsim: no such attention-TP rank")
	}
	if rank < -1 || rank >= len(s.ranks) {
		return errors.New("sglangsim: no such rank")
	}
	now := s.clock.Now()
	for _, r := range s.ranks {
		if rank != -1 && r.idx != rank {
			continue
		}
		r.mu.Lock()
		for t := range s.opts.AttnTP {
			if tp != -1 && t != tp {
				continue
			}
			x := r.xf(t)
			for qi := range x.workers {
				r.run(x, qi, now)
			}
			set(&x.links)
		}
		r.mu.Unlock()
	}
	return nil
}

// KillTransferWorker makes the leader's transfer worker thread of queue
// `queue` of rank `rank` die, as one does on an exception it does not
// handle (issue 24; SGLang v0.5.18: disaggregation/mooncake/conn.py
// transfer_worker): at once if it holds no chunk, else as it lets go of
// the one it holds. It takes no chunk after that: every room with chunks
// on its queue, and every later one, waits in WaitingForInput with nothing
// in flight until the server restarts, when its successor starts alive.
// The rooms are recorded blocked_by_wedge. The listing's kv_threads shows
// the thread dead from its death on.
func (s *Sim) KillTransferWorker(rank, queue int) error {
	if rank < 0 || rank >= len(s.ranks) || queue < 0 || queue >= TransferQueues {
		return fmt.Errorf("sglangsim: no transfer queue %d on rank %d", queue, rank)
	}
	if !s.roundFour() {
		return errors.New("sglangsim: this scene's KV manager has no transfer workers to kill")
	}
	r := s.ranks[rank]
	r.mu.Lock()
	defer r.mu.Unlock()
	now := s.clock.Now()
	r.runWorker(queue, now)
	w := &r.workers[queue]
	w.dying = true
	w.dead = !w.holding
	r.markBehind(&r.xfer, queue)
	return nil
}

// kvThreads lists the threads of the rank's KV manager as the plugin does
// (docs/plugin-api.md, kv_threads): the bootstrap thread and, where the
// manager has worker queues, one transfer worker per queue. Callers hold
// r.mu, with the workers played up to now.
func (r *rank) kvThreads(queues bool) []pluginapi.KVThread {
	out := []pluginapi.KVThread{{Role: pluginapi.ThreadBootstrap, Function: "bootstrap_thread", Alive: true}}
	if !queues {
		return out
	}
	for qi := range r.workers {
		out = append(out, pluginapi.KVThread{Role: pluginapi.ThreadTransferWorker, Function: "transfer_worker",
			TransferQueue: intPtr(qi), Alive: !r.workers[qi].dead})
	}
	return out
}
