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
)

// Levers the plugin can set.
const (
	LeverSendFailed    = "_send_failed"
	LeverConcludeState = "conclude_state"
)

// Listing is the body of GET /debug/inflight.
type Listing struct {
	APIVersion int     `json:"api_version"`
	Server     Server  `json:"server"`
	NowUnix    float64 `json:"now_unix"`
	Loop       Loop    `json:"loop"`
	Queues     Queues  `json:"queues"`
	Inflight   []Room  `json:"inflight"`
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
}

// ForceFailRequest is the body of POST /admin/force_fail.
// BootstrapRoom is optional: nil omits it.
type ForceFailRequest struct {
	RID           string  `json:"rid"`
	BootstrapRoom *uint64 `json:"bootstrap_room,omitempty"`
	Reason        string  `json:"reason,omitempty"`
	DryRun        bool    `json:"dry_run"`
}

// ForceFailResponse is the body of every POST /admin/force_fail answer.
// The 200 answers carry all fields; the error answers carry result and
// error at least.
type ForceFailResponse struct {
	Result        string  `json:"result"`
	RID           string  `json:"rid,omitempty"`
	BootstrapRoom *uint64 `json:"bootstrap_room,omitempty"`
	Lever         string  `json:"lever,omitempty"`
	AppliedUnix   float64 `json:"applied_unix,omitempty"`
	Error         string  `json:"error,omitempty"`
}
