package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/sglangsim"
)

// decodeSim serves a simulator's decode pod on loopback, its loops stepped
// by hand: a request still bootstrapping (prealloc queue, transfer not
// started), one whose transfer started and never ends, and a decode health
// check that never ends.
func decodeSim(t *testing.T) (s *sglangsim.Sim, pluginURLs []string, boot, live, hc string) {
	t.Helper()
	clk := clock.NewFake(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	s, err := sglangsim.New(sglangsim.Options{Clock: clk, Backend: sglangsim.BackendNIXL, Era: sglangsim.EraNewest})
	if err != nil {
		t.Fatal(err)
	}
	live, _ = s.Submit(sglangsim.RequestSpec{Behavior: sglangsim.BehaviorSlow, Transfer: -1, ChunkEvery: time.Second})
	for i := 0; i < 20; i++ {
		clk.Advance(100 * time.Millisecond)
		s.Step()
	}
	boot, _ = s.Submit(sglangsim.RequestSpec{Bootstrap: time.Hour})
	hc = s.SubmitDecodeHealthCheck(0, false, true)
	for i := 0; i < 10; i++ {
		clk.Advance(100 * time.Millisecond)
		s.Step()
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	_, pluginURLs, err = s.ListenDecode(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return s, pluginURLs, boot, live, hc
}

func decodeRequest(t *testing.T, s *sglangsim.Sim, rid string) (pluginapi.DecodeRequest, bool) {
	t.Helper()
	for _, d := range s.DecodeListing(0).DecodeRequests {
		if d.RID == rid {
			return d, true
		}
	}
	return pluginapi.DecodeRequest{}, false
}

// TestInflightListsDecodeRequests: against a decode plugin the command
// lists the prealloc and transfer queues, oldest first, the health check
// last and marked, with whether each transfer started; JSON carries the
// listing whole.
func TestInflightListsDecodeRequests(t *testing.T) {
	s, urls, boot, live, hc := decodeSim(t)
	d, ok := decodeRequest(t, s, live)
	if !ok || d.Queue != pluginapi.DecodeQueueTransfer || d.TransferStarted == nil || !*d.TransferStarted || d.Progress < 1 || d.ChunksExpected != nil {
		t.Fatalf("setup: the live request is %+v", d)
	}
	var out, errb bytes.Buffer
	if code := run([]string{"inflight", "--plugin.url=" + urls[0]}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	text := out.String()
	lines := strings.Split(strings.TrimSpace(text), "\n")
	// header, 3 rows, count, health-check note, transfer-started note
	if len(lines) != 7 {
		t.Fatalf("%d lines, want 7:\n%s", len(lines), text)
	}
	if f := strings.Fields(lines[0]); strings.Join(f, " ") != "RANK AGE QUEUE POLL TRANSFER_STARTED PROGRESS KIND RID ROOM" {
		t.Errorf("header %q", lines[0])
	}
	for i, want := range []struct{ rid, queue, started, kind string }{
		{live, "transfer", "true", "request"},
		{boot, "prealloc", "false", "request"},
		{hc, "transfer", "false", "HEALTH_CHECK"},
	} {
		f := strings.Fields(lines[i+1])
		if len(f) != 9 || f[2] != want.queue || f[4] != want.started || f[6] != want.kind || f[7] != want.rid {
			t.Errorf("row %d is %q, want %+v", i+1, lines[i+1], want)
		}
	}
	if f := strings.Fields(lines[1]); f[5] != fmt.Sprintf("%d/?", d.Progress) {
		t.Errorf("progress of the live transfer %q, want %d/? (chunks received, total unknown)", f[5], d.Progress)
	}
	if !strings.Contains(text, "3 decode request(s) on 1 decode rank(s)") || strings.Contains(text, "inflight request(s)") ||
		!strings.Contains(text, "1 decode request(s) whose KV transfer started") || !strings.Contains(text, "--prefill-stopped") {
		t.Errorf("summary lines:\n%s", text)
	}

	out.Reset()
	if code := run([]string{"inflight", "--plugin.url=" + urls[0], "--output=json"}, &out, &errb); code != 0 {
		t.Fatalf("json: exit %d: %s", code, errb.String())
	}
	var got []rankListing
	if err := json.Unmarshal(out.Bytes(), &got); err != nil || len(got) != 1 || got[0].Listing == nil ||
		got[0].Listing.Server.DisaggregationMode != pluginapi.ModeDecode || len(got[0].Listing.DecodeRequests) != 3 {
		t.Fatalf("json output %v:\n%s", err, out.String())
	}
}

// TestInflightDecodeTableIsSafeForATerminal: decode rids are escaped and
// cut as prefill rids are; a mixed read prints both tables.
func TestInflightDecodeTableIsSafeForATerminal(t *testing.T) {
	four := int64(4)
	yes := true
	var buf bytes.Buffer
	printInflightTable(&buf, []rankListing{
		{Target: "p", Listing: &pluginapi.Listing{Inflight: []pluginapi.Room{{RID: "pre", BootstrapRoom: 7, AgeSeconds: 1}}}},
		{Target: "d", Listing: &pluginapi.Listing{Server: pluginapi.Server{DisaggregationMode: pluginapi.ModeDecode},
			DecodeRequests: []pluginapi.DecodeRequest{
				{RID: "a\ndp0/pp0  9.0s  transfer  Success  false  4/4  request  forged  1", BootstrapRoom: 11, Queue: "transfer",
					AgeSeconds: 20, Progress: 2, ChunksExpected: &four, TransferStarted: &yes},
				{RID: "red\x1b[31m" + strings.Repeat("x", 500), BootstrapRoom: 12, Queue: "prealloc", AgeSeconds: 10, Progress: -1},
				// Unknown in the transfer queue counts as started.
				{RID: "unsure", BootstrapRoom: 14, Queue: "transfer", Poll: pluginapi.PollWaitingForInput, AgeSeconds: 7, Progress: -1},
				// Done: not counted as a transfer that may be live, nor is
				// the prealloc request above.
				{RID: "done", BootstrapRoom: 13, Queue: "transfer", Poll: pluginapi.PollSuccess, AgeSeconds: 5, Progress: 4,
					ChunksExpected: &four, TransferStarted: &yes},
			}}},
	})
	out := buf.String()
	if strings.ContainsAny(out, "\x1b") {
		t.Errorf("raw control characters reached the terminal:\n%q", out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	// prefill header, row, count; decode header, 4 rows, count; started note, cut note
	if len(lines) != 11 {
		t.Fatalf("%d lines, want 11 (a rid forged a row?):\n%s", len(lines), out)
	}
	if !strings.Contains(lines[2], "1 inflight request(s) on 1 rank(s)") || !strings.Contains(lines[4], `"a\ndp0`) ||
		!strings.Contains(lines[4], "2/4") || !strings.Contains(lines[5], "-/?") || !strings.Contains(lines[5], "unknown") ||
		!strings.Contains(lines[5], "more bytes]") || !strings.Contains(lines[6], "unsure") || !strings.Contains(lines[6], "unknown") ||
		!strings.Contains(lines[7], "done") || !strings.Contains(lines[7], "4/4") ||
		!strings.Contains(lines[8], "4 decode request(s) on 1 decode rank(s)") ||
		!strings.Contains(lines[9], "2 decode request(s) whose KV transfer started (or may have)") {
		t.Errorf("table:\n%s", out)
	}
}

// TestForceFailDecode: against a decode plugin, a started transfer is
// refused as transfer_live without --prefill-stopped, and the command says
// what to check; with it the order carries prefill_stopped; a request whose
// transfer has not started needs no assertion; decode health checks are
// refused before any call.
func TestForceFailDecode(t *testing.T) {
	s, urls, boot, live, hc := decodeSim(t)
	ff := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := run(append([]string{"force-fail", "--plugin.url=" + urls[0]}, args...), &out, &errb)
		return code, out.String(), errb.String()
	}
	for _, dry := range []string{"--dry-run", "--reason=test"} {
		code, out, errb := ff("--rid="+live, dry)
		if code != 1 || !strings.Contains(out, "result=transfer_live http_status=409") ||
			!strings.Contains(errb, "may still be live") || !strings.Contains(errb, "--prefill-stopped") {
			t.Errorf("%s without --prefill-stopped: exit %d\n%s%s", dry, code, out, errb)
		}
	}
	if _, ok := decodeRequest(t, s, live); !ok {
		t.Fatal("a refused order released the request")
	}
	if code, out, errb := ff("--rid="+live, "--prefill-stopped", "--dry-run"); code != 0 || !strings.Contains(out, "result=would_flip") {
		t.Errorf("dry run with --prefill-stopped: exit %d\n%s%s", code, out, errb)
	}
	if code, out, errb := ff("--rid="+boot, "--dry-run"); code != 0 || !strings.Contains(out, "result=would_flip") {
		t.Errorf("transfer not started: exit %d\n%s%s", code, out, errb)
	}
	if code, out, errb := ff("--rid="+hc, "--prefill-stopped"); code == 0 || !strings.Contains(errb, "never force-failed") || strings.Contains(out, "flipped") {
		t.Errorf("decode health check: exit %d\n%s%s", code, out, errb)
	}
	code, out, errb := ff("--rid="+live, "--prefill-stopped")
	if code != 0 || !strings.Contains(out, "result=flipped") || !strings.Contains(out, "next decode pass") {
		t.Errorf("force-fail with --prefill-stopped: exit %d\n%s%s", code, out, errb)
	}
}
