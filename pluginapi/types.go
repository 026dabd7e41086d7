// Package pluginapi holds the wire types of the plugin HTTP API, version 1
// (docs/plugin-api.md), and a client for it. The simulator serves the same
// types, and a cross-language test holds the Python plugin to them.
package pluginapi

// APIVersion is the contract version this package speaks.
const APIVersion = 1

// Paths of the plugin API.
const (
	PathHealthz   = "/healthz"
	PathInflight  = "/debug/inflight"
	PathForceFail = "/admin/force_fail"
	PathRestart   = "/admin/restart"
	// PathWedgeOrder takes a standing order for one wedged transfer queue
	// (plugins that report server.transfer_progress).
	PathWedgeOrder = "/admin/wedge_order"
)

// Poll states as the plugin reports them.
const (
	PollBootstrapping   = "Bootstrapping"
	PollWaitingForInput = "WaitingForInput"
	PollTransferring    = "Transferring"
	PollSuccess         = "Success"
	PollFailed          = "Failed"
	PollUnknown         = "Unknown"
)

// PollStates lists every poll value in KVPoll order, Unknown last.
var PollStates = []string{PollFailed, PollBootstrapping, PollWaitingForInput, PollTransferring, PollSuccess, PollUnknown}

// Force-fail results (the `result` field of every response body).
const (
	ResultFlipped               = "flipped"
	ResultAlreadyFailed         = "already_failed"
	ResultWouldFlip             = "would_flip"
	ResultBadRequest            = "bad_request"
	ResultUnauthorized          = "unauthorized"
	ResultNotFound              = "not_found"
	ResultRoomMismatch          = "room_mismatch"
	ResultSchedulerUnresponsive = "scheduler_unresponsive"
	ResultInternalError         = "internal_error"
	// Refusals of plugins that report server.levers; older ones never give
	// them.
	ResultHealthCheck       = "health_check"
	ResultTransferSucceeded = "transfer_succeeded"
	ResultUnsupported       = "unsupported"
	// Decode only. The transfer into the request's pages may still be
	// live and the caller did not assert that prefill stopped sending.
	ResultTransferLive = "transfer_live"
	// The levers were pulled, yet the sender does not poll Failed: SGLang
	// will not release the request (HTTP 500, counted as an error).
	ResultLeverIneffective = "lever_ineffective"
	// Attention TP/CP > 1 only: the leader sent its share, but cannot see
	// whether the ranks in Ranks still send theirs; nothing was changed.
	ResultGroupUnwatched = "group_unwatched"
)

// Wedge order results (POST /admin/wedge_order).
const (
	ResultOrdered      = "ordered"
	ResultWouldOrder   = "would_order"
	ResultWedgeCleared = "wedge_cleared"
)

// Disaggregation modes (server.disaggregation_mode).
const (
	ModePrefill = "prefill"
	ModeDecode  = "decode"
)

// Decode queues (DecodeRequest.Queue).
const (
	DecodeQueuePrealloc = "prealloc"
	DecodeQueueTransfer = "transfer"
)

// Restart results (POST /admin/restart).
const (
	ResultRestarting      = "restarting"
	ResultWouldRestart    = "would_restart"
	ResultRestartDisabled = "restart_disabled"
	ResultPIDMismatch     = "pid_mismatch"
	// ResultTooSoon (429): within the plugin's own minimum interval between
	// restarts of its server, which outlives the watchdog's memory.
	ResultTooSoon = "too_soon"
	// ResultRestartUnsupported (501): no signal known to the plugin ends
	// SGLang's whole server on this node (its launcher handles no SIGQUIT,
	// or the process tree is not visible); nothing was done.
	ResultRestartUnsupported = "restart_unsupported"
)

// Levers the plugin can set.
const (
	LeverSendFailed    = "_send_failed"
	LeverConcludeState = "conclude_state"
	// LeverAbort is the sender's own abort(), as Scheduler.abort_request
	// calls it.
	LeverAbort = "abort"
	// LeverDeferredAbort is decode's register_deferred_abort_room.
	LeverDeferredAbort = "deferred_abort"
)

// Listing is the body of GET /debug/inflight.
type Listing struct {
	APIVersion int     `json:"api_version"`
	Server     Server  `json:"server"`
	NowUnix    float64 `json:"now_unix"`
	Loop       Loop    `json:"loop"`
	Queues     Queues  `json:"queues"`
	Inflight   []Room  `json:"inflight"`
	// OrphanedTransfers lists rooms that left the inflight queue while the
	// KV manager still counts outstanding chunks for them. Nil
	// means the plugin does not report them (older plugin).
	OrphanedTransfers []OrphanedTransfer `json:"orphaned_transfers"`
	// DecodeRequests lists the requests of a decode scheduler's prealloc
	// and transfer queues; nil on prefill and older plugins.
	DecodeRequests []DecodeRequest `json:"decode_requests,omitempty"`
	// TransferWorkers describes each transfer worker of a prefill KV
	// manager; nil where server.transfer_progress is not true.
	TransferWorkers []TransferWorker `json:"transfer_workers"`
	// WedgeOrders lists the standing wedge orders; nil on older
	// plugins.
	WedgeOrders []WedgeOrderState `json:"wedge_orders"`
	// PeerTransferWorkers lists, on the leader of an attention TP/CP
	// group, the transfer workers of each other rank it watches;
	// nil where the plugin reports none.
	PeerTransferWorkers []PeerWorkers `json:"peer_transfer_workers,omitempty"`
	// KVThreads lists the threads of the rank's KV manager and whether
	// each is alive; nil where the plugin does not know (an older plugin,
	// or no KV manager found), which never means dead.
	KVThreads []KVThread `json:"kv_threads,omitempty"`
}

// Roles of a KV manager thread (KVThread.Role).
const (
	// ThreadBootstrap is prefill's bootstrap thread, which reads decode's
	// frames; dead, every later request waits in the bootstrap queue for
	// ever.
	ThreadBootstrap = "bootstrap"
	// ThreadTransferWorker serves one transfer queue; dead, its queue is
	// never drained again.
	ThreadTransferWorker = "transfer_worker"
	// ThreadDecodeListener is decode's thread that reads prefill's frames.
	ThreadDecodeListener = "decode_listener"
	// ThreadHeartbeat is decode's heartbeat checker of its prefill peers.
	ThreadHeartbeat = "heartbeat"
	// ThreadOther is any other thread the plugin found on the manager.
	ThreadOther = "other"
)

// ThreadRoles lists every KV thread role.
var ThreadRoles = []string{ThreadBootstrap, ThreadTransferWorker, ThreadDecodeListener, ThreadHeartbeat, ThreadOther}

// MaxThreadFunction bounds KVThread.Function, SGLang's thread target name.
const MaxThreadFunction = 128

// KVThread is one thread of the rank's KV manager, listed from the
// plugin's first hooked pass on, so that a death later shows as
// Alive false.
type KVThread struct {
	Role string `json:"role"`
	// Function is the thread's target function in SGLang (free text).
	Function string `json:"function"`
	// TransferQueue is the queue a transfer_worker serves (the index of
	// transfer_workers); nil where unknown, and meaningless on other
	// roles.
	TransferQueue *int `json:"transfer_queue,omitempty"`
	Alive         bool `json:"alive"`
}

// PeerWorkers is one other rank of the leader's attention TP/CP group and
// its transfer workers, as that rank last published them.
// Seconds of a chunk in flight are as of that publication, up to 2 s old,
// so they err on the young side.
type PeerWorkers struct {
	Rank            string           `json:"rank"` // tp<R>-cp<C>
	TransferWorkers []TransferWorker `json:"transfer_workers"`
}

// TransferWorker is one transfer queue and the worker that serves it,
// listed where server.transfer_progress is true.
type TransferWorker struct {
	TransferQueue int   `json:"transfer_queue"`
	Tracked       bool  `json:"tracked"`
	Depth         int   `json:"depth"`
	ChunksTaken   int64 `json:"chunks_taken"`
	// InFlight is the chunk in the worker's hands; nil while it waits.
	InFlight *ChunkInFlight `json:"in_flight"`
	// Recent holds [pages, seconds] of the chunks it finished last,
	// oldest first. Kept for watchdogs that predate Finished, which
	// carries the same chunks with their number and link.
	Recent [][2]float64 `json:"recent"`
	// Finished holds the chunks with KV pages it finished last, oldest
	// first, each with its number and link; nil from plugins that predate
	// per-link pacing (docs/plugin-api.md, "Links").
	Finished []FinishedChunk `json:"finished,omitempty"`
	// QueuedRooms are the rooms with a chunk waiting in this queue, in
	// queue order: listed for the other ranks' workers only,
	// whose rooms the leader's listing does not place on a queue.
	QueuedRooms []uint64 `json:"queued_rooms,omitempty"`
}

// ChunkInFlight is the chunk a transfer worker holds.
type ChunkInFlight struct {
	Chunk         int64   `json:"chunk"`
	BootstrapRoom uint64  `json:"bootstrap_room"`
	Pages         int     `json:"pages"`
	LastChunk     bool    `json:"last_chunk"`
	Seconds       float64 `json:"seconds"`
	// Link names the decode destinations the chunk is sent to; "" where
	// the plugin could not tell (docs/plugin-api.md, "Links").
	Link string `json:"link,omitempty"`
}

// FinishedChunk is one chunk a transfer worker finished: its number (as
// in_flight.chunk), KV pages, seconds in the worker's hands, and link.
type FinishedChunk struct {
	Chunk   int64   `json:"chunk"`
	Pages   int     `json:"pages"`
	Seconds float64 `json:"seconds"`
	Link    string  `json:"link"`
}

// MaxLinkLength bounds a link name: a plugin names a room's decode
// destinations with at most this many bytes (longer sets are hashed).
const MaxLinkLength = 256

// WedgeOrderState is a standing wedge order as the listing reports it.
type WedgeOrderState struct {
	TransferQueue    int     `json:"transfer_queue"`
	Chunk            int64   `json:"chunk"`
	ExpiresInSeconds float64 `json:"expires_in_seconds"`
	RoomsFailed      int     `json:"rooms_failed"`
}

// WedgeOrderRequest is the body of POST /admin/wedge_order.
type WedgeOrderRequest struct {
	TransferQueue int     `json:"transfer_queue"`
	Chunk         int64   `json:"chunk"`
	TTLSeconds    float64 `json:"ttl_seconds"`
	MinAgeSeconds float64 `json:"min_age_seconds"`
	Reason        string  `json:"reason,omitempty"`
	DryRun        bool    `json:"dry_run"`
}

// WedgeOrderResponse is the body of every POST /admin/wedge_order answer.
type WedgeOrderResponse struct {
	Result           string       `json:"result"`
	ExpiresInSeconds float64      `json:"expires_in_seconds,omitempty"`
	Failed           []FailedRoom `json:"failed"`
	LeverNote        string       `json:"lever_note,omitempty"`
	Error            string       `json:"error,omitempty"`
}

// FailedRoom is a room a wedge order failed (or would fail).
type FailedRoom struct {
	RID           string   `json:"rid"`
	BootstrapRoom uint64   `json:"bootstrap_room"`
	Levers        []string `json:"levers,omitempty"`
}

// DecodeRequest is one request waiting in a decode scheduler's prealloc
// or transfer queue.
type DecodeRequest struct {
	RID            string  `json:"rid"`
	BootstrapRoom  uint64  `json:"bootstrap_room"`
	BootstrapAddr  string  `json:"bootstrap_addr"`
	Queue          string  `json:"queue"`
	Poll           string  `json:"poll"`
	AgeSeconds     float64 `json:"age_seconds"`
	Progress       int64   `json:"progress"`
	ChunksExpected *int64  `json:"chunks_expected"`
	// TransferStarted is nil where unknown.
	TransferStarted *bool `json:"transfer_started"`
	HealthCheck     bool  `json:"health_check"`
	// WaitingForMemory: a prealloc request whose handshake is
	// done, waiting for free KV pages. SGLang never times it out (its
	// waiting timeout starts when the metadata is sent), so it is not
	// stuck. False from plugins that predate it.
	WaitingForMemory bool `json:"waiting_for_memory"`
	// PrefillRankAddrs are the "ip:port" addresses of the prefill ranks the
	// request's KV receiver talks to (SGLang's bootstrap_infos), in its
	// order; nil when absent (older plugins, or before the receiver
	// fetched them), and a verdict lookup then goes to the host of
	// BootstrapAddr.
	PrefillRankAddrs []string `json:"prefill_rank_addrs,omitempty"`
}

// OrphanedTransfer is a room gone from the inflight queue whose transfer
// worker still waits on its chunks: the mark of a wedged worker.
type OrphanedTransfer struct {
	BootstrapRoom     uint64 `json:"bootstrap_room"`
	TransferQueue     *int   `json:"transfer_queue"`
	OutstandingChunks int    `json:"outstanding_chunks"`
}

// Server identifies the scheduler process that serves the listing.
type Server struct {
	PID                int    `json:"pid"`
	DPRank             int    `json:"dp_rank"`
	PPRank             int    `json:"pp_rank"`
	TPRank             int    `json:"tp_rank"`
	DisaggregationMode string `json:"disaggregation_mode"`
	TransferBackend    string `json:"transfer_backend"`
	SGLangVersion      string `json:"sglang_version"`
	// Levers is nil when the plugin does not report it (older
	// plugin: assume the version 1 lever works) and empty when no lever
	// works on this SGLang version and backend.
	Levers    []string `json:"levers"`
	LeverNote string   `json:"lever_note,omitempty"`
	// PPSize is 0 when unknown.
	PPSize int `json:"pp_size,omitempty"`
	// TransferQueues is nil when unknown.
	TransferQueues *int `json:"transfer_queues"`
	// DeferredRelease is decode's deferred KV release setting;
	// nil on prefill or where unknown.
	DeferredRelease *bool `json:"deferred_release,omitempty"`
	// TransferTracking is true on prefill when transfer_in_flight and
	// orphaned_transfers are read from the backend's per-room count of
	// outstanding chunks. Otherwise (false, or nil: absent) a
	// transfer_in_flight of false may only mean the backend exposes
	// nothing, and proves nothing.
	TransferTracking *bool `json:"transfer_tracking,omitempty"`
	// TransferRanks is how many ranks send KV for this listener's requests
	// (prefill's attention TP x CP group: each rank runs its own transfer
	// workers into its decode peer's pages), and TransferRanksWatched how
	// many of them transfer_in_flight covers, each read within the last few
	// seconds. Only when both are given and equal does a false
	// transfer_in_flight say that no rank is writing; nil: absent (an older
	// plugin, which reads the leader's manager only).
	TransferRanks        *int `json:"transfer_ranks,omitempty"`
	TransferRanksWatched *int `json:"transfer_ranks_watched,omitempty"`
	// TransferProgress is true on prefill when the plugin watches every
	// transfer worker and reports Listing.TransferWorkers.
	TransferProgress *bool `json:"transfer_progress,omitempty"`
}

// Loop is the scheduler-loop liveness counter seen by the plugin's hook.
type Loop struct {
	Iterations        uint64  `json:"iterations"`
	LastIterationUnix float64 `json:"last_iteration_unix"`
}

// Queues are the PD queue depths of this rank.
type Queues struct {
	Bootstrap int `json:"bootstrap"`
	Waiting   int `json:"waiting"`
	Inflight  int `json:"inflight"`
	// Decode queues; 0 on prefill.
	Prealloc int `json:"prealloc,omitempty"`
	Transfer int `json:"transfer,omitempty"`
}

// Room is one request in the prefill inflight queue. BootstrapRoom is a
// full 64-bit value; encoding/json decodes it into uint64 without loss.
type Room struct {
	RID           string  `json:"rid"`
	BootstrapRoom uint64  `json:"bootstrap_room"`
	BootstrapAddr string  `json:"bootstrap_addr"`
	Poll          string  `json:"poll"`
	AgeSeconds    float64 `json:"age_seconds"`
	PromptTokens  int     `json:"prompt_tokens"`
	Progress      int64   `json:"progress"`
	SendFailed    bool    `json:"send_failed"`
	HealthCheck   bool    `json:"health_check"`
	// TransferInFlight and TransferQueue are nil where the plugin does not
	// report them (older plugins); TransferQueue is null where unknown.
	TransferInFlight *bool `json:"transfer_in_flight,omitempty"`
	TransferQueue    *int  `json:"transfer_queue"`
	// ChunksQueued counts this room's chunks waiting in its transfer queue,
	// where server.transfer_progress; nil where the plugin does not report
	// it.
	ChunksQueued *int `json:"chunks_queued"`
	// PeerChunksQueued counts this room's chunks waiting in the worker
	// queues of the other watched ranks of its attention TP/CP group; nil
	// where not reported.
	PeerChunksQueued *int `json:"peer_chunks_queued,omitempty"`
}

// ForceFailRequest is the body of POST /admin/force_fail.
// BootstrapRoom is optional: nil omits it.
type ForceFailRequest struct {
	RID           string  `json:"rid"`
	BootstrapRoom *uint64 `json:"bootstrap_room,omitempty"`
	Reason        string  `json:"reason,omitempty"`
	DryRun        bool    `json:"dry_run"`
	// PrefillStopped asserts, on decode, that the prefill peer has stopped
	// sending for this room.
	PrefillStopped bool `json:"prefill_stopped,omitempty"`
}

// ForceFailResponse is the body of every POST /admin/force_fail answer.
// The 200 answers carry all fields; the error answers carry result and
// error at least.
type ForceFailResponse struct {
	Result        string  `json:"result"`
	RID           string  `json:"rid,omitempty"`
	BootstrapRoom *uint64 `json:"bootstrap_room,omitempty"`
	Lever         string  `json:"lever,omitempty"`
	// Levers pulled, already set or that would be pulled.
	Levers      []string `json:"levers,omitempty"`
	AppliedUnix float64  `json:"applied_unix,omitempty"`
	Error       string   `json:"error,omitempty"`
	// Ranks of the attention TP/CP group not watched (group_unwatched), as
	// "tp<R>-cp<C>".
	Ranks []string `json:"ranks,omitempty"`
}

// RestartRequest is the body of POST /admin/restart. PID must be
// the pid the caller read from the listing.
type RestartRequest struct {
	PID    int    `json:"pid"`
	Reason string `json:"reason,omitempty"`
	DryRun bool   `json:"dry_run"`
}

// RestartResponse is the body of every POST /admin/restart answer.
type RestartResponse struct {
	Result string `json:"result"`
	PID    int    `json:"pid,omitempty"`
	Error  string `json:"error,omitempty"`
	// RetryAfterS is when the plugin would allow a restart again, in whole
	// seconds (429 too_soon only).
	RetryAfterS int `json:"retry_after_s,omitempty"`
}

// SeesEveryWriter tells whether a transfer_in_flight of false in this
// listing proves that no rank is writing the room's KV: the per-room count
// of outstanding chunks is read (transfer_tracking) on every rank of the
// group that sends (transfer_ranks_watched == transfer_ranks). Anything
// absent fails closed.
func (s *Server) SeesEveryWriter() bool {
	return s.TransferTracking != nil && *s.TransferTracking &&
		s.TransferRanks != nil && s.TransferRanksWatched != nil &&
		*s.TransferRanks >= 1 && *s.TransferRanksWatched >= *s.TransferRanks
}
