package pluginapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"time"
)

// DefaultMaxBodyBytes caps a listing body: about 8k rooms, far more than
// a real inflight queue holds, and small enough that two full listings and
// a full /metrics fit the sidecar's 64 MiB (docs/hardening.md).
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
// (e.g. http://127.0.0.1:30100). The caller checks where baseURL points.
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
	ctx, cancel := withTimeout(ctx, c.admin)
	defer cancel()
	payload, err := json.Marshal(order)
	if err != nil {
		return 0, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+PathForceFail, bytes.NewReader(payload))
	if err != nil {
		return 0, nil, fmt.Errorf("plugin %s: %w", c.base, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.adminHTTP.Do(req)
	if err != nil {
		return 0, nil, fmt.Errorf("plugin %s%s: %w", c.base, PathForceFail, err)
	}
	defer resp.Body.Close()
	body, err := c.readBody(resp.Body)
	if err != nil {
		return resp.StatusCode, nil, fmt.Errorf("plugin %s%s: %w", c.base, PathForceFail, err)
	}
	var out ForceFailResponse
	if err := json.Unmarshal(body, &out); err != nil || out.Result == "" {
		// Something in between may echo the request's headers. The
		// transport may have set the token itself: take it from the
		// request that was sent.
		for _, secret := range []string{c.token, sentCredentials(resp)} {
			if secret != "" {
				body = bytes.ReplaceAll(body, []byte(secret), []byte("[REDACTED]"))
			}
		}
		return resp.StatusCode, nil, fmt.Errorf("plugin %s%s: HTTP %d with an unusable body: %s", c.base, PathForceFail, resp.StatusCode, snippet(body))
	}
	return resp.StatusCode, &out, nil
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
	}
	return &Listing{
		APIVersion: *w.APIVersion,
		Server:     *w.Server,
		NowUnix:    w.NowUnix,
		Loop:       *w.Loop,
		Queues:     w.Queues,
		Inflight:   rooms,
	}, nil
}

func snippet(b []byte) string {
	const max = 200
	s := strings.TrimSpace(string(b))
	if len(s) > max {
		s = s[:max] + "…"
	}
	return s
}
