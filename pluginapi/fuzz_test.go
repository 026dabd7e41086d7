package pluginapi

import (
	"encoding/json"
	"fmt"
	"math"
	"testing"
)

// FuzzDecodeListing feeds arbitrary bodies to the listing decoder. It must
// never panic, and every listing it accepts must satisfy the rules the
// watchdog relies on.
func FuzzDecodeListing(f *testing.F) {
	f.Add([]byte(exampleListing))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[]}`))
	f.Add([]byte(`{"api_version":1,"server":{},"loop":{},"inflight":[{"rid":"a","bootstrap_room":18446744073709551615,"poll":"Failed","age_seconds":0,"progress":-1}]}`))
	f.Add([]byte(round2Listing))
	f.Add([]byte(`{"api_version":1,"server":{"transfer_queues":2,"pp_size":2,"pp_rank":1},"loop":{},"inflight":[{"rid":"a","poll":"Failed","transfer_queue":1,"transfer_in_flight":false}],"orphaned_transfers":[{"bootstrap_room":1,"transfer_queue":1,"outstanding_chunks":1}]}`))
	f.Add([]byte(decodeListing))
	f.Add([]byte(`{"api_version":1,"server":{"disaggregation_mode":"decode"},"loop":{},"inflight":[],"decode_requests":[{"rid":"a","queue":"transfer","poll":"Transferring","age_seconds":1,"progress":-1,"chunks_expected":0,"transfer_started":null}]}`))
	f.Add([]byte(round4Listing))
	f.Add([]byte(round5Listing))
	f.Add([]byte(kvThreadsListing))
	f.Add([]byte(`{"api_version":1,"server":{"transfer_queues":1},"loop":{},"inflight":[],"kv_threads":[{"role":"transfer_worker","function":"transfer_worker","transfer_queue":0,"alive":false},{"role":"decode_listener","alive":true}]}`))
	f.Add([]byte(`{"api_version":2}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		l, err := DecodeListing(body)
		if err != nil {
			return
		}
		if l.APIVersion != APIVersion || l.Inflight == nil {
			t.Fatalf("accepted listing without version or inflight: %+v", l)
		}
		inRange := func(q *int) bool {
			return q == nil || (*q >= 0 && (l.Server.TransferQueues == nil || *q < *l.Server.TransferQueues))
		}
		for i, r := range l.Inflight {
			if r.RID == "" || !validPoll[r.Poll] || !(r.AgeSeconds >= 0) || r.Progress < -1 || !inRange(r.TransferQueue) {
				t.Fatalf("accepted invalid room %d: %+v", i, r)
			}
		}
		for i, o := range l.OrphanedTransfers {
			if o.OutstandingChunks < 1 || !inRange(o.TransferQueue) {
				t.Fatalf("accepted invalid orphaned transfer %d: %+v", i, o)
			}
		}
		for i, d := range l.DecodeRequests {
			if d.RID == "" || !validPoll[d.Poll] || !(d.AgeSeconds >= 0) || d.Progress < -1 || (d.Queue != DecodeQueuePrealloc && d.Queue != DecodeQueueTransfer) ||
				(d.ChunksExpected != nil && *d.ChunksExpected < 0) {
				t.Fatalf("accepted invalid decode request %d: %+v", i, d)
			}
		}
		// The leader copies the other ranks' workers from their peer files
		// (round 5): they must meet the rules of its own.
		checkWorker := func(where string, tw TransferWorker) {
			q := tw.TransferQueue
			if !inRange(&q) || tw.Depth < 0 || (tw.InFlight != nil && !(tw.InFlight.Seconds >= 0 && tw.InFlight.Pages >= 0 && len(tw.InFlight.Link) <= MaxLinkLength)) {
				t.Fatalf("accepted invalid transfer worker %s: %+v", where, tw)
			}
			for _, s := range tw.Recent {
				if !(s[0] >= 0 && s[1] >= 0) {
					t.Fatalf("accepted invalid sample of transfer worker %s: %v", where, s)
				}
			}
			for j, c := range tw.Finished {
				if !(c.Seconds >= 0) || math.IsInf(c.Seconds, 0) || c.Pages < 0 || len(c.Link) > MaxLinkLength || (j > 0 && c.Chunk <= tw.Finished[j-1].Chunk) {
					t.Fatalf("accepted invalid finished chunk %d of transfer worker %s: %+v", j, where, c)
				}
			}
		}
		for i, tw := range l.TransferWorkers {
			checkWorker(fmt.Sprint(i), tw)
		}
		for i, p := range l.PeerTransferWorkers {
			for j, tw := range p.TransferWorkers {
				checkWorker(fmt.Sprintf("%d of peer %d (%s)", j, i, p.Rank), tw)
			}
		}
		for i, th := range l.KVThreads {
			if !validThreadRole[th.Role] || len(th.Function) > MaxThreadFunction || !inRange(th.TransferQueue) {
				t.Fatalf("accepted invalid kv thread %d: %+v", i, th)
			}
		}
		if s := l.Server; s.PPSize < 0 || (s.PPSize > 0 && s.PPRank >= s.PPSize) || (s.TransferQueues != nil && *s.TransferQueues < 1) {
			t.Fatalf("accepted invalid server: %+v", s)
		}
		if _, err := json.Marshal(l); err != nil {
			t.Fatalf("accepted listing cannot be re-encoded: %v", err)
		}
	})
}
