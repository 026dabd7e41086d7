package watchdog

import (
	"math"
	"slices"
	"sort"
	"strconv"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// A link is the set of decode destinations a prefill rank sends a room's
// chunks to, as the plugin names it (in_flight.link, finished[].link). Its
// pace is learned from its own finished chunks only: a queue of SGLang's
// transfer workers serves every destination whose ports hash to it, so a
// queue's, or a rank's, pooled samples would pace a chunk to a slow
// destination by a fast one (and fail it), or a chunk to a fast one by a
// slow one (and never release it). docs/runbook.md, "Transfer liveness",
// says how a pace is learned and forgotten.
const (
	// linkSamples is how many finished chunks a link keeps: as many as
	// the plugin lists per worker.
	linkSamples = 32
	// maxLinks bounds the links kept per rank; past it the least
	// recently seen are forgotten first. 512 is far more decode
	// destinations than one prefill rank sends to.
	maxLinks = 512
	// speedQuantile picks a slow chunk of the recent ones rather than a
	// typical one: slower is more conservative. Nearest rank rounding
	// down, so while a link has shown ten chunks or fewer its pace is
	// the slowest of them.
	speedQuantile = 0.1
)

// linkState is what one link has shown: a ring of its last finished
// chunks as [pages, seconds].
type linkState struct {
	samples  [linkSamples][2]float64
	n, next  int
	lastSeen time.Time
}

func (l *linkState) add(pages, seconds float64) {
	l.samples[l.next] = [2]float64{pages, seconds}
	l.next = (l.next + 1) % linkSamples
	l.n = min(l.n+1, linkSamples)
}

// pace is the link's speed in pages per second at the slow end of what it
// showed (speedQuantile of its chunks' speeds); ok is false while it
// showed no chunk with pages and a measurable time.
func (l *linkState) pace() (speed float64, ok bool) {
	if l == nil {
		return 0, false
	}
	speeds := make([]float64, 0, l.n)
	for _, s := range l.samples[:l.n] {
		if s[0] > 0 && s[1] > 0 {
			speeds = append(speeds, s[0]/s[1])
		}
	}
	if len(speeds) == 0 {
		return 0, false
	}
	sort.Float64s(speeds)
	return speeds[int(speedQuantile*float64(len(speeds)-1))], true
}

// linkBook holds the links of one prefill rank by name.
type linkBook map[string]*linkState

// seen returns the link, created if new, marked seen now.
func (b linkBook) seen(name string, now time.Time) *linkState {
	l := b[name]
	if l == nil {
		l = &linkState{}
		b[name] = l
	}
	l.lastSeen = now
	return l
}

// forget drops the links idle for longer than idle, then the least
// recently seen ones past maxLinks.
func (b linkBook) forget(now time.Time, idle time.Duration) {
	for name, l := range b {
		if now.Sub(l.lastSeen) > idle {
			delete(b, name)
		}
	}
	if len(b) <= maxLinks {
		return
	}
	names := make([]string, 0, len(b))
	for name := range b {
		names = append(names, name)
	}
	slices.SortFunc(names, func(x, y string) int { return b[x].lastSeen.Compare(b[y].lastSeen) })
	for _, name := range names[:len(names)-maxLinks] {
		delete(b, name)
	}
}

// queueLink names the link of a chunk whose destinations the plugin did
// not name: its transfer queue stands for it (an older plugin, or a room
// SGLang no longer knew when its worker took the chunk).
func queueLink(q int) string { return "queue " + strconv.Itoa(q) }

func linkOf(name string, q int) string {
	if name == "" {
		return queueLink(q)
	}
	return name
}

// observeLinks folds one rank's listed transfer workers into its link
// book: each finished chunk not folded before (by chunk number, so that
// the 32 a worker lists again at every listing count once), or, from a
// plugin that lists no finished chunks, the worker's recent ring as its
// queue's samples. Then it paces each worker's chunk in flight by its own
// link, and forgets idle links.
func observeLinks(book linkBook, workers map[int]*workerState, listed []pluginapi.TransferWorker, now time.Time, idle time.Duration) {
	for i := range listed {
		tw := &listed[i]
		ws := workers[tw.TransferQueue]
		switch {
		case tw.Finished != nil:
			foldFinished(book, ws, tw, now)
		case len(tw.Recent) > 0:
			l := book.seen(queueLink(tw.TransferQueue), now)
			l.n, l.next = 0, 0
			for _, s := range tw.Recent[max(0, len(tw.Recent)-linkSamples):] {
				l.add(s[0], s[1])
			}
		}
	}
	for q, ws := range workers {
		ws.link, ws.speed, ws.speedKnown = "", 0, false
		if ws.inFlight == nil {
			continue
		}
		ws.link = linkOf(ws.inFlight.Link, q)
		ws.speed, ws.speedKnown = book.seen(ws.link, now).pace()
	}
	book.forget(now, idle)
}

// foldFinished adds a worker's newly finished chunks to their links. A
// newest chunk numbered below the last one folded is a new worker (its
// count began again): all it lists is new.
func foldFinished(book linkBook, ws *workerState, tw *pluginapi.TransferWorker, now time.Time) {
	if n := len(tw.Finished); n > 0 && tw.Finished[n-1].Chunk < ws.lastFinished {
		ws.lastFinished = -1
	}
	for _, f := range tw.Finished {
		if f.Chunk <= ws.lastFinished {
			continue
		}
		ws.lastFinished = f.Chunk
		if f.Pages > 0 {
			book.seen(linkOf(f.Link, tw.TransferQueue), now).add(float64(f.Pages), f.Seconds)
		}
	}
}

// chunkAllowance is how long a live chunk of this many pages may be held
// before it is judged stuck: LinkMargin times what its size needs at its
// link's pace, never less than the stall window; twice the deadline when
// the link showed no chunk yet (a new link, or after a start: nothing
// says how slow it may be, so a stuck first chunk is released later
// rather than a slow one failed). It saturates: a margin that switches
// the rule off in effect, or a link that showed a glacial chunk, gives
// the longest duration, never one that wrapped around.
func chunkAllowance(pages int, speed float64, known bool, cfg *Config) time.Duration {
	if !known {
		return 2 * cfg.Deadline
	}
	need := cfg.LinkMargin * float64(pages) / speed
	if !(need < float64(math.MaxInt64)/float64(time.Second)) {
		return time.Duration(math.MaxInt64)
	}
	return max(cfg.StallWindow, time.Duration(need*float64(time.Second)))
}
