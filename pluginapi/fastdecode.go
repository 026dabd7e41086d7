package pluginapi

import (
	"strconv"
)

// decodeWireFast parses a listing body that uses exactly the documented
// fields, with plain ASCII strings (no escapes), into w. It reports false on
// anything else (an unknown or null field, an escape, a type mismatch,
// malformed JSON), and the caller then decodes with encoding/json, which
// also words every error; so the fast path never accepts what
// encoding/json would reject, and never decodes differently.
func decodeWireFast(body []byte, w *wireListing) bool {
	d := fastDecoder{b: body}
	if !d.object(d.top(w)) {
		return false
	}
	d.ws()
	return d.i == len(d.b)
}

type fastDecoder struct {
	b []byte
	i int
	// lastAddr lets rooms share the bootstrap address string, which is
	// almost always the same.
	lastAddr string
	// links lets chunks share their link's name: a worker lists its few
	// links up to 33 times.
	links map[string]string
	seen  []string
}

func (d *fastDecoder) ws() {
	for d.i < len(d.b) {
		switch d.b[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
}

func (d *fastDecoder) consume(c byte) bool {
	d.ws()
	if d.i < len(d.b) && d.b[d.i] == c {
		d.i++
		return true
	}
	return false
}

// rawString returns the bytes of a string without escapes or non-ASCII.
func (d *fastDecoder) rawString() ([]byte, bool) {
	d.ws()
	if d.i >= len(d.b) || d.b[d.i] != '"' {
		return nil, false
	}
	start := d.i + 1
	for j := start; j < len(d.b); j++ {
		c := d.b[j]
		switch {
		case c == '"':
			d.i = j + 1
			return d.b[start:j], true
		case c == '\\' || c < 0x20 || c >= 0x80:
			return nil, false
		}
	}
	return nil, false
}

func (d *fastDecoder) str() (string, bool) {
	b, ok := d.rawString()
	return string(b), ok
}

// number returns a JSON number literal (RFC 8259 grammar).
func (d *fastDecoder) number() ([]byte, bool) {
	d.ws()
	b, i := d.b, d.i
	start := i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		return nil, false
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			return nil, false
		}
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			return nil, false
		}
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	}
	d.i = i
	return b[start:i], true
}

func (d *fastDecoder) int64v(bits int) (int64, bool) {
	lit, ok := d.number()
	if !ok {
		return 0, false
	}
	v, err := strconv.ParseInt(string(lit), 10, bits)
	return v, err == nil
}

func (d *fastDecoder) intv() (int, bool) {
	v, ok := d.int64v(strconv.IntSize)
	return int(v), ok
}

func (d *fastDecoder) uint64v() (uint64, bool) {
	lit, ok := d.number()
	if !ok {
		return 0, false
	}
	v, err := strconv.ParseUint(string(lit), 10, 64)
	return v, err == nil
}

func (d *fastDecoder) float64v() (float64, bool) {
	lit, ok := d.number()
	if !ok {
		return 0, false
	}
	v, err := strconv.ParseFloat(string(lit), 64)
	return v, err == nil
}

// null consumes a JSON null, which encoding/json decodes into a nil
// pointer or slice.
func (d *fastDecoder) null() bool {
	d.ws()
	if len(d.b)-d.i >= 4 && string(d.b[d.i:d.i+4]) == "null" {
		d.i += 4
		return true
	}
	return false
}

func (d *fastDecoder) intPtr() (*int, bool) {
	if d.null() {
		return nil, true
	}
	v, ok := d.intv()
	return &v, ok
}

func (d *fastDecoder) boolPtr() (*bool, bool) {
	if d.null() {
		return nil, true
	}
	v, ok := d.boolv()
	return &v, ok
}

// once reports false for a key seen before: a repeated object or array
// would be merged by encoding/json, so such bodies are left to it.
func (d *fastDecoder) once(key string) bool {
	for _, k := range d.seen {
		if k == key {
			return false
		}
	}
	d.seen = append(d.seen, key)
	return true
}

// array parses [elem, ...] or null (nil); elem parses one element.
func (d *fastDecoder) array(elem func() bool) (isNull, ok bool) {
	if d.null() {
		return true, true
	}
	if !d.consume('[') {
		return false, false
	}
	if d.consume(']') {
		return false, true
	}
	for {
		if !elem() {
			return false, false
		}
		if d.consume(',') {
			continue
		}
		return false, d.consume(']')
	}
}

func (d *fastDecoder) boolv() (bool, bool) {
	d.ws()
	switch {
	case len(d.b)-d.i >= 4 && string(d.b[d.i:d.i+4]) == "true":
		d.i += 4
		return true, true
	case len(d.b)-d.i >= 5 && string(d.b[d.i:d.i+5]) == "false":
		d.i += 5
		return false, true
	}
	return false, false
}

// object parses {"key": value, ...}, handing each key to field, which
// parses the value and reports false for an unknown key or a bad value.
func (d *fastDecoder) object(field func(key []byte) bool) bool {
	if !d.consume('{') {
		return false
	}
	if d.consume('}') {
		return true
	}
	for {
		key, ok := d.rawString()
		if !ok || !d.consume(':') || !field(key) {
			return false
		}
		if d.consume(',') {
			continue
		}
		return d.consume('}')
	}
}

func (d *fastDecoder) top(w *wireListing) func([]byte) bool {
	return func(key []byte) bool {
		var ok bool
		// A repeated object or array would be merged by encoding/json;
		// leave such bodies to it.
		switch string(key) {
		case "server", "loop", "inflight", "orphaned_transfers", "decode_requests", "transfer_workers", "wedge_orders",
			"peer_transfer_workers", "kv_threads":
			if !d.once(string(key)) {
				return false
			}
		}
		switch string(key) {
		case "api_version":
			var v int
			v, ok = d.intv()
			w.APIVersion = &v
		case "server":
			s := new(Server)
			ok = d.object(d.server(s))
			w.Server = s
		case "now_unix":
			w.NowUnix, ok = d.float64v()
		case "loop":
			l := new(Loop)
			ok = d.object(func(k []byte) bool {
				var ok bool
				switch string(k) {
				case "iterations":
					l.Iterations, ok = d.uint64v()
				case "last_iteration_unix":
					l.LastIterationUnix, ok = d.float64v()
				}
				return ok
			})
			w.Loop = l
		case "queues":
			q := &w.Queues
			ok = d.object(func(k []byte) bool {
				var ok bool
				switch string(k) {
				case "bootstrap":
					q.Bootstrap, ok = d.intv()
				case "waiting":
					q.Waiting, ok = d.intv()
				case "inflight":
					q.Inflight, ok = d.intv()
				case "prealloc":
					q.Prealloc, ok = d.intv()
				case "transfer":
					q.Transfer, ok = d.intv()
				}
				return ok
			})
		case "inflight":
			var rooms []Room
			rooms, ok = d.rooms()
			w.Inflight = &rooms
		case "orphaned_transfers":
			w.OrphanedTransfers, ok = d.orphans()
		case "decode_requests":
			w.DecodeRequests, ok = d.decodeRequests()
		case "transfer_workers":
			w.TransferWorkers, ok = d.transferWorkers()
		case "wedge_orders":
			w.WedgeOrders, ok = d.wedgeOrders()
		case "peer_transfer_workers":
			w.PeerTransferWorkers, ok = d.peerWorkers()
		case "kv_threads":
			w.KVThreads, ok = d.kvThreads()
		}
		return ok
	}
}

func (d *fastDecoder) server(s *Server) func([]byte) bool {
	return func(k []byte) bool {
		var ok bool
		switch string(k) {
		case "pid":
			s.PID, ok = d.intv()
		case "dp_rank":
			s.DPRank, ok = d.intv()
		case "pp_rank":
			s.PPRank, ok = d.intv()
		case "tp_rank":
			s.TPRank, ok = d.intv()
		case "disaggregation_mode":
			s.DisaggregationMode, ok = d.str()
		case "transfer_backend":
			s.TransferBackend, ok = d.str()
		case "sglang_version":
			s.SGLangVersion, ok = d.str()
		case "levers":
			if !d.once("server.levers") {
				return false
			}
			levers := []string{}
			var isNull bool
			isNull, ok = d.array(func() bool {
				v, ok := d.str()
				levers = append(levers, v)
				return ok
			})
			s.Levers = levers
			if isNull {
				s.Levers = nil
			}
		case "lever_note":
			s.LeverNote, ok = d.str()
		case "pp_size":
			s.PPSize, ok = d.intv()
		case "transfer_queues":
			s.TransferQueues, ok = d.intPtr()
		case "deferred_release":
			s.DeferredRelease, ok = d.boolPtr()
		case "transfer_tracking":
			s.TransferTracking, ok = d.boolPtr()
		case "transfer_ranks":
			s.TransferRanks, ok = d.intPtr()
		case "transfer_ranks_watched":
			s.TransferRanksWatched, ok = d.intPtr()
		case "transfer_progress":
			s.TransferProgress, ok = d.boolPtr()
		}
		return ok
	}
}

// polls interns the poll values, so that rooms share them.
var polls = []string{PollTransferring, PollWaitingForInput, PollBootstrapping, PollSuccess, PollFailed, PollUnknown}

func (d *fastDecoder) rooms() ([]Room, bool) {
	if !d.consume('[') {
		return nil, false
	}
	rooms := make([]Room, 0, 16)
	if d.consume(']') {
		return rooms, true
	}
	for {
		rooms = append(rooms, Room{})
		r := &rooms[len(rooms)-1]
		ok := d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "rid":
				r.RID, ok = d.str()
			case "bootstrap_room":
				r.BootstrapRoom, ok = d.uint64v()
			case "bootstrap_addr":
				r.BootstrapAddr, ok = d.addr()
			case "poll":
				r.Poll, ok = d.poll()
			case "age_seconds":
				r.AgeSeconds, ok = d.float64v()
			case "prompt_tokens":
				r.PromptTokens, ok = d.intv()
			case "progress":
				r.Progress, ok = d.int64v(64)
			case "send_failed":
				r.SendFailed, ok = d.boolv()
			case "health_check":
				r.HealthCheck, ok = d.boolv()
			case "transfer_in_flight":
				r.TransferInFlight, ok = d.boolPtr()
			case "transfer_queue":
				r.TransferQueue, ok = d.intPtr()
			case "chunks_queued":
				r.ChunksQueued, ok = d.intPtr()
			case "peer_chunks_queued":
				r.PeerChunksQueued, ok = d.intPtr()
			}
			return ok
		})
		if !ok {
			return nil, false
		}
		if d.consume(',') {
			continue
		}
		return rooms, d.consume(']')
	}
}

func (d *fastDecoder) peerWorkers() ([]PeerWorkers, bool) {
	out := []PeerWorkers{}
	isNull, ok := d.array(func() bool {
		out = append(out, PeerWorkers{})
		p := &out[len(out)-1]
		return d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "rank":
				p.Rank, ok = d.str()
			case "transfer_workers":
				p.TransferWorkers, ok = d.transferWorkers()
			}
			return ok
		})
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

func (d *fastDecoder) orphans() ([]OrphanedTransfer, bool) {
	out := []OrphanedTransfer{}
	isNull, ok := d.array(func() bool {
		out = append(out, OrphanedTransfer{})
		o := &out[len(out)-1]
		return d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "bootstrap_room":
				o.BootstrapRoom, ok = d.uint64v()
			case "transfer_queue":
				o.TransferQueue, ok = d.intPtr()
			case "outstanding_chunks":
				o.OutstandingChunks, ok = d.intv()
			}
			return ok
		})
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

// poll returns a poll value, interned so that rooms share it; an invalid
// one is kept for validation to report.
func (d *fastDecoder) poll() (string, bool) {
	b, ok := d.rawString()
	for _, p := range polls {
		if string(b) == p {
			return p, ok
		}
	}
	return string(b), ok
}

// addr returns a bootstrap address, shared with the previous entry when
// it is the same.
func (d *fastDecoder) addr() (string, bool) {
	b, ok := d.rawString()
	if string(b) != d.lastAddr {
		d.lastAddr = string(b)
	}
	return d.lastAddr, ok
}

func (d *fastDecoder) link() (string, bool) {
	b, ok := d.rawString()
	if !ok {
		return "", false
	}
	if s, found := d.links[string(b)]; found {
		return s, true
	}
	if d.links == nil {
		d.links = map[string]string{}
	}
	s := string(b)
	d.links[s] = s
	return s, true
}

func (d *fastDecoder) int64Ptr() (*int64, bool) {
	if d.null() {
		return nil, true
	}
	v, ok := d.int64v(64)
	return &v, ok
}

func (d *fastDecoder) decodeRequests() ([]DecodeRequest, bool) {
	out := []DecodeRequest{}
	isNull, ok := d.array(func() bool {
		out = append(out, DecodeRequest{})
		r := &out[len(out)-1]
		return d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "rid":
				r.RID, ok = d.str()
			case "bootstrap_room":
				r.BootstrapRoom, ok = d.uint64v()
			case "bootstrap_addr":
				r.BootstrapAddr, ok = d.addr()
			case "queue":
				r.Queue, ok = d.str()
			case "poll":
				r.Poll, ok = d.poll()
			case "age_seconds":
				r.AgeSeconds, ok = d.float64v()
			case "progress":
				r.Progress, ok = d.int64v(64)
			case "chunks_expected":
				r.ChunksExpected, ok = d.int64Ptr()
			case "transfer_started":
				r.TransferStarted, ok = d.boolPtr()
			case "health_check":
				r.HealthCheck, ok = d.boolv()
			case "waiting_for_memory":
				r.WaitingForMemory, ok = d.boolv()
			case "prefill_rank_addrs":
				r.PrefillRankAddrs, ok = d.strings()
			}
			return ok
		})
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

// strings parses an array of strings, or null (nil). The strings are
// interned with the links': every request of a receiver lists the same
// few prefill ranks.
func (d *fastDecoder) strings() ([]string, bool) {
	out := []string{}
	isNull, ok := d.array(func() bool {
		v, ok := d.link()
		out = append(out, v)
		return ok
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

// uint64s parses an array of unsigned integers, or null (nil).
func (d *fastDecoder) uint64s() ([]uint64, bool) {
	out := []uint64{}
	isNull, ok := d.array(func() bool {
		v, ok := d.uint64v()
		out = append(out, v)
		return ok
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

// transferWorkers parses transfer_workers. Within a worker, a
// repeated in_flight or recent would be merged by encoding/json, so such
// bodies are left to it, as at the top level.
func (d *fastDecoder) transferWorkers() ([]TransferWorker, bool) {
	out := []TransferWorker{}
	isNull, ok := d.array(func() bool {
		out = append(out, TransferWorker{})
		tw := &out[len(out)-1]
		var inFlightSeen, recentSeen, queuedSeen, finishedSeen bool
		return d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "transfer_queue":
				tw.TransferQueue, ok = d.intv()
			case "tracked":
				tw.Tracked, ok = d.boolv()
			case "depth":
				tw.Depth, ok = d.intv()
			case "chunks_taken":
				tw.ChunksTaken, ok = d.int64v(64)
			case "in_flight":
				if inFlightSeen {
					return false
				}
				inFlightSeen = true
				tw.InFlight, ok = d.chunkInFlight()
			case "recent":
				if recentSeen {
					return false
				}
				recentSeen = true
				tw.Recent, ok = d.samples()
			case "queued_rooms":
				if queuedSeen {
					return false
				}
				queuedSeen = true
				tw.QueuedRooms, ok = d.uint64s()
			case "finished":
				if finishedSeen {
					return false
				}
				finishedSeen = true
				tw.Finished, ok = d.finished()
			}
			return ok
		})
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

func (d *fastDecoder) chunkInFlight() (*ChunkInFlight, bool) {
	if d.null() {
		return nil, true
	}
	c := new(ChunkInFlight)
	return c, d.object(func(k []byte) bool {
		var ok bool
		switch string(k) {
		case "chunk":
			c.Chunk, ok = d.int64v(64)
		case "bootstrap_room":
			c.BootstrapRoom, ok = d.uint64v()
		case "pages":
			c.Pages, ok = d.intv()
		case "last_chunk":
			c.LastChunk, ok = d.boolv()
		case "seconds":
			c.Seconds, ok = d.float64v()
		case "link":
			c.Link, ok = d.link()
		}
		return ok
	})
}

// finished parses transfer_workers[].finished.
func (d *fastDecoder) finished() ([]FinishedChunk, bool) {
	out := []FinishedChunk{}
	isNull, ok := d.array(func() bool {
		out = append(out, FinishedChunk{})
		f := &out[len(out)-1]
		return d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "chunk":
				f.Chunk, ok = d.int64v(64)
			case "pages":
				f.Pages, ok = d.intv()
			case "seconds":
				f.Seconds, ok = d.float64v()
			case "link":
				f.Link, ok = d.link()
			}
			return ok
		})
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

// samples parses recent: pairs of exactly two numbers. encoding/json
// would zero-fill a shorter pair and drop the rest of a longer one; such
// bodies are left to it.
func (d *fastDecoder) samples() ([][2]float64, bool) {
	out := [][2]float64{}
	isNull, ok := d.array(func() bool {
		var s [2]float64
		var ok bool
		if !d.consume('[') {
			return false
		}
		if s[0], ok = d.float64v(); !ok || !d.consume(',') {
			return false
		}
		if s[1], ok = d.float64v(); !ok || !d.consume(']') {
			return false
		}
		out = append(out, s)
		return true
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

func (d *fastDecoder) wedgeOrders() ([]WedgeOrderState, bool) {
	out := []WedgeOrderState{}
	isNull, ok := d.array(func() bool {
		out = append(out, WedgeOrderState{})
		o := &out[len(out)-1]
		return d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "transfer_queue":
				o.TransferQueue, ok = d.intv()
			case "chunk":
				o.Chunk, ok = d.int64v(64)
			case "expires_in_seconds":
				o.ExpiresInSeconds, ok = d.float64v()
			case "rooms_failed":
				o.RoomsFailed, ok = d.intv()
			}
			return ok
		})
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}

func (d *fastDecoder) kvThreads() ([]KVThread, bool) {
	out := []KVThread{}
	isNull, ok := d.array(func() bool {
		out = append(out, KVThread{})
		th := &out[len(out)-1]
		return d.object(func(k []byte) bool {
			var ok bool
			switch string(k) {
			case "role":
				th.Role, ok = d.str()
			case "function":
				th.Function, ok = d.str()
			case "transfer_queue":
				th.TransferQueue, ok = d.intPtr()
			case "alive":
				th.Alive, ok = d.boolv()
			}
			return ok
		})
	})
	if isNull {
		return nil, ok
	}
	return out, ok
}
