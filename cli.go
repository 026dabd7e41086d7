package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"unicode"

	"github.com/sglang-watchdog/sglang-watchdog/internal/runconfig"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// maxTableRID caps a rid in the inflight table; --output=json has it whole.
const maxTableRID = 64

// healthCheckRIDPrefix starts the rid of SGLang's health checks.
const healthCheckRIDPrefix = "HEALTH_CHECK"

// fakeBootstrapHost is SGLang's FAKE_BOOTSTRAP_HOST, the bootstrap host of
// health checks and warm-up requests.
const fakeBootstrapHost = "2.2.2.2"

// isHealthCheck tells SGLang's health checks and warm-up requests: the
// plugin's flag, room 0, the fake bootstrap host, or the rid prefix
// (warm-ups have the host and room but not the prefix).
func isHealthCheck(r pluginapi.Room) bool {
	return healthCheck(r.HealthCheck, r.RID, r.BootstrapRoom, r.BootstrapAddr)
}

// isDecodeHealthCheck is isHealthCheck for a decode request.
func isDecodeHealthCheck(d pluginapi.DecodeRequest) bool {
	return healthCheck(d.HealthCheck, d.RID, d.BootstrapRoom, d.BootstrapAddr)
}

func healthCheck(flagged bool, rid string, room uint64, addr string) bool {
	host := addr
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	return flagged || room == 0 || host == fakeBootstrapHost || strings.HasPrefix(rid, healthCheckRIDPrefix)
}

// safe makes text from a plugin fit for a terminal: anything that is not
// printable (escape sequences, newlines, bidi controls) is escaped as Go
// quotes it, the way logfmt does, so that it cannot move the cursor or
// forge a row.
func safe(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) || r == '"' }) < 0 {
		return s
	}
	return strconv.Quote(s)
}

// rankListing is one rank's answer for the inflight command.
type rankListing struct {
	Target  string             `json:"target"`
	Listing *pluginapi.Listing `json:"listing,omitempty"`
	Error   string             `json:"error,omitempty"`
}

func fetchListings(ctx context.Context, urls []string, opts pluginapi.ClientOptions) []rankListing {
	out := make([]rankListing, len(urls))
	var wg sync.WaitGroup
	for i, u := range urls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i].Target = u
			l, err := pluginapi.NewClient(u, opts).Inflight(ctx)
			if err != nil {
				out[i].Error = err.Error()
				return
			}
			out[i].Listing = l
		}()
	}
	wg.Wait()
	return out
}

// runInflight prints every rank's rooms, oldest first. It exits 1 if any
// rank could not be read, so that scripts do not mistake a failure for an
// empty queue.
func runInflight(ctx context.Context, o *options, stdout, stderr io.Writer) int {
	listingRT, _, err := runconfig.PluginTransports(o.pluginTLSFile, "")
	if err == nil {
		err = errors.Join(runconfig.CheckURLs(o.allowRemote, o.pluginURLs...), runconfig.CheckDistinct(o.pluginURLs), runconfig.CheckTimeout("--plugin.timeout", o.ffInflight))
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", appName, err)
		return 2
	}
	results := fetchListings(ctx, o.pluginURLs, pluginapi.ClientOptions{Timeout: o.ffInflight, Transport: listingRT})
	failed := false
	for _, r := range results {
		if r.Error != "" {
			failed = true
			fmt.Fprintf(stderr, "%s: %s\n", appName, safe(r.Error))
		}
	}
	if o.output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(results); err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", appName, err)
			return 1
		}
	} else {
		printInflightTable(stdout, results)
	}
	if failed {
		return 1
	}
	return 0
}

type tableRow struct {
	rank        string
	room        pluginapi.Room
	healthCheck bool
}

type decodeRow struct {
	rank        string
	req         pluginapi.DecodeRequest
	healthCheck bool
}

// printInflightTable lists the prefill ranks' rooms, then the decode ranks'
// requests, each oldest first with health checks last, marked: they are
// never force-failed, so they must not head the list an operator picks from.
func printInflightTable(w io.Writer, results []rankListing) {
	var rows []tableRow
	var drows []decodeRow
	decodeRanks, prefillRanks := 0, 0
	for _, r := range results {
		if r.Listing == nil {
			continue
		}
		rank := fmt.Sprintf("dp%d/pp%d", r.Listing.Server.DPRank, r.Listing.Server.PPRank)
		if watchdog.RoleOf(r.Listing) == watchdog.RoleDecode {
			decodeRanks++
			for _, d := range r.Listing.DecodeRequests {
				drows = append(drows, decodeRow{rank: rank, req: d, healthCheck: isDecodeHealthCheck(d)})
			}
			continue
		}
		prefillRanks++
		for _, room := range r.Listing.Inflight {
			rows = append(rows, tableRow{rank: rank, room: room, healthCheck: isHealthCheck(room)})
		}
	}
	sort.SliceStable(rows, func(i, j int) bool {
		if rows[i].healthCheck != rows[j].healthCheck {
			return !rows[i].healthCheck
		}
		return rows[i].room.AgeSeconds > rows[j].room.AgeSeconds
	})
	sort.SliceStable(drows, func(i, j int) bool {
		if drows[i].healthCheck != drows[j].healthCheck {
			return !drows[i].healthCheck
		}
		return drows[i].req.AgeSeconds > drows[j].req.AgeSeconds
	})
	cut, checks := 0, 0
	tableRID := func(rid string, hc bool) (kind, shown string) {
		kind = "request"
		if hc {
			kind = "HEALTH_CHECK"
			checks++
		}
		if len(rid) > maxTableRID {
			rid = logging.Truncate(rid, maxTableRID)
			cut++
		}
		return kind, safe(rid)
	}
	// Ranks that could not be read count as prefill ranks, as before
	// decode listings existed; a decode-only read prints no prefill table.
	if decodeRanks == 0 || prefillRanks > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "RANK\tAGE\tPOLL\tPROGRESS\tKIND\tRID\tROOM\tSEND_FAILED")
		for _, r := range rows {
			kind, rid := tableRID(r.room.RID, r.healthCheck)
			fmt.Fprintf(tw, "%s\t%.1fs\t%s\t%d\t%s\t%s\t%d\t%t\n", r.rank, r.room.AgeSeconds, safe(r.room.Poll), r.room.Progress,
				kind, rid, r.room.BootstrapRoom, r.room.SendFailed)
		}
		tw.Flush()
		fmt.Fprintf(w, "%d inflight request(s) on %d rank(s)\n", len(rows), len(results)-decodeRanks)
	}
	started := 0
	if decodeRanks > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "RANK\tAGE\tQUEUE\tPOLL\tTRANSFER_STARTED\tPROGRESS\tKIND\tRID\tROOM")
		for _, r := range drows {
			kind, rid := tableRID(r.req.RID, r.healthCheck)
			ts := "unknown"
			if r.req.TransferStarted != nil {
				ts = strconv.FormatBool(*r.req.TransferStarted)
			}
			if transferMayBeLive(r.req) && !r.healthCheck {
				started++
			}
			fmt.Fprintf(tw, "%s\t%.1fs\t%s\t%s\t%s\t%s\t%s\t%s\t%d\n", r.rank, r.req.AgeSeconds, safe(r.req.Queue), safe(r.req.Poll), ts,
				decodeProgress(r.req), kind, rid, r.req.BootstrapRoom)
		}
		tw.Flush()
		fmt.Fprintf(w, "%d decode request(s) on %d decode rank(s)\n", len(drows), decodeRanks)
	}
	if checks > 0 {
		fmt.Fprintf(w, "%d HEALTH_CHECK row(s): SGLang's own health checks and warm-ups, listed last; they are never force-failed.\n", checks)
	}
	if started > 0 {
		fmt.Fprintf(w, "%d decode request(s) whose KV transfer started (or may have): force-fail refuses them (transfer_live) unless --prefill-stopped asserts that prefill stopped sending.\n", started)
	}
	if cut > 0 {
		fmt.Fprintf(w, "%d rid(s) longer than %d bytes are cut here; --output=json prints them whole.\n", cut, maxTableRID)
	}
}

// transferMayBeLive tells a decode request that the plugin refuses with
// transfer_live unless the order says prefill_stopped: in the transfer
// queue (a prealloc request has sent prefill no pages to write to), its
// transfer started (unknown counts as started) and its receiver is not in a
// terminal state.
func transferMayBeLive(d pluginapi.DecodeRequest) bool {
	started := d.TransferStarted == nil || *d.TransferStarted
	return d.Queue == pluginapi.DecodeQueueTransfer && started && d.Poll != pluginapi.PollSuccess && d.Poll != pluginapi.PollFailed
}

// decodeProgress is chunks received over chunks expected; "-" where the
// backend counts none (progress -1), "?" where the total is unknown.
func decodeProgress(d pluginapi.DecodeRequest) string {
	p := "-"
	if d.Progress >= 0 {
		p = strconv.FormatInt(d.Progress, 10)
	}
	if d.ChunksExpected == nil {
		return p + "/?"
	}
	return p + "/" + strconv.FormatInt(*d.ChunksExpected, 10)
}

// runForceFail force-fails one request. Several --plugin.url are the PP
// stages of one DP rank: SGLang releases a request only when every stage
// reports it terminal, so the order goes to every stage that lists it. It
// exits 0 only if the lever was set on every stage it was sent to, or with
// --dry-run would have been.
func runForceFail(ctx context.Context, o *options, stdout, stderr io.Writer) int {
	usage := func(format string, args ...interface{}) int {
		fmt.Fprintf(stderr, "%s: %s\n", appName, fmt.Sprintf(format, args...))
		return 2
	}
	if err := errors.Join(runconfig.CheckURLs(o.ffRemote, o.ffURLs...), runconfig.CheckDistinct(o.ffURLs), runconfig.CheckAdminTimeout("--force-fail.timeout", o.ffTimeout)); err != nil {
		return usage("%v", err)
	}
	listingRT, adminRT, err := runconfig.PluginTransports(o.pluginTLSFile, o.ffToken)
	if err != nil {
		return usage("%v", err)
	}
	order := pluginapi.ForceFailRequest{RID: o.rid, Reason: o.reason, DryRun: o.dryRun, PrefillStopped: o.prefillStopped}
	if strings.HasPrefix(o.rid, healthCheckRIDPrefix) {
		return usage("--rid %s is one of SGLang's health checks; they are never force-failed", safe(o.rid))
	}
	if o.room != "" {
		room, err := strconv.ParseUint(o.room, 10, 64)
		if err != nil {
			return usage("--room %s is not a 64-bit unsigned integer", safe(o.room))
		}
		if room == 0 {
			return usage("--room 0 is the room of SGLang's health checks and warm-ups; they are never force-failed")
		}
		order.BootstrapRoom = &room
	}
	stages, code := forceFailStages(ctx, o, listingRT, adminRT, stderr)
	if stages == nil {
		return code
	}
	decode, ok := false, true
	for _, st := range stages {
		decode = decode || st.decode
		if !forceFailStage(ctx, st, order, len(o.ffURLs) > 1, o.dryRun, stdout, stderr) {
			ok = false
		}
	}
	if !ok {
		return 1
	}
	switch {
	case o.dryRun:
	case decode:
		fmt.Fprintln(stdout, "The request is aborted: SGLang's next decode pass answers the client with an error and frees its KV pages (after prefill's ABORT_ACK, or 30 s, with deferred release). Confirm with `inflight` and sglang:num_transfer_failed_reqs_total (transfer queue) or sglang:num_bootstrap_failed_reqs_total (prealloc queue).")
	case len(stages) > 1:
		fmt.Fprintln(stdout, "The lever is set on every stage that listed the request: SGLang's Failed branch releases it once every stage reports it terminal (HTTP 500 to the client). Confirm with `inflight` on each stage and sglang:num_transfer_failed_reqs_total.")
	default:
		fmt.Fprintln(stdout, "The lever is set: SGLang's Failed branch releases the request on its next pass (HTTP 500 to the client). Confirm with `inflight` and sglang:num_transfer_failed_reqs_total.")
	}
	return 0
}

// ffStage is one plugin the force-fail order goes to.
type ffStage struct {
	url    string
	client *pluginapi.Client
	decode bool
}

// forceFailStages reads every given plugin first. A health check or warm-up
// found on any of them is refused: it has neither the rid prefix nor,
// unless given, a room, and an older plugin would act on it. With several
// URLs they must be stages of one DP rank, and only the stages that list
// the request get the order; a stage whose listing fails gets it anyway and
// its plugin decides. It returns nil and an exit code when nothing is sent.
func forceFailStages(ctx context.Context, o *options, listingRT, adminRT http.RoundTripper, stderr io.Writer) ([]ffStage, int) {
	var stages []ffStage
	dpRanks := map[int]string{}
	for _, u := range o.ffURLs {
		client := pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: o.ffTimeout, AdminTimeout: o.ffTimeout,
			Transport: listingRT, AdminTransport: adminRT})
		l, err := client.Inflight(ctx)
		if err != nil {
			if len(o.ffURLs) > 1 {
				fmt.Fprintf(stderr, "%s: the listing of %s failed (%s); sending the order anyway, the plugin checks the request itself\n", appName, safe(u), safe(err.Error()))
			}
			stages = append(stages, ffStage{url: u, client: client})
			continue
		}
		for _, r := range l.Inflight {
			if r.RID == o.rid && isHealthCheck(r) {
				return nil, refuseHealthCheck(stderr, o.rid, r.BootstrapRoom, r.BootstrapAddr)
			}
		}
		for _, d := range l.DecodeRequests {
			if d.RID == o.rid && isDecodeHealthCheck(d) {
				return nil, refuseHealthCheck(stderr, o.rid, d.BootstrapRoom, d.BootstrapAddr)
			}
		}
		dpRanks[l.Server.DPRank] = u
		if len(o.ffURLs) > 1 && !lists(l, o.rid) {
			fmt.Fprintf(stderr, "%s: %s does not list %s; not sent there\n", appName, safe(u), safe(o.rid))
			continue
		}
		stages = append(stages, ffStage{url: u, client: client, decode: watchdog.RoleOf(l) == watchdog.RoleDecode})
	}
	if len(dpRanks) > 1 {
		fmt.Fprintf(stderr, "%s: the --plugin.url given are not the stages of one DP rank (they report dp_rank %s); give one rank's stages at a time\n", appName, joinRanks(dpRanks))
		return nil, 2
	}
	if len(stages) == 0 {
		fmt.Fprintf(stderr, "%s: no stage lists %s\n", appName, safe(o.rid))
		return nil, 1
	}
	return stages, 0
}

func refuseHealthCheck(stderr io.Writer, rid string, room uint64, addr string) int {
	fmt.Fprintf(stderr, "%s: refused: %s is a health check or warm-up of SGLang (room %d, bootstrap %s); they are never force-failed\n",
		appName, safe(rid), room, safe(addr))
	return 1
}

// lists tells whether a listing holds the rid, prefill or decode.
func lists(l *pluginapi.Listing, rid string) bool {
	for _, r := range l.Inflight {
		if r.RID == rid {
			return true
		}
	}
	for _, d := range l.DecodeRequests {
		if d.RID == rid {
			return true
		}
	}
	return false
}

func joinRanks(ranks map[int]string) string {
	var out []string
	for dp := range ranks {
		out = append(out, strconv.Itoa(dp))
	}
	sort.Strings(out)
	return strings.Join(out, ", ")
}

// forceFailStage sends the order to one stage and prints its answer, with
// the stage's URL when there are several. It reports whether the lever was
// set (or, for a dry run, would be).
func forceFailStage(ctx context.Context, st ffStage, order pluginapi.ForceFailRequest, several, dryRun bool, stdout, stderr io.Writer) bool {
	status, resp, err := st.client.ForceFail(ctx, order)
	if err != nil {
		fmt.Fprintf(stderr, "%s: force-fail failed: %s\n", appName, safe(err.Error()))
		return false
	}
	if several {
		fmt.Fprintf(stdout, "stage=%s ", safe(st.url))
	}
	fmt.Fprintf(stdout, "result=%s http_status=%d rid=%s", safe(resp.Result), status, safe(order.RID))
	if resp.BootstrapRoom != nil {
		fmt.Fprintf(stdout, " room=%d", *resp.BootstrapRoom)
	}
	if resp.Lever != "" {
		fmt.Fprintf(stdout, " lever=%s", safe(resp.Lever))
	}
	if resp.Error != "" {
		fmt.Fprintf(stdout, " error=%q", resp.Error)
	}
	fmt.Fprintln(stdout)
	if resp.Result == pluginapi.ResultTransferLive {
		fmt.Fprintf(stderr, "%s: refused by the decode plugin: the KV transfer into this request's pages has started and may still be live; "+
			"freeing them now could let a late write from prefill corrupt another request's KV. Check that the prefill peer stopped sending "+
			"for this room (its watchdog's GET /api/v1/rooms/<room> answers \"stopped\", or the prefill request is gone), then repeat with --prefill-stopped.\n", appName)
		return false
	}
	return status == http.StatusOK && (resp.Result == pluginapi.ResultFlipped || resp.Result == pluginapi.ResultAlreadyFailed ||
		(dryRun && resp.Result == pluginapi.ResultWouldFlip))
}
