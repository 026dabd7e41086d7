package pluginapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"time"
)

// DefaultMaxBodyBytes caps a listing body: about 8k rooms, far more than
// a real inflight queue holds, and small enough that two full listings and
// a full /metrics fit a sidecar of 64 MiB, the smallest the sizing rule
// gives (docs/hardening.md).
const DefaultMaxBodyBytes = 2 << 20

// directTransport is http.DefaultTransport without a proxy from the
// environment: the bearer token goes to the configured URL and nowhere
// else. One for all clients, so that connections are pooled as before.
var directTransport = func() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	return t
}()

// ClientOptions configure a Client.
type ClientOptions struct {
	// Timeout bounds each listing read; zero means no timeout beyond the
	// context's.
	Timeout time.Duration
	// AdminTimeout bounds each admin call. The plugin waits up to 5 s for
	// its scheduler, so this must be longer than that.
	AdminTimeout time.Duration
	// Token is sent as a bearer token on admin calls only.
	Token string
	// MaxBodyBytes caps a response body; zero means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// Transport overrides the HTTP transport of listing reads, and of admin
	// calls unless AdminTransport is set.
	Transport http.RoundTripper
	// AdminTransport, if set, carries admin calls. It may add the
	// Authorization header itself (a token file re-read on every call);
	// listing reads never go through it.
	AdminTransport http.RoundTripper
}

// Client talks to the plugin of one scheduler rank.
type Client struct {
	base      string
	http      *http.Client
	adminHTTP *http.Client
	token     string
	maxBody   int64
	timeout   time.Duration
	admin     time.Duration
}

// NewClient returns a client for the plugin listening at baseURL
// (e.g. http://127.0.0.1:28100). The caller checks where baseURL points.
func NewClient(baseURL string, opts ClientOptions) *Client {
	maxBody := opts.MaxBodyBytes
	if maxBody <= 0 {
		maxBody = DefaultMaxBodyBytes
	}
	transport := opts.Transport
	if transport == nil {
		transport = directTransport
	}
	adminTransport := opts.AdminTransport
	if adminTransport == nil {
		adminTransport = transport
	}
	// A redirect could carry the bearer token to another host.
	noRedirect := func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &Client{
		base:      strings.TrimRight(baseURL, "/"),
		http:      &http.Client{Transport: transport, CheckRedirect: noRedirect},
		adminHTTP: &http.Client{Transport: adminTransport, CheckRedirect: noRedirect},
		token:     opts.Token,
		maxBody:   maxBody,
		timeout:   opts.Timeout,
		admin:     opts.AdminTimeout,
	}
}

// Target is the base URL, used to name this source in metrics and logs.
func (c *Client) Target() string { return c.base }

func withTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if d > 0 {
		return context.WithTimeout(ctx, d)
	}
	return context.WithCancel(ctx)
}

// readBody reads at most maxBody bytes and fails, rather than truncating,
// when the body is larger: a cut listing would hide rooms.
func (c *Client) readBody(r io.Reader) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, c.maxBody+1))
	if err != nil {
		return nil, fmt.Errorf("reading body: %w", err)
	}
	if int64(len(b)) > c.maxBody {
		return nil, fmt.Errorf("body exceeds %d bytes", c.maxBody)
	}
	return b, nil
}

// Inflight reads GET /debug/inflight and validates it.
func (c *Client) Inflight(ctx context.Context) (*Listing, error) {
	ctx, cancel := withTimeout(ctx, c.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+PathInflight, nil)
	if err != nil {
		return nil, fmt.Errorf("plugin %s: %w", c.base, err)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("plugin %s: %w", c.base, err)
	}
	defer resp.Body.Close()
	body, err := c.readBody(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("plugin %s%s: %w", c.base, PathInflight, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("plugin %s%s: HTTP %d: %s", c.base, PathInflight, resp.StatusCode, snippet(body))
	}
	l, err := DecodeListing(body)
	if err != nil {
		return nil, fmt.Errorf("plugin %s%s: %w", c.base, PathInflight, err)
	}
	return l, nil
}

// ForceFail posts one order. A non-nil error means no usable answer came
// back (transport failure, timeout, unreadable body); otherwise status and
// the decoded body are returned whatever the status.
func (c *Client) ForceFail(ctx context.Context, order ForceFailRequest) (int, *ForceFailResponse, error) {
	var out ForceFailResponse
	status, err := c.post(ctx, PathForceFail, order, &out, func() bool { return out.Result != "" })
	if err != nil {
		return status, nil, err
	}
	return status, &out, nil
}

// Restart posts POST /admin/restart, bounded by the admin timeout.
// An older plugin answers 404 with no usable body: that is an error here,
// with the status, and the caller reports it as unsupported.
func (c *Client) Restart(ctx context.Context, order RestartRequest) (int, *RestartResponse, error) {
	var out RestartResponse
	status, err := c.post(ctx, PathRestart, order, &out, func() bool { return out.Result != "" })
	if err != nil {
		return status, nil, err
	}
	return status, &out, nil
}

// PostWedgeOrder posts POST /admin/wedge_order: it places or
// renews the standing order for one wedged transfer queue, bounded by the
// admin timeout. As with ForceFail, a non-nil error means no usable answer;
// an older plugin's 404 without a contract body is such an error.
func (c *Client) PostWedgeOrder(ctx context.Context, order WedgeOrderRequest) (int, *WedgeOrderResponse, error) {
	var out WedgeOrderResponse
	status, err := c.post(ctx, PathWedgeOrder, order, &out, func() bool { return out.Result != "" })
	if err != nil {
		return status, nil, err
	}
	return status, &out, nil
}

// post sends one admin call and decodes its answer into out; usable tells
// whether the decoded body is an answer of the contract.
func (c *Client) post(ctx context.Context, path string, in, out any, usable func() bool) (int, error) {
	ctx, cancel := withTimeout(ctx, c.admin)
	defer cancel()
	payload, err := json.Marshal(in)
	if err != nil {
		return 0, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(payload))
	if err != nil {
		return 0, fmt.Errorf("plugin %s: %w", c.base, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.adminHTTP.Do(req)
	if err != nil {
		return 0, fmt.Errorf("plugin %s%s: %w", c.base, path, err)
	}
	defer resp.Body.Close()
	body, err := c.readBody(resp.Body)
	if err != nil {
		return resp.StatusCode, fmt.Errorf("plugin %s%s: %w", c.base, path, err)
	}
	if err := json.Unmarshal(body, out); err != nil || !usable() {
		// Something in between may echo the request's headers. The
		// transport may have set the token itself: take it from the
		// request that was sent.
		for _, secret := range []string{c.token, sentCredentials(resp)} {
			if secret != "" {
				body = bytes.ReplaceAll(body, []byte(secret), []byte("[REDACTED]"))
			}
		}
		return resp.StatusCode, fmt.Errorf("plugin %s%s: HTTP %d with an unusable body: %s", c.base, path, resp.StatusCode, snippet(body))
	}
	return resp.StatusCode, nil
}

// sentCredentials returns the credentials of the Authorization header of
// the request that produced resp, as the transport sent it.
func sentCredentials(resp *http.Response) string {
	if resp.Request == nil {
		return ""
	}
	_, cred, _ := strings.Cut(resp.Request.Header.Get("Authorization"), " ")
	return strings.TrimSpace(cred)
}

// wireListing mirrors Listing with a pointer for the parts whose absence
// must be told apart from an empty value.
type wireListing struct {
	APIVersion *int    `json:"api_version"`
	Server     *Server `json:"server"`
	NowUnix    float64 `json:"now_unix"`
	Loop       *Loop   `json:"loop"`
	Queues     Queues  `json:"queues"`
	Inflight   *[]Room `json:"inflight"`
	// OrphanedTransfers stays nil when absent or null (older plugin).
	OrphanedTransfers []OrphanedTransfer `json:"orphaned_transfers"`
	// DecodeRequests stays nil when absent or null (prefill, older plugin).
	DecodeRequests []DecodeRequest `json:"decode_requests"`
	// Present where server.transfer_progress; nil when absent or null.
	TransferWorkers []TransferWorker  `json:"transfer_workers"`
	WedgeOrders     []WedgeOrderState `json:"wedge_orders"`
	// On the leader of an attention TP/CP group; nil when absent or null.
	PeerTransferWorkers []PeerWorkers `json:"peer_transfer_workers"`
	// Nil when absent or null: the plugin does not know.
	KVThreads []KVThread `json:"kv_threads"`
}

var validPoll = map[string]bool{
	PollBootstrapping: true, PollWaitingForInput: true, PollTransferring: true,
	PollSuccess: true, PollFailed: true, PollUnknown: true,
}

// DecodeListing parses and validates a listing body. Every error names the
// offending field, and the room index where there is one.
func DecodeListing(body []byte) (*Listing, error) {
	var w wireListing
	if !decodeWireFast(body, &w) {
		w = wireListing{}
		if err := json.Unmarshal(body, &w); err != nil {
			return nil, fmt.Errorf("malformed listing: %w", err)
		}
	}
	switch {
	case w.APIVersion == nil:
		return nil, errors.New("listing has no api_version")
	case *w.APIVersion != APIVersion:
		return nil, fmt.Errorf("listing has api_version %d, this watchdog speaks %d", *w.APIVersion, APIVersion)
	case w.Server == nil:
		return nil, errors.New("listing has no server")
	case w.Loop == nil:
		return nil, errors.New("listing has no loop")
	case w.Inflight == nil:
		return nil, errors.New("listing has no inflight array")
	}
	if err := validateServer(w.Server); err != nil {
		return nil, err
	}
	rooms := *w.Inflight
	for i := range rooms {
		r := &rooms[i]
		switch {
		case r.RID == "":
			return nil, fmt.Errorf("inflight[%d] has no rid", i)
		case !validPoll[r.Poll]:
			return nil, fmt.Errorf("inflight[%d] (rid %q) has poll %q, want one of Bootstrapping, WaitingForInput, Transferring, Success, Failed, Unknown", i, r.RID, r.Poll)
		case math.IsNaN(r.AgeSeconds) || r.AgeSeconds < 0:
			return nil, fmt.Errorf("inflight[%d] (rid %q) has age_seconds %v", i, r.RID, r.AgeSeconds)
		case r.Progress < -1:
			return nil, fmt.Errorf("inflight[%d] (rid %q) has progress %d, want >= -1", i, r.RID, r.Progress)
		}
		if err := validateQueue(r.TransferQueue, w.Server.TransferQueues); err != nil {
			return nil, fmt.Errorf("inflight[%d] (rid %q) has %w", i, r.RID, err)
		}
		if r.ChunksQueued != nil && *r.ChunksQueued < 0 {
			return nil, fmt.Errorf("inflight[%d] (rid %q) has chunks_queued %d, want >= 0 or null", i, r.RID, *r.ChunksQueued)
		}
		if r.PeerChunksQueued != nil && *r.PeerChunksQueued < 0 {
			return nil, fmt.Errorf("inflight[%d] (rid %q) has peer_chunks_queued %d, want >= 0 or null", i, r.RID, *r.PeerChunksQueued)
		}
	}
	for i := range w.TransferWorkers {
		if err := validateWorker(&w.TransferWorkers[i], w.Server.TransferQueues); err != nil {
			return nil, fmt.Errorf("transfer_workers[%d] %w", i, err)
		}
	}
	ranks := make(map[string]bool, len(w.PeerTransferWorkers))
	for i := range w.PeerTransferWorkers {
		p := &w.PeerTransferWorkers[i]
		if p.Rank == "" || ranks[p.Rank] {
			return nil, fmt.Errorf("peer_transfer_workers[%d] has rank %q, want a name of its own (tp<R>-cp<C>)", i, p.Rank)
		}
		ranks[p.Rank] = true
		for j := range p.TransferWorkers {
			if err := validateWorker(&p.TransferWorkers[j], w.Server.TransferQueues); err != nil {
				return nil, fmt.Errorf("peer_transfer_workers[%d] (rank %s) transfer_workers[%d] %w", i, p.Rank, j, err)
			}
		}
	}
	for i, o := range w.WedgeOrders {
		if err := validateQueue(&o.TransferQueue, w.Server.TransferQueues); err != nil {
			return nil, fmt.Errorf("wedge_orders[%d] has %w", i, err)
		}
	}
	for i, o := range w.OrphanedTransfers {
		if o.OutstandingChunks < 1 {
			return nil, fmt.Errorf("orphaned_transfers[%d] (room %d) has outstanding_chunks %d, want >= 1", i, o.BootstrapRoom, o.OutstandingChunks)
		}
		if err := validateQueue(o.TransferQueue, w.Server.TransferQueues); err != nil {
			return nil, fmt.Errorf("orphaned_transfers[%d] (room %d) has %w", i, o.BootstrapRoom, err)
		}
	}
	for i := range w.DecodeRequests {
		if err := validateDecodeRequest(&w.DecodeRequests[i]); err != nil {
			return nil, fmt.Errorf("decode_requests[%d] %w", i, err)
		}
	}
	for i := range w.KVThreads {
		if err := validateThread(&w.KVThreads[i], w.Server.TransferQueues); err != nil {
			return nil, fmt.Errorf("kv_threads[%d] %w", i, err)
		}
	}
	return &Listing{
		APIVersion:          *w.APIVersion,
		Server:              *w.Server,
		NowUnix:             w.NowUnix,
		Loop:                *w.Loop,
		Queues:              w.Queues,
		Inflight:            rooms,
		OrphanedTransfers:   w.OrphanedTransfers,
		DecodeRequests:      w.DecodeRequests,
		TransferWorkers:     w.TransferWorkers,
		WedgeOrders:         w.WedgeOrders,
		PeerTransferWorkers: w.PeerTransferWorkers,
		KVThreads:           w.KVThreads,
	}, nil
}

var validThreadRole = map[string]bool{
	ThreadBootstrap: true, ThreadTransferWorker: true, ThreadDecodeListener: true, ThreadHeartbeat: true, ThreadOther: true,
}

// validateThread checks one entry of kv_threads: its role keys a metric
// label and its queue keys the rooms a dead worker strands.
func validateThread(th *KVThread, queues *int) error {
	switch {
	case !validThreadRole[th.Role]:
		return fmt.Errorf("has role %q, want one of bootstrap, transfer_worker, decode_listener, heartbeat, other", th.Role)
	case len(th.Function) > MaxThreadFunction:
		return fmt.Errorf("(role %s) has a function of %d bytes, want at most %d", th.Role, len(th.Function), MaxThreadFunction)
	}
	if err := validateQueue(th.TransferQueue, queues); err != nil {
		return fmt.Errorf("(role %s) has %w", th.Role, err)
	}
	return nil
}

// validateWorker checks one entry of transfer_workers: the
// watchdog divides pages by seconds and compares seconds with deadlines,
// so neither may be negative or NaN.
func validateWorker(tw *TransferWorker, queues *int) error {
	q := tw.TransferQueue
	if err := validateQueue(&q, queues); err != nil {
		return fmt.Errorf("has %w", err)
	}
	switch {
	case tw.Depth < 0:
		return fmt.Errorf("(queue %d) has depth %d, want >= 0", q, tw.Depth)
	case tw.ChunksTaken < 0:
		return fmt.Errorf("(queue %d) has chunks_taken %d, want >= 0", q, tw.ChunksTaken)
	}
	if c := tw.InFlight; c != nil {
		switch {
		case c.Chunk < 0:
			return fmt.Errorf("(queue %d) has in_flight.chunk %d, want >= 0", q, c.Chunk)
		case c.Pages < 0:
			return fmt.Errorf("(queue %d) has in_flight.pages %d, want >= 0", q, c.Pages)
		case math.IsNaN(c.Seconds) || c.Seconds < 0:
			return fmt.Errorf("(queue %d) has in_flight.seconds %v, want >= 0", q, c.Seconds)
		case len(c.Link) > MaxLinkLength:
			return fmt.Errorf("(queue %d) has an in_flight.link of %d bytes, want at most %d", q, len(c.Link), MaxLinkLength)
		}
	}
	for j, f := range tw.Finished {
		switch {
		case f.Chunk < 0:
			return fmt.Errorf("(queue %d) has finished[%d].chunk %d, want >= 0", q, j, f.Chunk)
		case f.Pages < 0:
			return fmt.Errorf("(queue %d) has finished[%d].pages %d, want >= 0", q, j, f.Pages)
		case math.IsNaN(f.Seconds) || math.IsInf(f.Seconds, 0) || f.Seconds < 0:
			return fmt.Errorf("(queue %d) has finished[%d].seconds %v, want a finite number >= 0", q, j, f.Seconds)
		case len(f.Link) > MaxLinkLength:
			return fmt.Errorf("(queue %d) has a finished[%d].link of %d bytes, want at most %d", q, j, len(f.Link), MaxLinkLength)
		case j > 0 && f.Chunk <= tw.Finished[j-1].Chunk:
			return fmt.Errorf("(queue %d) has finished[%d].chunk %d after %d, want increasing chunk numbers", q, j, f.Chunk, tw.Finished[j-1].Chunk)
		}
	}
	for j, s := range tw.Recent {
		if math.IsNaN(s[0]) || math.IsNaN(s[1]) || s[0] < 0 || s[1] < 0 {
			return fmt.Errorf("(queue %d) has recent[%d] %v, want [pages >= 0, seconds >= 0]", q, j, s)
		}
	}
	return nil
}

// validateDecodeRequest checks one entry of decode_requests.
func validateDecodeRequest(r *DecodeRequest) error {
	switch {
	case r.RID == "":
		return errors.New("has no rid")
	case !validPoll[r.Poll]:
		return fmt.Errorf("(rid %q) has poll %q, want one of Bootstrapping, WaitingForInput, Transferring, Success, Failed, Unknown", r.RID, r.Poll)
	case r.Queue != DecodeQueuePrealloc && r.Queue != DecodeQueueTransfer:
		return fmt.Errorf("(rid %q) has queue %q, want prealloc or transfer", r.RID, r.Queue)
	case math.IsNaN(r.AgeSeconds) || r.AgeSeconds < 0:
		return fmt.Errorf("(rid %q) has age_seconds %v", r.RID, r.AgeSeconds)
	case r.Progress < -1:
		return fmt.Errorf("(rid %q) has progress %d, want >= -1", r.RID, r.Progress)
	case r.ChunksExpected != nil && *r.ChunksExpected < 0:
		return fmt.Errorf("(rid %q) has chunks_expected %d, want >= 0 or null", r.RID, *r.ChunksExpected)
	case len(r.PrefillRankAddrs) > MaxPrefillRankAddrs:
		return fmt.Errorf("(rid %q) has %d prefill_rank_addrs, want at most %d", r.RID, len(r.PrefillRankAddrs), MaxPrefillRankAddrs)
	}
	for _, a := range r.PrefillRankAddrs {
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" || len(a) > maxPrefillRankAddrBytes {
			return fmt.Errorf("(rid %q) has prefill_rank_addrs entry %q, want host:port", r.RID, a)
		}
	}
	return nil
}

// MaxPrefillRankAddrs bounds a decode request's prefill_rank_addrs: a
// receiver talks to the ranks of one prefill DP rank's attention group
// and PP stages.
const MaxPrefillRankAddrs = 256

const maxPrefillRankAddrBytes = 256

// validateServer checks the fields of server that older plugins leave
// out (levers, pp_size, transfer_queues); absent ones are unknown and pass.
func validateServer(s *Server) error {
	switch {
	case s.PPSize < 0:
		return fmt.Errorf("server has pp_size %d, want >= 1", s.PPSize)
	case s.PPSize > 0 && (s.PPRank < 0 || s.PPRank >= s.PPSize):
		return fmt.Errorf("server has pp_rank %d outside pp_size %d", s.PPRank, s.PPSize)
	case s.TransferQueues != nil && *s.TransferQueues < 1:
		return fmt.Errorf("server has transfer_queues %d, want >= 1 or null", *s.TransferQueues)
	}
	for i, l := range s.Levers {
		if l == "" {
			return fmt.Errorf("server has an empty levers[%d]", i)
		}
	}
	return nil
}

// validateQueue checks a transfer_queue index against the queue count
// when both are known.
func validateQueue(q, queues *int) error {
	switch {
	case q == nil:
		return nil
	case *q < 0:
		return fmt.Errorf("transfer_queue %d, want >= 0 or null", *q)
	case queues != nil && *q >= *queues:
		return fmt.Errorf("transfer_queue %d, but server.transfer_queues is %d", *q, *queues)
	}
	return nil
}

func snippet(b []byte) string {
	const max = 200
	s := strings.TrimSpace(string(b))
	if len(s) > max {
		s = s[:max] + "…"
	}
	return s
}
