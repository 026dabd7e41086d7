package main

import (
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// A heterogeneous fleet (issue 23): a link is a decode destination, with
// its own speed, not a transfer queue. SGLang hashes destinations of any
// speed onto one queue by their port sum, so a queue may carry a fast and
// a slow destination at once. Each destination beyond the simulator's
// defaults gets its own stream of requests, sized so that its serial
// worker keeps up even at 1% (a worker queue that never drains would only
// measure the backlog).

// destination is a decode endpoint of a heterogeneous fleet.
type destination struct {
	port  int
	class string // the link class it is reported under
	// speeds: (from, speed) changes over the trace, in time order; the
	// link runs at full speed before the first.
	speeds []linkChange
	// from, to: its requests' arrivals (from > 0: a destination new
	// mid-run); n of them.
	from, to time.Duration
	n        int
}

// fullSpeed is the link class of every destination without a class of
// its own.
const fullSpeed = "100%"

// addDestination adds d's speed changes and its requests (each bound for
// d.port, drawn by draw) to t, and names its link class.
func (t *trace) addDestination(d destination, draw func(lo, hi time.Duration) time.Duration, add func(at time.Duration, port int)) {
	if t.linkClass == nil {
		t.linkClass = map[int]string{}
	}
	t.linkClass[d.port] = d.class
	for _, c := range d.speeds {
		c.port, c.tp = d.port, -1
		t.links = append(t.links, c)
	}
	for range d.n {
		add(draw(d.from, d.to), d.port)
	}
	sort.SliceStable(t.links, func(i, j int) bool { return t.links[i].at < t.links[j].at })
}

// classOf is the link class of decode port port in t.
func (t *trace) classOf(port int) string {
	if c, ok := t.linkClass[port]; ok {
		return c
	}
	return fullSpeed
}

// classes lists t's link classes, full speed first.
func (t *trace) classes() []string {
	out := []string{fullSpeed}
	for _, c := range t.linkClass {
		if !slices.Contains(out, c) {
			out = append(out, c)
		}
	}
	slices.Sort(out[1:])
	return out
}

// linkStats is one link class of one replay.
type linkStats struct {
	completable, falseFF, falseWedge int
	// handles: stuck handles that froze in flight on a link of the class;
	// toDiagnosis: freeze to the watchdog's first transfer_wedged event
	// naming the room; toRelease: freeze to the room's error.
	handles                int
	toDiagnosis, toRelease []time.Duration
	// overDL: every stuck room of the class released (pins and the rooms
	// behind a stuck handle): its age beyond the deadline.
	overDL []time.Duration
	stuck  int
	// hungBehindDiagnosed: rooms of the class still queued at the end
	// behind a wedge the watchdog had diagnosed.
	hungBehindDiagnosed int
	// longest is the longest chunk a link of the class finished (what it
	// showed the watchdog in finished); withinAim counts the stuck handles
	// released within max(2 x longest, deadline) of their freeze.
	longest   time.Duration
	withinAim int
}

// aimSlack is what a release may take beyond the aim: the mixed
// scenes allow 3 s (a watch cycle, the lever's pass, the listing's age).
const aimSlack = 3 * time.Second

// aim is the release time the issue aims at for the class's stuck
// handles: twice its longest healthy chunk, or the deadline if later.
func (s *linkStats) aim(deadline time.Duration) time.Duration {
	return max(2*s.longest, deadline)
}

// linkAnalyse sorts one replay's rooms by the link class of their decode
// destination.
func linkAnalyse(t *trace, r *replayResult) map[string]*linkStats {
	out := map[string]*linkStats{}
	for _, c := range t.classes() {
		out[c] = &linkStats{}
	}
	of := func(port int) *linkStats { return out[t.classOf(port)] }
	r.pins.mu.Lock()
	for link, d := range r.pins.longest {
		if port, ok := portOf(link); ok {
			s := of(port)
			s.longest = max(s.longest, d)
		}
	}
	r.pins.mu.Unlock()
	wi := newWedgeIndex(r)
	for _, rec := range r.records {
		if rec.Kind == sglangsim.KindHealthCheck || rec.DecodePort == 0 {
			continue
		}
		s := of(rec.DecodePort)
		forced := !rec.ForcedAt.IsZero()
		stuck := rec.Kind.Pin() || rec.Kind == sglangsim.KindBlockedByWedge
		held := rec.Outcome == sglangsim.OutcomeInflight || rec.Outcome == sglangsim.OutcomeQueued
		switch {
		case rec.Kind == sglangsim.KindHealthy || rec.Kind == sglangsim.KindSlow:
			s.completable++
			if forced && rec.WedgeOrdered {
				s.falseWedge++
			} else if forced {
				s.falseFF++
			}
		case stuck && !rec.EnteredInflight.IsZero():
			s.stuck++
			if held {
				if _, ok := wi.diagnosis(rec); ok && rec.Kind == sglangsim.KindBlockedByWedge {
					s.hungBehindDiagnosed++
				}
				continue
			}
			s.overDL = append(s.overDL, max(rec.Left.Sub(rec.EnteredInflight)-r.cfg.deadline, 0))
		}
		if rec.Kind != sglangsim.KindPinStuckHandle {
			continue
		}
		p := r.pins.pins[rec.RID]
		if p == nil || !p.seen || !p.inFlight {
			continue
		}
		s.handles++
		for _, e := range r.wedges {
			if e.rank == rec.Rank && e.room == rec.Room && !e.at.Before(p.lastChange) {
				s.toDiagnosis = append(s.toDiagnosis, e.at.Sub(p.lastChange))
				break
			}
		}
		if !held {
			s.toRelease = append(s.toRelease, rec.Left.Sub(p.lastChange))
		}
	}
	for _, s := range out {
		for _, d := range s.toRelease {
			if d <= s.aim(r.cfg.deadline)+aimSlack {
				s.withinAim++
			}
		}
	}
	return out
}

// portOf is the decode port a NIXL link name of the simulator names.
func portOf(link string) (int, bool) {
	var port int
	if _, err := fmt.Sscanf(link, "5eed0000-0000-4000-8000-%012d", &port); err != nil {
		return 0, false
	}
	return port, sglangsim.DestinationName(sglangsim.BackendNIXL, port) == link
}

// linkTable prints, per replay and link class, what issue 23 asks of each
// link: no false failure, stuck handles diagnosed and released, and the
// release against what the link itself showed.
func linkTable(rows []slRow) {
	fmt.Println("\n## Per link class (issue 23)")
	fmt.Println()
	fmt.Println("| configuration | class | link class | completable rooms | false force-fails | false wedge-order failures | stuck handles (froze in flight) | freeze to diagnosis, median / p99 / max | freeze to release, median / p99 / max | longest chunk the link showed | aim: max(2 x longest, deadline) | handles released within the aim + 3 s | stuck rooms released beyond the deadline, median / p99 / max (released / all) | rooms hung behind a diagnosed wedge |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, row := range rows {
		tr := row.trace
		st := linkAnalyse(tr, row.res)
		for _, c := range tr.classes() {
			s := st[c]
			if s.completable == 0 && s.stuck == 0 {
				continue
			}
			fmt.Printf("| %s | %s | %s | %d | %d | %d | %d | %s | %s | %s | %s | %d / %d | %s (%d / %d) | %d |\n",
				row.cfg, row.class, c, s.completable, s.falseFF, s.falseWedge, s.handles, dist(s.toDiagnosis), dist(s.toRelease),
				secs(s.longest), secs(s.aim(row.res.cfg.deadline)), s.withinAim, len(s.toRelease), dist(s.overDL), len(s.overDL), s.stuck, s.hungBehindDiagnosed)
		}
	}
	fmt.Println("\nA room's link class is that of its decode destination (a room queued behind another destination's stuck handle counts under its own). The longest chunk is the longest any link of the class listed in finished during the replay; freeze is when the listing last showed the stuck handle change.")
}
