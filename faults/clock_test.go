package faults

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// shiftWall returns t with its wall-clock reading moved by d and its
// monotonic reading left alone: what time.Now() returns after the system
// clock was stepped by d. No API builds such a value, so this writes
// time.Time's fields (wall: hasMonotonic bit, 33 bits of seconds since
// 1885, 30 bits of nanoseconds; ext: the monotonic reading). ok is false
// if the layout is not the one expected.
func shiftWall(t time.Time, d time.Duration) (shifted time.Time, ok bool) {
	type layout struct {
		wall uint64
		ext  int64
		loc  *time.Location
	}
	const (
		hasMonotonic = 1 << 63
		nsecShift    = 30
		nsecMask     = 1<<nsecShift - 1
	)
	if unsafe.Sizeof(t) != unsafe.Sizeof(layout{}) {
		return t, false
	}
	p := (*layout)(unsafe.Pointer(&t))
	if p.wall&hasMonotonic == 0 {
		return t, false
	}
	secs := int64(p.wall << 1 >> (nsecShift + 1))
	total := secs*1e9 + int64(p.wall&nsecMask) + int64(d)
	p.wall = hasMonotonic | uint64(total/1e9)<<nsecShift | uint64(total%1e9)
	return t, true
}

// jumpClock is a fake clock whose wall reading can be stepped while its
// monotonic reading runs on undisturbed.
type jumpClock struct {
	*clock.Fake
	mu       sync.Mutex
	offset   time.Duration
	wallOnly bool // strip the monotonic reading: the negative control
}

func (c *jumpClock) jump(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offset += d
}

func (c *jumpClock) Now() time.Time {
	c.mu.Lock()
	off, wallOnly := c.offset, c.wallOnly
	c.mu.Unlock()
	now := c.Fake.Now()
	if wallOnly {
		return now.Round(0).Add(off)
	}
	shifted, _ := shiftWall(now, off)
	return shifted
}

// runWithJumps runs a pinned request past the deadline with the watchdog's
// wall clock stepped forward two hours, back three and forward half an
// hour, and
// returns when the pin was force-failed (simulator time, zero if never)
// and the admin calls made.
func runWithJumps(t *testing.T, jumps bool, wallOnly bool) (forcedAfter time.Duration, calls, progressingFailed int) {
	t.Helper()
	var jc *jumpClock
	e := newEnv(t, envOptions{sim: baseSim(), mutate: func(c *watchdog.Config) {
		// The stall window, not the plugin-reported age, is the binding
		// condition: it is the one measured on the watchdog's clock.
		c.Deadline = 20 * time.Second
		jc = &jumpClock{Fake: c.Clock.(*clock.Fake), wallOnly: wallOnly}
		c.Clock = jc
	}})
	start := e.clk.Now()
	pin, _ := e.sim.Inject(0, sglangsim.PinResurrection)
	for s := 1; s <= 150; s++ {
		if jumps {
			switch s {
			case 10:
				jc.jump(2 * time.Hour)
			case 25:
				jc.jump(-3 * time.Hour)
			case 40:
				jc.jump(30 * time.Minute)
			}
		}
		e.tick(1)
	}
	if wallOnly {
		// The negative control is expected to break the invariant.
		for _, r := range e.sim.Records() {
			if r.ProgressingWhenForced {
				progressingFailed++
			}
		}
	} else {
		e.checkSafe()
	}
	r := e.record(pin)
	if !r.ForcedAt.IsZero() {
		forcedAfter = r.ForcedAt.Sub(start)
	}
	return forcedAfter, len(e.allCalls()), progressingFailed
}

// TestFaultWallClockJump: stepping the system clock (NTP, a VM resumed, an
// operator) must not shorten or stretch a deadline or a window.
//
// What this proves: clock.Real.Now is time.Now, which carries Go's
// monotonic reading; the watchdog's code takes every duration as a Sub (or
// Before/After) of two clock readings, never strips that reading, and never
// uses the wall-clock times the plugin reports (now_unix,
// last_iteration_unix) for a decision; request ages come from the plugin's
// age_seconds, which the Python plugin measures with time.perf_counter
// (monotonic). Behaviourally, a run whose wall clock is stepped by +2 h,
// -3 h and +30 min force-fails the pin at exactly the same simulated time
// and with the same calls as an undisturbed run, while the same steps on a
// wall-only clock (monotonic reading stripped) fail the pin 11 s early and
// force-fail progressing requests: the comparison can fail.
//
// What it cannot prove: the steps are made by writing time.Time's fields
// (no API can build a reading whose wall and monotonic parts disagree), not
// by stepping the machine's clock, which needs root and would disturb
// everything else on the host. It exercises the watchdog's decisions, not
// the kernel's CLOCK_MONOTONIC or Go's runtime timers (time.After,
// context deadlines), which are monotonic by construction.
func TestFaultWallClockJump(t *testing.T) {
	now := clock.Real{}.Now()
	if !strings.Contains(now.String(), " m=") {
		t.Fatalf("clock.Real.Now() has no monotonic reading: %s", now)
	}
	probe, ok := shiftWall(now, time.Hour)
	if !ok || probe.Sub(now) != 0 || probe.Round(0).Sub(now.Round(0)) != time.Hour {
		t.Skip("time.Time's layout is not the expected one; the wall-clock step cannot be simulated")
	}

	controlAt, controlCalls, _ := runWithJumps(t, false, false)
	if controlAt == 0 {
		t.Fatal("control run: the pin was not force-failed")
	}
	jumpAt, jumpCalls, _ := runWithJumps(t, true, false)
	if jumpAt != controlAt || jumpCalls != controlCalls {
		t.Errorf("with wall-clock steps the pin was failed after %s with %d calls; undisturbed: %s with %d calls",
			jumpAt, jumpCalls, controlAt, controlCalls)
	}
	// Negative control: the same steps on a clock without a monotonic
	// reading change the outcome, so the comparison above can fail.
	wallAt, _, wallHarm := runWithJumps(t, true, true)
	if wallAt == controlAt && wallHarm == 0 {
		t.Errorf("the wall-only control behaved like the monotonic run (%s): the steps were not applied", wallAt)
	}
	t.Logf("pin failed after %s undisturbed and %s with wall-clock steps; on a wall-only clock after %s (0 = never), with %d progressing requests force-failed",
		controlAt, jumpAt, wallAt, wallHarm)
}

// TestDecisionCodeUsesOnlyTheInjectedClock scans the watchdog's source:
// no time.Now/Since/Until (every reading comes from the injected clock),
// no method that strips the monotonic reading from a clock reading, and no
// use of the plugin's wall-clock fields.
func TestDecisionCodeUsesOnlyTheInjectedClock(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("..", "watchdog", "*.go"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no watchdog sources: %v", err)
	}
	forbiddenFuncs := map[string]bool{"Now": true, "Since": true, "Until": true, "Unix": true, "UnixMilli": true, "UnixMicro": true}
	// Methods of time.Time that drop the monotonic reading or read the
	// wall clock. (Round and Truncate also exist on Duration; their uses
	// are checked for a time.Duration-typed receiver below.)
	forbiddenMethods := map[string]bool{"UTC": true, "Local": true, "In": true, "Unix": true, "UnixNano": true, "UnixMilli": true, "UnixMicro": true}
	wallFields := map[string]bool{"NowUnix": true, "LastIterationUnix": true}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			pos := fset.Position(sel.Pos())
			if id, ok := sel.X.(*ast.Ident); ok && id.Name == "time" && forbiddenFuncs[sel.Sel.Name] {
				t.Errorf("%s: time.%s: decision code must read the injected clock", pos, sel.Sel.Name)
			}
			if forbiddenMethods[sel.Sel.Name] {
				t.Errorf("%s: .%s(): strips the monotonic reading or reads the wall clock", pos, sel.Sel.Name)
			}
			if wallFields[sel.Sel.Name] {
				t.Errorf("%s: .%s: the plugin host's wall clock must not drive a decision", pos, sel.Sel.Name)
			}
			return true
		})
	}
}
