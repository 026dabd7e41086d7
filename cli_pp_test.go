package main

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// TestForceFailEveryPPStage: SGLang releases a request under pipeline
// parallelism only when every stage reports it terminal. force-fail with
// one stage's URL sets that stage's lever and releases nothing; with the
// URLs of both stages the order goes to each and the request leaves. URLs
// of two DP ranks are refused before any call.
func TestForceFailEveryPPStage(t *testing.T) {
	clk := clock.NewFake(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	s, err := sglangsim.New(sglangsim.Options{Clock: clk, DPSize: 2, PPSize: 2, Backend: sglangsim.BackendNIXL, Era: sglangsim.EraNewest})
	if err != nil {
		t.Fatal(err)
	}
	step := func(n int) {
		for i := 0; i < n; i++ {
			clk.Advance(100 * time.Millisecond)
			s.Step()
		}
	}
	rid, room := s.Inject(s.RankIndex(0, 0), sglangsim.PinResurrection)
	step(30)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	_, urls, err := s.Listen(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stage0, stage1, otherDP := urls[s.RankIndex(0, 0)], urls[s.RankIndex(0, 1)], urls[s.RankIndex(1, 0)]
	listed := func(dp, pp int) bool {
		for _, r := range s.Listing(s.RankIndex(dp, pp)).Inflight {
			if r.RID == rid {
				return true
			}
		}
		return false
	}
	if !listed(0, 0) || !listed(0, 1) {
		t.Fatalf("the pin is not listed on both stages of dp0")
	}
	forceFail := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := run(append([]string{"force-fail", "--rid=" + rid, "--room=" + strconv.FormatUint(room, 10)}, args...), &out, &errb)
		return code, out.String(), errb.String()
	}

	if code, out, errb := forceFail("--plugin.url=" + stage0); code != 0 || !strings.Contains(out, "result=flipped") {
		t.Fatalf("one stage: exit %d\n%s%s", code, out, errb)
	}
	step(5)
	if !listed(0, 0) || !listed(0, 1) {
		t.Fatalf("a flip on one stage released the request; SGLang waits for every stage")
	}

	code, out, errb := forceFail("--plugin.url="+otherDP, "--plugin.url="+stage1)
	if code != 2 || !strings.Contains(errb, "not the stages of one DP rank") {
		t.Fatalf("stages of two DP ranks: exit %d\n%s%s", code, out, errb)
	}
	step(5)
	if !listed(0, 1) {
		t.Fatalf("the refused command reached stage 1")
	}

	code, out, errb = forceFail("--plugin.url="+stage0, "--plugin.url="+stage1)
	if code != 0 || strings.Count(out, "stage=") != 2 || !strings.Contains(out, "stage="+stage1+" result=flipped") ||
		!strings.Contains(out, "stage="+stage0+" result=already_failed") {
		t.Fatalf("both stages: exit %d\n%s%s", code, out, errb)
	}
	step(5)
	if listed(0, 0) || listed(0, 1) {
		t.Fatalf("the request is still listed after both stages were failed")
	}
}
