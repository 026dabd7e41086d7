package clock

import (
	"testing"
	"time"
)

func TestFakeAfterFiresOnlyWhenDue(t *testing.T) {
	f := NewFake(time.Now())
	ch := f.After(10 * time.Second)
	f.Advance(9 * time.Second)
	select {
	case <-ch:
		t.Fatal("fired 1s early")
	default:
	}
	f.Advance(time.Second)
	select {
	case <-ch:
	default:
		t.Fatal("did not fire when due")
	}
}

func TestFakeKeepsMonotonicDurations(t *testing.T) {
	start := time.Now()
	f := NewFake(start)
	f.Advance(90 * time.Second)
	if got := f.Now().Sub(start); got != 90*time.Second {
		t.Fatalf("elapsed %v, want 90s", got)
	}
}
