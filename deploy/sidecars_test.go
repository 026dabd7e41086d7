package deploy

import (
	"slices"
	"strings"
	"testing"
)

func TestSidecarArgsCoverEverythingShipped(t *testing.T) {
	all, err := SidecarArgs()
	if err != nil {
		t.Fatal(err)
	}
	count := map[string]int{}
	var extra bool
	for k, args := range all {
		f, _, _ := strings.Cut(k, "#")
		count[f]++
		if slices.Contains(args, "--watchdog.deadline=90s") {
			extra = true
		}
	}
	for f, want := range map[string]int{
		"kubernetes/prefill/deployment.yaml":     1,
		"kubernetes/decode/deployment.yaml":      1,
		"helm/testdata/sidecar-default.yaml":     2,
		"helm/testdata/sidecar-full.yaml":        2,
		"helm/testdata/sidecar-decode-only.yaml": 1,
		"helm/testdata/sidecar-hostnetwork.yaml": 2,
		// Leader and worker of prefill and decode (DP attention on two nodes).
		"examples/leaderworkerset/sglang-pd.yaml": 4,
		"examples/rolebasedgroup/sglang-pd.yaml":  2,
		// Prefill, and decode's leader and worker (DP attention on two nodes).
		"examples/disaggregatedset/sglang-pd.yaml": 3,
	} {
		if count[f] != want {
			t.Errorf("%s: %d sidecars, want %d", f, count[f], want)
		}
	}
	if !extra {
		t.Error("the chart's extraArgs (ci/full-values.yaml) are not among the args")
	}
}
