package main

import (
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// The analysis: the fate of every request of a replay, and the
// statistics of the report.

func isPin(k sglangsim.Kind) bool { return k.Pin() }

var pinKinds = []sglangsim.Kind{sglangsim.KindPinResurrection, sglangsim.KindPinAbortBeforeRegister, sglangsim.KindPinStuckHandle}

// fate is where one class of requests ended.
type fate struct {
	n          int
	success    int
	auto       int // lever set by the deadline path (or the alert webhook)
	failFast   int // lever set by fail-fast
	failed     int // failed by itself
	restarted  int // lost in a restart (the client got an error)
	held       int // still in the server at the end of the trace
	lat        []time.Duration
	heldAge    []time.Duration // age at the end of the trace of the held ones
	decodeHold []time.Duration // decode slot held: DecodeReleased (or the end) - DecodeAdmitted
	decodeOpen int             // decode still holding at the end
	decodeEnd  map[sglangsim.DecodeEnd]int
	// decodeHoldForced: the hold of those a decode force-fail released.
	decodeHoldForced []time.Duration
	// heldLive: decode requests the decode-side watchdog held as
	// "transfer may be live"; heldThenTimeout: of those, the ones
	// SGLang's own waiting timeout released.
	heldLive, heldThenTimeout int
	// clientHang: from the room's entry into the inflight queue (where a
	// pin begins) to the client's answer through a router that waits for
	// both legs (Record.ClientAnswered), or to the end of the trace for the
	// clientOpen ones still waiting; clientAfterRelease: from prefill's
	// lever release to that answer.
	clientHang         []time.Duration
	clientOpen         int
	clientAfterRelease []time.Duration
}

func (f *fate) add(rec sglangsim.Record, trig string, heldLive bool, end time.Time) {
	f.n++
	entered := rec.EnteredInflight
	switch rec.Outcome {
	case sglangsim.OutcomeSuccess:
		f.success++
	case sglangsim.OutcomeFailedForced:
		if trig == watchdog.TriggerFailFast {
			f.failFast++
		} else {
			f.auto++
		}
		if !entered.IsZero() {
			f.lat = append(f.lat, rec.Left.Sub(entered))
		}
	case sglangsim.OutcomeFailed:
		f.failed++
	case sglangsim.OutcomeRestarted:
		f.restarted++
	default:
		f.held++
		if !entered.IsZero() {
			f.heldAge = append(f.heldAge, end.Sub(entered))
		}
	}
	if !entered.IsZero() {
		if at := rec.ClientAnswered(); at.IsZero() {
			f.clientOpen++
			f.clientHang = append(f.clientHang, end.Sub(entered))
		} else {
			f.clientHang = append(f.clientHang, at.Sub(entered))
			if rec.Outcome == sglangsim.OutcomeFailedForced {
				f.clientAfterRelease = append(f.clientAfterRelease, at.Sub(rec.Left))
			}
		}
	}
	if heldLive {
		f.heldLive++
		if rec.DecodeEnd == sglangsim.DecodeTimeout {
			f.heldThenTimeout++
		}
	}
	if rec.DecodeAdmitted.IsZero() {
		return
	}
	if f.decodeEnd == nil {
		f.decodeEnd = map[sglangsim.DecodeEnd]int{}
	}
	f.decodeEnd[rec.DecodeEnd]++
	if rec.DecodeReleased.IsZero() {
		f.decodeOpen++
		f.decodeHold = append(f.decodeHold, end.Sub(rec.DecodeAdmitted))
		return
	}
	f.decodeHold = append(f.decodeHold, rec.DecodeHold())
	if rec.DecodeEnd == sglangsim.DecodeForceFail {
		f.decodeHoldForced = append(f.decodeHoldForced, rec.DecodeHold())
	}
}

type analysis struct {
	byKind          map[sglangsim.Kind]*fate
	falseFF         []sglangsim.Record // progressing, or healthy/slow/health check forced
	blockedProgress int                // blocked rooms force-failed while progressing
	healthyInflight []time.Duration
	slowInflight    []time.Duration
	excess          []time.Duration // pin release after the earliest moment the windows allow it
	restartLost     int             // requests of every kind lost in restarts
	// wedgeOrdered: requests a standing wedge order (round 4) failed;
	// wedgeOrderedFalse: of those, the ones that would have completed.
	wedgeOrdered, wedgeOrderedFalse int
	// wedges: stuck-handle pins that held a transfer in flight and froze
	// (each wedged its queue), and the time from the freeze to the
	// watchdog's diagnosis.
	wedging       int
	diagnosed     int
	toDiagnosis   []time.Duration
	undiagnosed   []string
	wedgeAtEnd    int // wedging pins whose queue was still wedged at the end (no restart since)
	otherWedgeEvs int // wedge events that match no wedging pin
	// Decode pages freed under a live transfer (Record.UnsafeFree) and
	// late writes that landed (Sim.Corruptions), by what freed the pages,
	// in all and by the writer's kind.
	unsafeFree, corrupt         map[sglangsim.DecodeEnd]int
	decodeHealthy               []sglangsim.Record // healthy or slow requests a decode force-fail released
	unsafeByKind, corruptByKind map[sglangsim.Kind]map[sglangsim.DecodeEnd]int
	// Requests whose prefill pages were freed with a chunk still in a
	// worker's hands (Record.PrefillFreedUnder), by who freed them: a
	// lever (the request was force-failed) or SGLang itself.
	prefillFreeLever, prefillFreeSGLang map[sglangsim.PrefillFree]int
}

func analyse(r *replayResult) *analysis {
	a := &analysis{byKind: map[sglangsim.Kind]*fate{}, unsafeFree: map[sglangsim.DecodeEnd]int{}, corrupt: map[sglangsim.DecodeEnd]int{},
		unsafeByKind: map[sglangsim.Kind]map[sglangsim.DecodeEnd]int{}, corruptByKind: map[sglangsim.Kind]map[sglangsim.DecodeEnd]int{},
		prefillFreeLever: map[sglangsim.PrefillFree]int{}, prefillFreeSGLang: map[sglangsim.PrefillFree]int{}}
	kindOf := map[string]sglangsim.Kind{}
	count := func(m map[sglangsim.Kind]map[sglangsim.DecodeEnd]int, k sglangsim.Kind, e sglangsim.DecodeEnd) {
		if m[k] == nil {
			m[k] = map[sglangsim.DecodeEnd]int{}
		}
		m[k][e]++
	}
	for _, k := range append(append([]sglangsim.Kind{}, pinKinds...), sglangsim.KindHealthy, sglangsim.KindSlow, sglangsim.KindHealthCheck, sglangsim.KindBlockedByWedge) {
		a.byKind[k] = &fate{}
	}
	for _, rec := range r.records {
		f := a.byKind[rec.Kind]
		if f == nil {
			f = &fate{}
			a.byKind[rec.Kind] = f
		}
		trig := r.trigger[rec.RID]
		f.add(rec, trig, r.heldLive[rec.RID], r.end)
		kindOf[rec.RID] = rec.Kind
		if rec.DecodeEnd == sglangsim.DecodeForceFail && (rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow) {
			a.decodeHealthy = append(a.decodeHealthy, rec)
		}
		if rec.UnsafeFree != "" {
			a.unsafeFree[rec.UnsafeFree]++
			count(a.unsafeByKind, rec.Kind, rec.UnsafeFree)
		}
		forced := !rec.ForcedAt.IsZero()
		if rec.PrefillFreedUnder != "" {
			if forced {
				a.prefillFreeLever[rec.PrefillFreedUnder]++
			} else {
				a.prefillFreeSGLang[rec.PrefillFreedUnder]++
			}
		}
		if rec.WedgeOrdered {
			a.wedgeOrdered++
			if rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow {
				a.wedgeOrderedFalse++
			}
		}
		if rec.Outcome == sglangsim.OutcomeRestarted {
			a.restartLost++
		}
		switch rec.Kind {
		case sglangsim.KindHealthy:
			if rec.Outcome == sglangsim.OutcomeSuccess {
				a.healthyInflight = append(a.healthyInflight, rec.Left.Sub(rec.EnteredInflight))
			}
		case sglangsim.KindSlow:
			if rec.Outcome == sglangsim.OutcomeSuccess {
				a.slowInflight = append(a.slowInflight, rec.Left.Sub(rec.EnteredInflight))
			}
		case sglangsim.KindBlockedByWedge:
			if forced && rec.ProgressingWhenForced {
				a.blockedProgress++
			}
		}
		if rec.ProgressingWhenForced || (forced && (rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow || rec.Kind == sglangsim.KindHealthCheck)) {
			a.falseFF = append(a.falseFF, rec)
		}
		if isPin(rec.Kind) && rec.Outcome == sglangsim.OutcomeFailedForced {
			if t := r.pins.pins[rec.RID]; t != nil && t.seen {
				// The earliest a correct watchdog may act on the deadline
				// path: old enough and still for a whole stall window.
				allowed := rec.EnteredInflight.Add(r.cfg.deadline)
				if st := t.lastChange.Add(r.cfg.stall); st.After(allowed) {
					allowed = st
				}
				a.excess = append(a.excess, rec.Left.Sub(allowed))
			}
		}
	}
	// Wedges: match each wedging pin to the first diagnosis naming its
	// rank and room (rule in_flight or orphaned_transfer).
	used := make([]bool, len(r.wedges))
	for _, rec := range r.records {
		if rec.Kind != sglangsim.KindPinStuckHandle {
			continue
		}
		t := r.pins.pins[rec.RID]
		if t == nil || !t.seen || !t.inFlight {
			continue
		}
		a.wedging++
		restartedSince := false
		for _, at := range r.restartAt {
			if at.After(t.lastChange) {
				restartedSince = true
			}
		}
		if !restartedSince {
			a.wedgeAtEnd++
		}
		found := false
		for i, e := range r.wedges {
			if e.rank == rec.Rank && e.room == rec.Room && !e.at.Before(t.lastChange) {
				used[i] = true
				if !found {
					a.diagnosed++
					a.toDiagnosis = append(a.toDiagnosis, e.at.Sub(t.lastChange))
					found = true
				}
			}
		}
		if !found && r.cfg.watchdog {
			a.undiagnosed = append(a.undiagnosed, fmt.Sprintf("rank %d %s queue %d frozen at %s, outcome %s", rec.Rank, rec.RID[:12], t.queue, t.lastChange.Sub(epoch).Round(100*time.Millisecond), rec.Outcome))
		}
	}
	for _, u := range used {
		if !u {
			a.otherWedgeEvs++
		}
	}
	for _, c := range r.corruption {
		a.corrupt[c.Cause]++
		count(a.corruptByKind, kindOf[c.Writer], c.Cause)
	}
	return a
}

func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func maxDur(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

func secs(d time.Duration) string { return fmt.Sprintf("%.1f s", d.Seconds()) }

// dist is "median / p99 / max" of ds, or "-" when empty.
func dist(ds []time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	return fmt.Sprintf("%s / %s / %s", secs(quantile(ds, 0.5)), secs(quantile(ds, 0.99)), secs(maxDur(ds)))
}
