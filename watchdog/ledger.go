package watchdog

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// VerdictSource answers, for a decode request, what the watchdog of its
// prefill peer knows of the request's room. *pluginapi.VerdictClient
// implements it.
type VerdictSource interface {
	Verdict(ctx context.Context, q pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error)
}

// VerdictAnswers are the values of the `verdict` label of
// sglang_watchdog_prefill_verdict_lookups_total.
var VerdictAnswers = []string{pluginapi.VerdictStopped, pluginapi.VerdictLive, pluginapi.VerdictInQueue, pluginapi.VerdictUnknown, "error"}

// ledgerEntry is what the watchdog knew when it released a request on
// prefill.
type ledgerEntry struct {
	at time.Time
	// stopped: no chunk of the room was in flight at the last listing
	// before the release nor at the re-read, on every stage.
	stopped bool
	// orphaned: the room was listed in orphaned_transfers since.
	orphaned bool
}

type ledgerSlot struct {
	key roomKey
	at  time.Time
}

// ledger is the bounded, time-limited record of requests released on
// prefill, keyed by rid and room: a room is reused (a client or router
// may set bootstrap_room), and a verdict on an earlier request with the
// same room must not answer for a later one. Caller holds w.mu.
type ledger struct {
	ttl   time.Duration
	size  int
	n     int
	rooms map[uint64]map[string]*ledgerEntry // room, then rid
	order []ledgerSlot                       // oldest first; a slot whose time differs from its entry's is stale
}

func newLedger(ttl time.Duration, size int) *ledger {
	return &ledger{ttl: ttl, size: size, rooms: map[uint64]map[string]*ledgerEntry{}}
}

func (l *ledger) add(key roomKey, at time.Time, stopped bool) {
	byRID := l.rooms[key.room]
	if byRID == nil {
		byRID = map[string]*ledgerEntry{}
		l.rooms[key.room] = byRID
	}
	if byRID[key.rid] == nil {
		l.n++
	}
	byRID[key.rid] = &ledgerEntry{at: at, stopped: stopped}
	l.order = append(l.order, ledgerSlot{key, at})
	l.expire(at)
}

// orphaned marks every request released with the room: a listed orphan
// names its room only, and whichever request it belongs to may still
// write.
func (l *ledger) orphaned(room uint64) {
	for _, e := range l.rooms[room] {
		e.orphaned = true
	}
}

func (l *ledger) expire(now time.Time) {
	for len(l.order) > 0 {
		s := l.order[0]
		byRID := l.rooms[s.key.room]
		e, ok := byRID[s.key.rid]
		current := ok && e.at.Equal(s.at)
		if current && now.Sub(s.at) < l.ttl && l.n <= l.size {
			return
		}
		if current {
			delete(byRID, s.key.rid)
			l.n--
			if len(byRID) == 0 {
				delete(l.rooms, s.key.room)
			}
		}
		l.order = l.order[1:]
	}
}

// get returns the requests released with room, by rid.
func (l *ledger) get(room uint64, now time.Time) map[string]*ledgerEntry {
	l.expire(now)
	return l.rooms[room]
}

func (l *ledger) len() int { return l.n }

// watchesPrefill tells whether this watchdog reads a prefill rank. Caller
// holds w.mu.
func (w *Watchdog) watchesPrefill() bool {
	for _, rk := range w.ranks {
		if rk.listed && rk.role == RolePrefill {
			return true
		}
	}
	return false
}

// PrefillVerdict answers what this watchdog knows of the room of q's
// decode request on prefill.
func (w *Watchdog) PrefillVerdict(q pluginapi.VerdictQuery) pluginapi.RoomVerdict {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.prefillVerdict(q, w.clock.Now())
}

// prefillVerdict: in_queue while a prefill listing holds the room; live
// while one lists it as an orphaned transfer, or when the request was
// released with a chunk in flight or by a plugin that cannot see chunks
// in flight on every rank of its group; stopped only when the request of
// q's rid was released, after the decode request was first seen, with
// none in flight and never orphaned since, while every configured rank
// and every PP stage the listings name is read; unknown otherwise.
// Caller holds w.mu.
func (w *Watchdog) prefillVerdict(q pluginapi.VerdictQuery, now time.Time) pluginapi.RoomVerdict {
	room := q.Room
	v := pluginapi.RoomVerdict{Room: strconv.FormatUint(room, 10), RID: q.RID, Verdict: pluginapi.VerdictUnknown}
	if room == 0 {
		v.Reason = "room 0 is a health check or warm-up"
		return v
	}
	down := ""
	for _, rk := range w.ranks {
		if !rk.listed {
			// It may be a prefill rank still sending for the room.
			down = "a configured plugin that never listed"
			continue
		}
		if rk.role != RolePrefill {
			continue
		}
		if !rk.status.up {
			down = rk.name()
		}
		for key := range rk.rooms {
			if key.room == room {
				v.Verdict, v.Reason = pluginapi.VerdictInQueue, "listed in the inflight queue of "+rk.name()
				return v
			}
		}
		if _, ok := rk.orphans[room]; ok {
			v.Verdict, v.Reason = pluginapi.VerdictLive, "listed as an orphaned transfer by "+rk.name()
			return v
		}
	}
	for dp, missing := range w.missingStages {
		if dp.role == RolePrefill && missing > 0 {
			down = fmt.Sprintf("prefill DP rank %d, %d of whose PP stages are not configured,", dp.dp, missing)
		}
	}
	released := w.ledger.get(room, now)
	if len(released) == 0 {
		v.Reason = "not released by this watchdog in the last " + w.cfg.LedgerTTL.String()
		return v
	}
	e := released[q.RID]
	switch {
	case q.RID == "":
		v.Reason = "released, but the lookup names no rid to bind the verdict to (a decode-side watchdog that predates binding)"
		return v
	case e == nil:
		v.Reason = "released only for another rid: not this decode request (a router that lets each leg draw its own rid, or the room reused)"
		return v
	}
	v.ReleasedSecondsAgo = now.Sub(e.at).Seconds()
	switch {
	case v.ReleasedSecondsAgo >= q.AgeSeconds:
		// Decode's age counts from its first sight, so it never
		// overstates: a release at least that old came before this
		// decode request existed there.
		v.Reason = fmt.Sprintf("released %.0fs ago, before this decode request was first seen (%.0fs ago): a verdict on an earlier request", v.ReleasedSecondsAgo, q.AgeSeconds)
	case e.orphaned:
		v.Verdict, v.Reason = pluginapi.VerdictLive, "listed as an orphaned transfer after its release"
	case !e.stopped:
		v.Verdict, v.Reason = pluginapi.VerdictLive, "a chunk was in flight at the release, or the plugin cannot see chunks in flight on every rank that sends (transfer_tracking, transfer_ranks_watched < transfer_ranks)"
	case down != "":
		v.Reason = "released with no chunk in flight, but " + down + " is not read: an orphan could go unseen"
	default:
		v.Verdict, v.Reason = pluginapi.VerdictStopped, "released with no chunk in flight, never orphaned since"
	}
	return v
}

// lookupVerdict asks for the prefill side's verdict on a decode request:
// from this watchdog's own ledger when it watches prefill too, otherwise
// from cfg.Verdicts. It counts the answer.
func (w *Watchdog) lookupVerdict(ctx context.Context, q pluginapi.VerdictQuery) (pluginapi.RoomVerdict, error) {
	w.mu.Lock()
	own := w.watchesPrefill()
	var v pluginapi.RoomVerdict
	if own {
		v = w.prefillVerdict(q, w.clock.Now())
	}
	w.mu.Unlock()
	var err error
	switch {
	case own:
	case w.cfg.Verdicts == nil:
		err = errors.New("no prefill verdict source: set --decode.prefill-watchdog-url")
	default:
		v, err = w.cfg.Verdicts.Verdict(ctx, q)
	}
	w.mu.Lock()
	if err != nil {
		w.lookups["error"]++
	} else {
		w.lookups[v.Verdict]++
	}
	w.mu.Unlock()
	return v, err
}
