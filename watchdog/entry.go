package watchdog

import "github.com/sglang-watchdog/sglang-watchdog/pluginapi"

// entry is one request of a listing, prefill room or decode request, in
// the fields the watchdog decides on.
type entry struct {
	rid      string
	room     uint64
	addr     string
	poll     string
	age      float64
	progress int64
	health   bool
	prompt   int
	// Prefill only (nil on decode and with an older plugin). tracked: the
	// listing says inFlight is read from the backend on every rank that
	// sends (Server.SeesEveryWriter), so that false means no chunk in
	// flight anywhere.
	inFlight *bool
	queue    *int
	tracked  bool
	// chunksQueued is the room's chunks_queued, 0 when unknown;
	// peerChunksQueued its peer_chunks_queued, likewise.
	chunksQueued     int
	peerChunksQueued int
	// Decode only.
	dqueue        string
	started       bool
	waitingMemory bool
	// prefillAddrs are the prefill ranks the receiver talks to
	// (prefill_rank_addrs), where the verdict is asked.
	prefillAddrs []string
}

func (e *entry) key() roomKey { return roomKey{e.rid, e.room} }

// RoleOf tells a rank's role from its listing: RoleDecode for a decode
// plugin (disaggregation_mode "decode"), RolePrefill otherwise.
func RoleOf(l *pluginapi.Listing) string {
	if l.Server.DisaggregationMode == pluginapi.ModeDecode {
		return RoleDecode
	}
	return RolePrefill
}

// entries lists the requests of a listing that the watchdog watches: the
// inflight rooms of a prefill rank, the decode requests of a decode rank.
func entries(l *pluginapi.Listing) []entry {
	if RoleOf(l) == RoleDecode {
		out := make([]entry, len(l.DecodeRequests))
		for i := range l.DecodeRequests {
			d := &l.DecodeRequests[i]
			out[i] = entry{rid: d.RID, room: d.BootstrapRoom, addr: d.BootstrapAddr, poll: d.Poll, age: d.AgeSeconds,
				progress: d.Progress, health: d.HealthCheck, dqueue: d.Queue, started: transferMayHaveStarted(d),
				waitingMemory: d.WaitingForMemory && d.Queue == pluginapi.DecodeQueuePrealloc, prefillAddrs: d.PrefillRankAddrs}
		}
		return out
	}
	tracked := l.Server.SeesEveryWriter()
	out := make([]entry, len(l.Inflight))
	for i := range l.Inflight {
		r := &l.Inflight[i]
		out[i] = entry{rid: r.RID, room: r.BootstrapRoom, addr: r.BootstrapAddr, poll: r.Poll, age: r.AgeSeconds, progress: r.Progress,
			health: r.HealthCheck, prompt: r.PromptTokens, inFlight: r.TransferInFlight, queue: r.TransferQueue, tracked: tracked}
		if r.ChunksQueued != nil {
			out[i].chunksQueued = *r.ChunksQueued
		}
		if r.PeerChunksQueued != nil {
			out[i].peerChunksQueued = *r.PeerChunksQueued
		}
	}
	return out
}

// findEntry returns the listed request with key, or nil.
func findEntry(l *pluginapi.Listing, key roomKey) *entry {
	for _, e := range entries(l) {
		if e.key() == key {
			return &e
		}
	}
	return nil
}

// transferMayHaveStarted tells whether a transfer into a decode request's
// pages may have begun. Only an explicit "not started" with nothing else
// showing a transfer counts as not started: unknown counts as started.
func transferMayHaveStarted(d *pluginapi.DecodeRequest) bool {
	return d.TransferStarted == nil || *d.TransferStarted || d.Poll == pluginapi.PollTransferring || d.Progress > 0
}
