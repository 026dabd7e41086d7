package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"text/tabwriter"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

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
	if err := checkURLs(o.allowRemote, o.pluginURLs...); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", appName, err)
		return 2
	}
	results := fetchListings(ctx, o.pluginURLs, pluginapi.ClientOptions{Timeout: o.ffInflight})
	failed := false
	for _, r := range results {
		if r.Error != "" {
			failed = true
			fmt.Fprintf(stderr, "%s: %s\n", appName, r.Error)
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
	rank string
	room pluginapi.Room
}

func printInflightTable(w io.Writer, results []rankListing) {
	var rows []tableRow
	for _, r := range results {
		if r.Listing == nil {
			continue
		}
		rank := fmt.Sprintf("dp%d/pp%d", r.Listing.Server.DPRank, r.Listing.Server.PPRank)
		for _, room := range r.Listing.Inflight {
			rows = append(rows, tableRow{rank: rank, room: room})
		}
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].room.AgeSeconds > rows[j].room.AgeSeconds })
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RANK\tAGE\tPOLL\tPROGRESS\tRID\tROOM\tHEALTH_CHECK\tSEND_FAILED")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%.1fs\t%s\t%d\t%s\t%d\t%t\t%t\n", r.rank, r.room.AgeSeconds, r.room.Poll, r.room.Progress,
			r.room.RID, r.room.BootstrapRoom, r.room.HealthCheck, r.room.SendFailed)
	}
	tw.Flush()
	fmt.Fprintf(w, "%d inflight request(s) on %d rank(s)\n", len(rows), len(results))
}

// runForceFail makes one admin call. It exits 0 only if the lever was set,
// or with --dry-run would have been.
func runForceFail(ctx context.Context, o *options, stdout, stderr io.Writer) int {
	if err := checkURLs(o.ffRemote, o.oneURL); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", appName, err)
		return 2
	}
	token, err := readToken(o.ffToken)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", appName, err)
		return 2
	}
	order := pluginapi.ForceFailRequest{RID: o.rid, Reason: o.reason, DryRun: o.dryRun}
	if o.room != "" {
		room, err := strconv.ParseUint(o.room, 10, 64)
		if err != nil {
			fmt.Fprintf(stderr, "%s: --room %q is not a 64-bit unsigned integer\n", appName, o.room)
			return 2
		}
		order.BootstrapRoom = &room
	}
	client := pluginapi.NewClient(o.oneURL, pluginapi.ClientOptions{AdminTimeout: o.ffTimeout, Token: token})
	status, resp, err := client.ForceFail(ctx, order)
	if err != nil {
		fmt.Fprintf(stderr, "%s: force-fail failed: %v\n", appName, err)
		return 1
	}
	fmt.Fprintf(stdout, "result=%s http_status=%d rid=%s", resp.Result, status, o.rid)
	if resp.BootstrapRoom != nil {
		fmt.Fprintf(stdout, " room=%d", *resp.BootstrapRoom)
	}
	if resp.Lever != "" {
		fmt.Fprintf(stdout, " lever=%s", resp.Lever)
	}
	if resp.Error != "" {
		fmt.Fprintf(stdout, " error=%q", resp.Error)
	}
	fmt.Fprintln(stdout)
	ok := status == http.StatusOK && (resp.Result == pluginapi.ResultFlipped || resp.Result == pluginapi.ResultAlreadyFailed ||
		(o.dryRun && resp.Result == pluginapi.ResultWouldFlip))
	if !ok {
		return 1
	}
	if resp.Result == pluginapi.ResultFlipped {
		fmt.Fprintln(stdout, "The lever is set: SGLang's Failed branch releases the request on its next pass (HTTP 500 to the client). Confirm with `inflight` and sglang:num_transfer_failed_reqs_total.")
	}
	return 0
}
