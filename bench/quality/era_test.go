package main

import (
	"strings"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// TestEraMechanisms: a trace of SGLang's releases pins only by a stuck
// handle unless -era forks says otherwise, and a mechanism those releases
// conclude on their own is refused with the flag that allows it.
func TestEraMechanisms(t *testing.T) {
	o := options{era: eraReleases}
	if err := checkMechanisms(&o); err != nil {
		t.Fatal(err)
	}
	if got := pinMechanisms(o.mechanisms); len(got) != 1 || got[0] != sglangsim.BehaviorPinStuckHandle {
		t.Fatalf("releases era pins by %v, want the stuck handle only", got)
	}

	o = options{era: eraReleases, mechanisms: "stuck-handle,resurrection"}
	err := checkMechanisms(&o)
	if err == nil || !strings.Contains(err.Error(), "resurrection") || !strings.Contains(err.Error(), "-era forks") {
		t.Fatalf("resurrection on the releases era: %v, want a refusal naming it and -era forks", err)
	}

	o = options{era: eraForks}
	if err := checkMechanisms(&o); err != nil {
		t.Fatal(err)
	}
	if got := pinMechanisms(o.mechanisms); len(got) != 3 {
		t.Fatalf("forks era pins by %v, want all three mechanisms", got)
	}

	for _, bad := range []options{{era: "v0.5.18"}, {era: eraForks, mechanisms: "stuck"}} {
		if err := checkMechanisms(&bad); err == nil {
			t.Fatalf("%+v accepted", bad)
		}
	}
}
