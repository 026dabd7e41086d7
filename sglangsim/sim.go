package sglangsim

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Label eras of SGLang's /metrics (SGLang metrics/collector.py to v0.5.3,
// observability/metrics_collector.py from v0.5.10).
const (
	EraName       = "name"
	EraModelName  = "model_name"
	EraEngineType = "engine_type"
	EraV05        = "v0.5"
	EraNewest     = "newest"
)

// Transfer backends and their levers (SGLang v0.5.18:
// disaggregation/nixl/conn.py, mooncake/conn.py).
const (
	BackendNIXL     = "nixl"
	BackendMooncake = "mooncake"
)

// ScenarioParity is the scene shared with the Python stand-in.
const ScenarioParity = "parity"

// ParityWarmupRID is the rid of the parity scene's warm-up request: a plain
// hex rid, as SGLang's server warm-up has.
const ParityWarmupRID = "5f1e0c2a9b7d4e3f8a6b1c0d2e4f6a8b"

// Lever eras (Options.LeverEra): which of the plugin's levers make SGLang's
// poll() read Failed (SGLang v0.5.18: managers/scheduler.py,
// disaggregation/common/conn.py).
const (
	// LeversNewest: the sender's abort() works on every backend (the common
	// manager's update_status lets Failed overwrite a present room), and NIXL
	// senders have _send_failed, which poll() reads first.
	LeversNewest = "newest"
	// LeversNIXLMid2025: mid-2025 NIXL: the sender has no _send_failed, its
	// poll() ignores conclude_state and a max()-only update_status ignores
	// Failed. No prefill lever works; the plugin reports none and answers
	// 501. Its decode receiver latches abort()'s Failed, so decode keeps
	// the abort lever (without the ABORT frame, which came later).
	LeversNIXLMid2025 = "nixl-mid2025"
	// LeversEarly: about v0.4.5, the scheduler's Failed branch raises: a poll
	// that reads Failed crashes the scheduler process, which takes the whole
	// server down. The plugin reports no lever and answers 501.
	LeversEarly = "early"
)

// Transfer queue keys (Options.QueueKey, SGLang v0.5.18:
// disaggregation/nixl/conn.py).
const (
	// QueueKeyDecodePorts is newest NIXL: the sum of the room's destination
	// decode ports modulo the queue count.
	QueueKeyDecodePorts = "decode_ports"
	// QueueKeyRoom is older NIXL and the seeds' incident: room % queues.
	QueueKeyRoom = "room"
)

const (
	// FakeBootstrapHost is SGLang's FAKE_BOOTSTRAP_HOST (disaggregation/utils.py):
	// health checks and warm-up requests use the fake sender through it.
	FakeBootstrapHost = "2.2.2.2"
	// HealthCheckPrefix starts the rid of SGLang's health checks (not of
	// warm-up requests).
	HealthCheckPrefix = "HEALTH_CHECK"
	// DefaultBootstrapAddr is the bootstrap address of normal requests: the
	// prefill server's own bootstrap server.
	DefaultBootstrapAddr = "10.0.0.7:8998"
	// TransferQueues is SGLANG_DISAGGREGATION_QUEUE_SIZE's default (SGLang
	// v0.5.18: environ.py): transfer worker queues per scheduler process.
	TransferQueues = 4
	// DefaultModelName is the model name when Options.ModelName is empty.
	DefaultModelName = "meta-llama/Llama-3.1-8B-Instruct"
	// DefaultBootTime is how long a restarted server takes to serve again.
	DefaultBootTime = 30 * time.Second
	// DefaultDecodeWaitingTimeout is SGLANG_DISAGGREGATION_WAITING_TIMEOUT's
	// default (SGLang v0.5.18: environ.py).
	DefaultDecodeWaitingTimeout = 300 * time.Second
	// HeartbeatDetection is how long decode takes to fail the rooms of a
	// dead prefill: SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL (5 s) times
	// SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE (2).
	HeartbeatDetection = 10 * time.Second
	// DefaultKVPoolTokens is the KV pool of one prefill scheduler process:
	// max_total_num_tokens of Llama-3.1-8B bf16 on one 80 GB GPU at
	// --mem-fraction-static 0.88 (sglang:max_total_num_tokens).
	DefaultKVPoolTokens = 786432
	// DefaultMaxRunningRequests is the req_to_token pool of one prefill
	// scheduler process: SGLang sizes it from the KV pool and the context
	// length (786432 / 131072 * 512 = 3072, within [2048, 4096]). The
	// metadata buffer pool has twice as many slots.
	DefaultMaxRunningRequests = 3072
	// decodeSuccessLag is how long after prefill's Success decode frees
	// the slot of a request it has finished (its one decode step).
	decodeSuccessLag = 20 * time.Millisecond
)

// DefaultDecodePorts are the decode endpoints of a simulated deployment,
// one port each: queues 0, 1, 2, 3, 0, 1 under QueueKeyDecodePorts, so two
// pairs of endpoints share a transfer queue.
var DefaultDecodePorts = []int{17000, 17001, 17002, 17003, 17004, 17005}

// Options configures a Sim. Only Clock is required.
type Options struct {
	Clock  clock.Clock // required; the only source of time
	DPSize int         // data-parallel ranks; default 1
	// PPSize is the number of pipeline stages; default 1. Rank index =
	// dp*PPSize + pp. The stages of one DP rank share the same requests.
	PPSize int
	// Era picks the /metrics label scheme: EraName, EraModelName,
	// EraEngineType, EraV05 (default) or EraNewest.
	Era string
	// Backend is BackendNIXL (lever _send_failed, default) or BackendMooncake
	// (lever conclude_state).
	Backend string
	// LeverEra picks what the levers do: LeversNewest (default),
	// LeversNIXLMid2025 (NIXL only) or LeversEarly.
	LeverEra string
	// QueueKey picks how a room's transfer queue is chosen:
	// QueueKeyDecodePorts (default) or QueueKeyRoom.
	QueueKey string
	// DecodePorts are the deployment's decode endpoints; each request is
	// bound for one of them (RequestSpec.DecodePort, or drawn from the room).
	// Default DefaultDecodePorts.
	DecodePorts []int
	// AllowRestart lets POST /admin/restart restart the server
	// (SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=1); otherwise it answers 403.
	AllowRestart bool
	// BootTime is how long a restarted or crashed server refuses its plugin
	// listeners and /metrics; 0 = DefaultBootTime, negative = none.
	BootTime time.Duration
	// KVPoolTokens is each prefill scheduler process's KV pool, in tokens
	// (max_total_num_tokens); 0 = DefaultKVPoolTokens. A request holds its
	// prompt's pages from its prefill batch until a terminal poll releases
	// it; a batch is formed only from waiting requests that fit.
	KVPoolTokens int
	// MaxRunningRequests is each prefill scheduler process's req_to_token
	// pool (max_running_requests); the metadata buffer pool has twice as
	// many slots. 0 = DefaultMaxRunningRequests.
	MaxRunningRequests int
	// DecodeWaitingTimeout is decode's SGLANG_DISAGGREGATION_WAITING_TIMEOUT;
	// default DefaultDecodeWaitingTimeout.
	DecodeWaitingTimeout time.Duration
	// DecodeDPSize is the number of decode ranks (scheduler processes of
	// the decode server); default 1. DecodePorts[i] belongs to decode rank
	// i % DecodeDPSize.
	DecodeDPSize int
	// DecodeSlots is each decode rank's KV page slots (one a request, from
	// preallocation until its release); 0 = unlimited. A prealloc request
	// whose handshake is done waits for a free slot, as SGLang's
	// pop_preallocated waits for memory, and is listed waiting_for_memory.
	DecodeSlots int
	// DeferredRelease turns decode's
	// SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE on (LeversNewest
	// only). No SGLang release up to v0.5.18 has it; later upstream code
	// has it off by default, and so does the simulator.
	DeferredRelease bool
	ModelName       string // default DefaultModelName
	Seed            int64  // everything random comes from this seed
	Token           string // bearer token for /admin/*; "" = none
	// BootstrapAddr is the bootstrap_addr of normal requests; default DefaultBootstrapAddr.
	BootstrapAddr string
	// RankHosts[i] is the host of the node prefill rank i runs on, for an
	// instance on several nodes (ListenNode). With it, decode lists each
	// normal request's prefill_rank_addrs: "<host>:<KVRankPort(i)>" of
	// every PP stage of its prefill DP rank, as SGLang's receiver gets
	// them from the bootstrap server. Empty: every rank on the host of
	// the request's bootstrap_addr (one node, where SGLang's bootstrap
	// server and its prefill ranks share the host).
	RankHosts []string
	// ArrivalRate is healthy traffic in requests per simulated second over
	// all DP ranks (Poisson); 0 = none.
	ArrivalRate float64
	// TransferMedian is the median KV transfer time of healthy requests;
	// default 200ms. Lognormal with sigma 1: p99.9 is about 22x the median.
	TransferMedian time.Duration
	// SlowFraction of arriving requests transfer for 30s to 150s but send a
	// chunk at least every SlowChunkEvery.
	SlowFraction   float64
	SlowChunkEvery time.Duration // default 5s
	// HealthCheckEvery sends SGLang health checks through the fake sender
	// (rid "HEALTH_CHECK_<unix>", room 0, host 2.2.2.2), round-robin over the
	// DP ranks; 0 = none.
	HealthCheckEvery time.Duration
	IdleRefresh      time.Duration // default 30s (SGLang v0.5.18: managers/scheduler_components/metrics_reporter.py)
	// HookRunsWhenEmpty: newest loops call the inflight pass every iteration;
	// older ones only while the inflight queue is non-empty, and then the
	// plugin's loop counter stands still on an empty queue (SGLang v0.5.18:
	// disaggregation/prefill.py; SGLang plugins/hook_registry.py, v0.5.11 to
	// v0.5.18).
	HookRunsWhenEmpty bool
	// OrderTimeout is how long a force-fail waits for the scheduler, in real
	// time; default 5s.
	OrderTimeout time.Duration
	// Scenario, when set, is applied by New (see SetScenario).
	Scenario string
	// PreRound4Plugin serves the plugin API as it was before round 4: no
	// server.transfer_progress, transfer_workers, wedge_orders nor
	// chunks_queued, and no /admin/wedge_order (404).
	PreRound4Plugin bool
	// UntrackedTransfers: the prefill KV manager keeps no count of each
	// room's outstanding chunks (_staging_outstanding), as Mooncake's
	// before v0.5.18 (v0.5.11: mooncake/conn.py, disaggregation/common/conn.py).
	// Its transfer workers serve the queues as before; the plugin lists
	// transfer_tracking false, transfer_ranks_watched 0, transfer_in_flight
	// false and no orphaned_transfers. Mid-2025 NIXL implies it.
	UntrackedTransfers bool
	// AttnTP is the attention-TP group size of every prefill (dp, pp) rank
	// (default 1). With AttnTP > 1 each rank of the group runs its own
	// transfer workers into its decode peer's pages: a room has one sender
	// per TP rank, each with its own worker state and possible pin, and the
	// scheduler reads the MIN of their polls (see the package doc, "Attention
	// TP").
	AttnTP int
	// TPUnwatched is how many non-leader ranks of each group the plugin's
	// leader does not read (a peer that stopped publishing, or one on
	// another host): listed in transfer_ranks_watched, not merged.
	TPUnwatched int
	// LeaderOnlyView makes the plugin list what the watchdog read up to
	// round 4: the leader's transfer state alone, with transfer_ranks and
	// transfer_ranks_watched 1, as if the leader were the only writer. It
	// exists to measure that view's hazard with AttnTP > 1.
	LeaderOnlyView bool
}

// KVRankPort is the rank_port the prefill KV manager of rank i registers
// with the bootstrap server (SGLang picks a free port; fixed here).
func KVRankPort(i int) int { return 40000 + i }

// Behavior is how a submitted request's transfer goes.
type Behavior int

const (
	// BehaviorHealthy completes after RequestSpec.Transfer (drawn if 0).
	BehaviorHealthy Behavior = iota
	// BehaviorSlow sends a chunk every ChunkEvery (default about
	// SlowChunkEvery) and completes after Transfer (drawn in 30s..150s if 0).
	BehaviorSlow
	// BehaviorHealthCheck is an SGLang health check: fake sender, room 0,
	// Success on the first poll after the forward.
	BehaviorHealthCheck
	// BehaviorStuckHealthCheck is a health check whose fake sender stays in
	// WaitingForInput for ever (FakeKVSender accumulation, PR #28652). A
	// correct watchdog never force-fails it.
	BehaviorStuckHealthCheck
	// BehaviorTransferFail fails by itself after Transfer: the poll reads
	// Failed, the request is released and the failed counter rises.
	BehaviorTransferFail
	// BehaviorPinResurrection: see PinResurrection.
	BehaviorPinResurrection
	// BehaviorPinAbortBeforeRegister: see PinAbortBeforeRegister.
	BehaviorPinAbortBeforeRegister
	// BehaviorPinStuckHandle: see PinStuckHandle.
	BehaviorPinStuckHandle
)

// PinKind selects one of the three mechanisms that pin a request in the
// inflight queue until its lever is set.
type PinKind int

const (
	// PinResurrection: Failed then a late Transferring through a max()-based
	// update_status: Transferring for ever, progress frozen (SGLang v0.5.18:
	// disaggregation/common/conn.py).
	PinResurrection PinKind = iota
	// PinAbortBeforeRegister: an ABORT popped transfer_infos before the room
	// was registered: WaitingForInput for ever, progress 0 (SGLang v0.5.18:
	// disaggregation/common/conn.py, disaggregation/nixl/conn.py,
	// mooncake/conn.py).
	PinAbortBeforeRegister
	// PinStuckHandle: a handle stuck in PROC wedges the transfer worker of
	// the room's queue until the process restarts (SGLang v0.5.18:
	// disaggregation/nixl/conn.py).
	PinStuckHandle
)

// RequestSpec describes one request for Submit. The zero value (apart from
// Rank) is a healthy request with drawn size and transfer time.
type RequestSpec struct {
	Rank     int // rank index, dp*PPSize + pp
	Behavior Behavior
	RID      string // "" = a random 32-hex rid (health checks: HEALTH_CHECK_<unix>)
	Room     uint64 // 0 = random over the full 64-bit range; health checks always use 0
	// PromptTokens: 0 = drawn (health checks: 1, SGLang sends input_ids=[0]).
	PromptTokens int
	// Transfer is the total transfer time of healthy, slow and failing
	// requests, counted from the inflight-queue entry; 0 = drawn; negative =
	// never finishes while still sending a chunk every ChunkEvery.
	Transfer time.Duration
	// ChunkEvery is the time between chunks; 0 = derived.
	ChunkEvery time.Duration
	// Chunks is how many chunks the transfer worker sends for a finite
	// transfer, the prompt's pages split evenly over them (1: one huge
	// chunk); 0 = derived (ChunkEvery, else 1,024 tokens a chunk and at
	// least one every SlowChunkEvery). It overrides ChunkEvery.
	Chunks int
	// FreezeAt is the number of chunks sent before a resurrection or
	// stuck-handle pin takes hold; 0 = default (3 and 1); -1 = before the
	// first chunk.
	FreezeAt int
	// Bootstrap is the time spent in the bootstrap queue; 0 = none, so that
	// the next pass carries the request into the inflight queue.
	Bootstrap time.Duration
	// DecodePort is the decode endpoint the request is bound for; 0 = one of
	// Options.DecodePorts, picked from the room. Health checks have none.
	DecodePort int
	// PinStages are the PP stages whose transfer the pin holds; nil = every
	// stage. The other stages transfer normally (Transfer, or the median).
	PinStages []int
	// PinTPRanks are the attention-TP ranks whose transfer the pin holds
	// (0 is the leader); nil = every rank. The others transfer normally:
	// {1} is a wedge on a non-leader rank only.
	PinTPRanks []int
	// Warmup makes a BehaviorHealthCheck or BehaviorStuckHealthCheck a
	// warm-up request: same fake host and room 0, a plain random rid with
	// no HEALTH_CHECK prefix (SGLang v0.5.18: disaggregation/utils.py, constants.py).
	Warmup bool
}

// Kind is the ground-truth class of a request.
type Kind string

// Kinds of Record.
const (
	KindHealthy                = Kind("healthy")
	KindSlow                   = Kind("slow")
	KindHealthCheck            = Kind("health_check") // also warm-up requests
	KindFailing                = Kind("failing")      // BehaviorTransferFail
	KindPinResurrection        = Kind("pin_resurrection")
	KindPinAbortBeforeRegister = Kind("pin_abort_before_register")
	KindPinStuckHandle         = Kind("pin_stuck_handle")
	KindBlockedByWedge         = Kind("blocked_by_wedge")
)

// Pin tells whether the kind is one of the three injected pin mechanisms.
func (k Kind) Pin() bool {
	return k == KindPinResurrection || k == KindPinAbortBeforeRegister || k == KindPinStuckHandle
}

var kinds = [...]Kind{KindHealthy, KindSlow, KindHealthCheck, KindFailing, KindPinResurrection,
	KindPinAbortBeforeRegister, KindPinStuckHandle, KindBlockedByWedge}

// Outcome is where a request ended.
type Outcome string

// Outcomes of Record.
const (
	OutcomeQueued       = Outcome("queued")   // still before the inflight queue
	OutcomeInflight     = Outcome("inflight") // in the inflight queue
	OutcomeSuccess      = Outcome("success")
	OutcomeFailedForced = Outcome("failed_forced") // released after a force-fail set its lever
	OutcomeFailed       = Outcome("failed")        // failed by itself
	// OutcomeRestarted: lost when the server restarted or crashed; the
	// client got an error.
	OutcomeRestarted = Outcome("restarted")
	// OutcomeRefusedBooting: submitted while the server booted after a
	// restart or crash: the connection was refused and the request was
	// never admitted (Left is its arrival).
	OutcomeRefusedBooting = Outcome("refused_booting")
)

var outcomes = [...]Outcome{OutcomeQueued, OutcomeInflight, OutcomeSuccess, OutcomeFailedForced,
	OutcomeFailed, OutcomeRestarted, OutcomeRefusedBooting}

// ErrRefusedBooting is TrySubmit's answer while the server boots: SGLang's
// HTTP server is down and the router's connection is refused.
var ErrRefusedBooting = errors.New("sglangsim: connection refused: the server is booting")

// Record is the ground truth of one request.
type Record struct {
	RID             string
	Room            uint64
	Rank            int
	Kind            Kind
	EnteredInflight time.Time // zero while still before the inflight queue
	Left            time.Time // zero while still in the server
	Outcome         Outcome
	ForcedAt        time.Time // when a force-fail set the lever; zero if never
	// WedgeOrdered is true when a standing wedge order (round 4) set its
	// lever (ForcedAt).
	WedgeOrdered bool
	// TransferQueue is the transfer queue the room was bound for; -1 for
	// the fake sender and refused requests.
	TransferQueue int
	// DecodePort is the decode endpoint the room was bound for (its link's
	// destination); 0 for the fake sender.
	DecodePort int
	// ProgressingWhenForced is true if a force-fail hit a request that was
	// making progress: kinds healthy, slow, health_check, failing, or
	// blocked_by_wedge once it sent a chunk after its wedge cleared.
	ProgressingWhenForced bool
	// DecodeReleased is when decode freed the request's slot and KV pages
	// (see the package documentation, "Decode"): shortly after Success;
	// after its waiting timeout (plus a deferred release) when prefill
	// failed it; after its heartbeat when prefill restarted; after a decode
	// force-fail. Zero while decode holds the pages (or the request never
	// reached decode, DecodeRank -1). Prefill's own health checks: Left.
	DecodeReleased time.Time
	// DecodeRank is the decode rank the request went to; -1 if none.
	DecodeRank int
	// DecodeAdmitted is when decode first saw the request in its queues;
	// DecodeReleased - DecodeAdmitted is the decode slot hold time.
	DecodeAdmitted time.Time
	// DecodeEnd is how the request left decode; "" while there.
	DecodeEnd DecodeEnd
	// DecodeForcedAt is when a decode force-fail pulled the lever.
	DecodeForcedAt time.Time
	// UnsafeFree is non-empty when decode freed the request's pages while
	// prefill still had a chunk of the room outstanding (a corruption
	// hazard), and says what freed them: DecodeForceFail (the watchdog) or
	// DecodeTimeout (SGLang's own waiting timeout).
	UnsafeFree DecodeEnd
	// PrefillFreedUnder is non-empty when prefill's release of the request
	// freed its KV pages while a transfer worker still held a chunk of it
	// (SGLang v0.5.18: the Failed branch's release_kv_cache in
	// disaggregation/prefill.py frees the request, not the transfer):
	// PrefillFreeLiveRead when that chunk was still moving, so its read
	// goes on over freed pages, PrefillFreeHungHandle when it hung (the
	// remedy's own case). ForcedAt tells a lever's free from SGLang's.
	PrefillFreedUnder PrefillFree
	// CorruptedBy is the rid of a request whose late prefill write landed
	// in this request's decode pages.
	CorruptedBy string
}

// PrefillFree is what a transfer was doing when prefill freed the pages
// it reads (Record.PrefillFreedUnder).
type PrefillFree string

// Values of Record.PrefillFreedUnder.
const (
	PrefillFreeHungHandle = PrefillFree("hung_handle")
	PrefillFreeLiveRead   = PrefillFree("live_read")
)

var prefillFrees = [...]PrefillFree{"", PrefillFreeHungHandle, PrefillFreeLiveRead}

// DecodeHold is how long decode held the request's slot and KV pages
// (DecodeAdmitted to DecodeReleased); 0 while it still holds them or if the
// request never reached decode.
func (r Record) DecodeHold() time.Duration {
	if r.DecodeAdmitted.IsZero() || r.DecodeReleased.IsZero() {
		return 0
	}
	return r.DecodeReleased.Sub(r.DecodeAdmitted)
}

// ClientAnswered is when the client got its answer: the router sends a
// request to prefill and decode at once, waits for both legs and returns
// decode's response, so the client waits for the later of prefill's Left
// and DecodeReleased (a prefill release alone answers no client). Left for
// a request that never reached decode; zero while a leg is still open.
func (r Record) ClientAnswered() time.Time {
	if r.Left.IsZero() || r.DecodeRank < 0 {
		return r.Left
	}
	if r.DecodeReleased.After(r.Left) || r.DecodeReleased.IsZero() {
		return r.DecodeReleased
	}
	return r.Left
}

// Sim is a simulated SGLang PD prefill server and the decode server it
// feeds. All methods are safe for concurrent use.
type Sim struct {
	opts   Options
	clock  clock.Clock
	ranks  []*rank  // by rank index dp*PPSize + pp
	groups []*group // by dp rank

	dranks []*drank // decode ranks

	restartMu sync.Mutex // one restart at a time

	hazMu       sync.Mutex
	corruptions []Corruption // guarded by hazMu

	cfgMu sync.RWMutex
	model string // guarded by cfgMu
	gen   int    // restart generation, guarded by cfgMu
	quiet bool   // no arrivals and no health checks (parity scene), guarded by cfgMu
	// unwatched: the plugin cannot watch the transfer workers (the parity
	// scene: the Python stand-in's managers have no FastQueue), guarded by
	// cfgMu.
	unwatched bool
	downUntil time.Time // the server boots until then, guarded by cfgMu
	// restartTimes[g] is when prefill generation g ended; replaced whole
	// under cfgMu on each restart.
	restartTimes    atomic.Pointer[[]time.Time]
	decodeGen       int       // guarded by cfgMu
	decodeDownUntil time.Time // guarded by cfgMu
}

// New validates the options and returns a simulator whose clock starts at
// Clock.Now(). Nothing runs until Start or Step.
func New(o Options) (*Sim, error) {
	if o.Clock == nil {
		return nil, errors.New("sglangsim: Options.Clock is required")
	}
	if o.DPSize < 0 || o.PPSize < 0 || o.DecodeDPSize < 0 {
		return nil, errors.New("sglangsim: DPSize, PPSize and DecodeDPSize must not be negative")
	}
	if o.DecodeDPSize == 0 {
		o.DecodeDPSize = 1
	}
	if o.DPSize == 0 {
		o.DPSize = 1
	}
	if o.PPSize == 0 {
		o.PPSize = 1
	}
	if o.AttnTP < 0 || o.TPUnwatched < 0 {
		return nil, errors.New("sglangsim: AttnTP and TPUnwatched must not be negative")
	}
	if o.AttnTP == 0 {
		o.AttnTP = 1
	}
	if o.TPUnwatched >= o.AttnTP {
		return nil, errors.New("sglangsim: TPUnwatched counts non-leader ranks: at most AttnTP-1")
	}
	switch o.Era {
	case "":
		o.Era = EraV05
	case EraName, EraModelName, EraEngineType, EraV05, EraNewest:
	default:
		return nil, fmt.Errorf("sglangsim: unknown era %q", o.Era)
	}
	switch o.Backend {
	case "":
		o.Backend = BackendNIXL
	case BackendNIXL, BackendMooncake:
	default:
		return nil, fmt.Errorf("sglangsim: unknown backend %q", o.Backend)
	}
	switch o.LeverEra {
	case "":
		o.LeverEra = LeversNewest
	case LeversNewest, LeversEarly:
	case LeversNIXLMid2025:
		if o.Backend != BackendNIXL {
			return nil, fmt.Errorf("sglangsim: lever era %q needs backend %q", o.LeverEra, BackendNIXL)
		}
	default:
		return nil, fmt.Errorf("sglangsim: unknown lever era %q", o.LeverEra)
	}
	switch o.QueueKey {
	case "":
		o.QueueKey = QueueKeyDecodePorts
	case QueueKeyDecodePorts, QueueKeyRoom:
	default:
		return nil, fmt.Errorf("sglangsim: unknown queue key %q", o.QueueKey)
	}
	if len(o.DecodePorts) == 0 {
		o.DecodePorts = DefaultDecodePorts
	}
	for _, p := range o.DecodePorts {
		if p <= 0 || p > 65535 {
			return nil, fmt.Errorf("sglangsim: decode port %d is not a TCP port", p)
		}
	}
	o.DecodePorts = slices.Clone(o.DecodePorts)
	if o.ArrivalRate < 0 || o.SlowFraction < 0 || o.SlowFraction > 1 {
		return nil, errors.New("sglangsim: ArrivalRate must be >= 0 and SlowFraction in [0, 1]")
	}
	if o.ModelName == "" {
		o.ModelName = DefaultModelName
	}
	if o.BootstrapAddr == "" {
		o.BootstrapAddr = DefaultBootstrapAddr
	}
	if len(o.RankHosts) > 0 && len(o.RankHosts) != o.DPSize*o.PPSize {
		return nil, fmt.Errorf("sglangsim: %d RankHosts for %d prefill ranks", len(o.RankHosts), o.DPSize*o.PPSize)
	}
	o.RankHosts = slices.Clone(o.RankHosts)
	if o.TransferMedian <= 0 {
		o.TransferMedian = 200 * time.Millisecond
	}
	if o.SlowChunkEvery <= 0 {
		o.SlowChunkEvery = 5 * time.Second
	}
	if o.IdleRefresh <= 0 {
		o.IdleRefresh = 30 * time.Second
	}
	if o.OrderTimeout <= 0 {
		o.OrderTimeout = 5 * time.Second
	}
	if o.HealthCheckEvery < 0 {
		o.HealthCheckEvery = 0
	}
	if o.BootTime == 0 {
		o.BootTime = DefaultBootTime
	}
	if o.BootTime < 0 {
		o.BootTime = 0
	}
	if o.DecodeWaitingTimeout <= 0 {
		o.DecodeWaitingTimeout = DefaultDecodeWaitingTimeout
	}
	if o.KVPoolTokens < 0 || o.MaxRunningRequests < 0 {
		return nil, errors.New("sglangsim: KVPoolTokens and MaxRunningRequests must not be negative")
	}
	if o.KVPoolTokens == 0 {
		o.KVPoolTokens = DefaultKVPoolTokens
	}
	if o.MaxRunningRequests == 0 {
		o.MaxRunningRequests = DefaultMaxRunningRequests
	}
	s := &Sim{opts: o, clock: o.Clock, model: o.ModelName}
	now := s.clock.Now()
	for dp := 0; dp < o.DPSize; dp++ {
		g := &group{
			dp:  dp,
			rng: rand.New(rand.NewPCG(uint64(o.Seed), uint64(dp)*0x9E3779B97F4A7C15+1)),
		}
		for pp := 0; pp < o.PPSize; pp++ {
			r := &rank{mu: &g.mu, g: g, idx: dp*o.PPSize + pp, dp: dp, pp: pp, byRID: make(map[string]*request)}
			for range o.AttnTP - 1 {
				r.peers = append(r.peers, &xfer{})
			}
			for tp := range o.AttnTP {
				x := r.xf(tp)
				for qi := range x.links.queue {
					x.links.queue[qi] = 1
				}
			}
			g.stages = append(g.stages, r)
			s.ranks = append(s.ranks, r)
		}
		g.reset(s, now, now, 0, false)
		s.groups = append(s.groups, g)
	}
	for i := 0; i < o.DecodeDPSize; i++ {
		dr := &drank{idx: i}
		dr.reset(s, now, 0)
		s.dranks = append(s.dranks, dr)
	}
	if o.Scenario != "" {
		if err := s.SetScenario(o.Scenario); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Ranks is the number of ranks (DPSize * PPSize).
func (s *Sim) Ranks() int { return len(s.ranks) }

// RankIndex maps (dp, pp) to the rank index dp*PPSize + pp.
func (s *Sim) RankIndex(dp, pp int) int { return dp*s.opts.PPSize + pp }

// Options returns the effective options (defaults filled in).
func (s *Sim) Options() Options { return s.opts }

func (s *Sim) rank(i int) *rank {
	if i < 0 || i >= len(s.ranks) {
		panic(fmt.Sprintf("sglangsim: rank %d out of range [0, %d)", i, len(s.ranks)))
	}
	return s.ranks[i]
}

func (s *Sim) modelName() string {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return s.model
}

// Booting tells whether the server is down after a restart or crash at
// the clock's current time: its plugin listeners and /metrics refuse
// connections, and its schedulers make no passes.
func (s *Sim) Booting() bool { return s.down(s.clock.Now()) }

func (s *Sim) down(now time.Time) bool {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return now.Before(s.downUntil)
}

// Start runs one goroutine per rank that makes a scheduler pass about every
// millisecond of wall time, each at Clock.Now(), until ctx ends. Calling it
// again while the goroutines run does nothing.
func (s *Sim) Start(ctx context.Context) {
	for _, r := range s.ranks {
		r.mu.Lock()
		if r.running {
			r.mu.Unlock()
			continue
		}
		r.running = true
		r.mu.Unlock()
		go s.runRank(ctx, r)
	}
	for _, dr := range s.dranks {
		dr.mu.Lock()
		if dr.running {
			dr.mu.Unlock()
			continue
		}
		dr.running = true
		dr.mu.Unlock()
		go s.runDecode(ctx, dr)
	}
}

func (s *Sim) runDecode(ctx context.Context, dr *drank) {
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			dr.mu.Lock()
			dr.running = false
			dr.mu.Unlock()
			return
		case <-t.C:
			dr.pass(s, s.clock.Now())
		}
	}
}

func (s *Sim) runRank(ctx context.Context, r *rank) {
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			r.mu.Lock()
			r.running = false
			r.mu.Unlock()
			return
		case <-t.C:
			now := s.clock.Now()
			if r.pass(s, now) {
				s.restartServer(now)
			}
		}
	}
}

// Step makes one synchronous pass of every rank that is not paused, at
// Clock.Now(): arrivals and health checks up to now, bootstrap, a prefill
// batch, pending orders, the inflight poll and releases; then one pass of
// every decode rank.
func (s *Sim) Step() {
	now := s.clock.Now()
	for _, r := range s.ranks {
		if r.pass(s, now) {
			s.restartServer(now)
		}
	}
	for _, dr := range s.dranks {
		dr.pass(s, now)
	}
}

// PauseLoop stops (or resumes) the scheduler loop of one rank: no passes, no
// loop iterations, and force-fail orders time out with 503.
func (s *Sim) PauseLoop(rank int, paused bool) {
	r := s.rank(rank)
	r.mu.Lock()
	r.paused = paused
	r.mu.Unlock()
}

// Restart models an SGLang server restart (what POST /admin/restart, a
// crash, or the orchestrator does): every scheduler process of the server
// exits at once, every request in it is lost (Outcome "restarted"), and
// for BootTime the plugin listeners and /metrics refuse connections. Then
// the server serves again with new pids, empty queues, loop counters,
// counters and histograms from 0, no wedged transfer worker and no
// orphaned transfer, and a warm-up batch writes the gauges. Requests that
// arrive while it boots are refused (OutcomeRefusedBooting). Pending
// force-fail orders are answered 503. Later requests may reuse a room id
// with a new rid.
func (s *Sim) Restart() { s.restartServer(s.clock.Now()) }

func (s *Sim) restartServer(now time.Time) {
	s.restartMu.Lock()
	defer s.restartMu.Unlock()
	s.cfgMu.Lock()
	var ended []time.Time
	if p := s.restartTimes.Load(); p != nil {
		ended = slices.Clone(*p)
	}
	ended = append(ended, now)
	s.restartTimes.Store(&ended)
	s.gen++
	gen, quiet := s.gen, s.quiet
	up := now.Add(s.opts.BootTime)
	s.downUntil = up
	s.cfgMu.Unlock()
	for _, g := range s.groups {
		g.mu.Lock()
		g.reset(s, now, up, gen, quiet)
		g.mu.Unlock()
	}
}

// Submit injects one request with a fixed behaviour into the bootstrap queue
// of spec.Rank's DP rank (every PP stage of it gets the request) and returns
// its rid and room. While the server boots the request is refused (see
// TrySubmit). It panics if the rank does not exist.
func (s *Sim) Submit(spec RequestSpec) (rid string, room uint64) {
	rid, room, _ = s.TrySubmit(spec)
	return rid, room
}

// TrySubmit is Submit that says whether the request was admitted: while the
// server boots after a restart or crash it is refused with
// ErrRefusedBooting and recorded with Outcome "refused_booting"; it never
// reaches the scheduler nor decode.
func (s *Sim) TrySubmit(spec RequestSpec) (rid string, room uint64, err error) {
	r := s.rank(spec.Rank)
	now := s.clock.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if s.down(now) {
		rid, room = r.g.refuse(spec, now, r.idx)
		return rid, room, ErrRefusedBooting
	}
	q := r.g.newRequest(s, spec, now, r.idx)
	r.g.bootstrapQ = append(r.g.bootstrapQ, q)
	s.toDecode(r.g, q)
	return q.rid, q.room, nil
}

// PoolUsage is what one prefill scheduler process's pools hold.
type PoolUsage struct {
	// UsedTokens are the KV pool tokens held by its inflight queue, of
	// TotalTokens (Options.KVPoolTokens).
	UsedTokens, TotalTokens int
	// Requests hold a req_to_token slot (the inflight queue), of
	// MaxRequests (Options.MaxRunningRequests).
	Requests, MaxRequests int
	// MetadataSlots hold a metadata buffer (the waiting and inflight
	// queues), of MaxMetadataSlots.
	MetadataSlots, MaxMetadataSlots int
}

// Pool returns the pool usage of one rank at its last pass.
func (s *Sim) Pool(rank int) PoolUsage {
	r := s.rank(rank)
	r.mu.Lock()
	defer r.mu.Unlock()
	return PoolUsage{
		UsedTokens: r.inflightTk, TotalTokens: s.opts.KVPoolTokens,
		Requests: len(r.inflight), MaxRequests: s.opts.MaxRunningRequests,
		MetadataSlots: len(r.g.waitingQ) + len(r.inflight), MaxMetadataSlots: 2 * s.opts.MaxRunningRequests,
	}
}

// Inject submits a request pinned by one of the three mechanisms, on every
// PP stage of the rank's DP rank.
func (s *Sim) Inject(rank int, pin PinKind) (rid string, room uint64) {
	b := BehaviorPinResurrection
	switch pin {
	case PinAbortBeforeRegister:
		b = BehaviorPinAbortBeforeRegister
	case PinStuckHandle:
		b = BehaviorPinStuckHandle
	}
	return s.Submit(RequestSpec{Rank: rank, Behavior: b})
}

// PullLever pulls every lever the backend has on the request's sender of
// one rank directly, bypassing the plugin's refusals (health check,
// transfer succeeded, unsupported): the sender's abort() and, on NIXL,
// _send_failed = True. It models an operator at a Python prompt or an
// older plugin. Whether poll() then reads Failed depends on the lever era;
// in LeversEarly a Failed poll crashes the server. It reports whether the
// rid is in the rank's inflight queue.
func (s *Sim) PullLever(rank int, rid string) bool {
	r := s.rank(rank)
	r.mu.Lock()
	defer r.mu.Unlock()
	q, ok := r.byRID[rid]
	if !ok {
		return false
	}
	levers := []string{pluginapi.LeverAbort}
	if s.opts.Backend == BackendNIXL && !q.fake {
		levers = append(levers, pluginapi.LeverSendFailed)
	}
	r.pull(s, q, levers, s.clock.Now())
	return true
}

// Records returns the ground truth of every request so far, DP rank by DP
// rank in arrival order.
func (s *Sim) Records() []Record {
	var n int
	for _, g := range s.groups {
		g.mu.Lock()
		n += len(g.records)
		g.mu.Unlock()
	}
	out := make([]Record, 0, n)
	for _, g := range s.groups {
		g.mu.Lock()
		for i := range g.records {
			out = append(out, g.records[i].export())
		}
		g.mu.Unlock()
	}
	return out
}

// SetScenario replaces the simulator's state with a named scene. The only
// scene is ScenarioParity, shared with the Python stand-in: no arrivals, no
// health checks, model "standin", and on DP rank 0 (every PP stage; with
// PPSize 1 that is rank 0, dp0/pp0/tp0) exactly these inflight requests:
//
//  1. "pinned-0001", room 9223372036854775001, addr "10.0.0.7:8998", 4096
//     prompt tokens, bound for decode port 17002 (transfer queue 2),
//     Transferring with progress frozen at 3 (a resurrection pin: the
//     transfer failed, no chunk outstanding), entered 120 s ago;
//  2. "healthy-0002", room 18446744073709551557, addr "10.0.0.8:8998", 1024
//     prompt tokens, bound for decode port 17001 (transfer queue 1),
//     Transferring with progress advancing by 1 every 100 ms of clock time
//     (50 at setup) and never finishing, a chunk always in flight, entered
//     5 s ago;
//  3. "HEALTH_CHECK_1764403200.0", room 0, addr "2.2.2.2", 1 prompt
//     token, fake sender in WaitingForInput for ever (progress -1, no
//     transfer queue, nothing in flight), entered 200 s ago;
//  4. ParityWarmupRID, a warm-up request (the fake bootstrap host and room
//     0, no HEALTH_CHECK prefix; SGLang v0.5.18: disaggregation/utils.py):
//     otherwise like the health check, entered 150 s ago.
//
// Counters start from 0, and the scene stays without traffic across
// Restart. The stand-in's KV managers have no FastQueue transfer queues
// for the plugin to watch, so the round-4 plugin lists
// server.transfer_progress false (transfer_workers and chunks_queued null,
// wedge_orders empty) and answers wedge orders 501, as the Python plugin
// does on it. It must be called before Start.
func (s *Sim) SetScenario(name string) error {
	if name != ScenarioParity {
		return fmt.Errorf("sglangsim: unknown scenario %q", name)
	}
	for _, r := range s.ranks {
		r.mu.Lock()
		running := r.running
		r.mu.Unlock()
		if running {
			return errors.New("sglangsim: SetScenario must be called before Start")
		}
	}
	s.cfgMu.Lock()
	s.model = "standin"
	s.quiet = true
	s.unwatched = true
	gen := s.gen
	s.cfgMu.Unlock()
	now := s.clock.Now()
	for _, g := range s.groups {
		g.mu.Lock()
		g.reset(s, now, now, gen, true)
		g.mu.Unlock()
	}
	g := s.groups[0]
	g.mu.Lock()
	defer g.mu.Unlock()
	g.parity(s, now)
	return nil
}

// ClientAbort is the client giving up on a request (SGLang v0.5.18:
// managers/scheduler.py abort_request): in the inflight queue every PP
// stage's sender gets abort() (record_failure, update_status(room,
// Failed), conclude_state = Failed), the next pass releases it as Failed,
// and the worker skips its chunks not taken yet. It is nobody's
// force-fail: the record's outcome is OutcomeFailed. It reports whether
// the rid was in the inflight queue of one of the rank's DP rank stages.
func (s *Sim) ClientAbort(rank int, rid string) bool {
	r := s.rank(rank)
	r.mu.Lock()
	defer r.mu.Unlock()
	now := s.clock.Now()
	found := false
	for _, st := range r.g.stages {
		q, ok := st.byRID[rid]
		if !ok || q.fake {
			continue
		}
		found = true
		// The tokenizer broadcasts the AbortReq to every TP rank's
		// scheduler, which aborts its own sender.
		for _, sd := range q.tp[st.pp] {
			sd.aborted = true
			if s.opts.LeverEra != LeversNIXLMid2025 {
				if _, present := st.status(s, sd, now); present {
					sd.statusFailed = true
				}
			}
		}
	}
	return found
}
