package pluginapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The prefill verdict API is served by the prefill-side watchdog, not by
// the plugin: GET PathRoomVerdict + "<room>?rid=<rid>&age_seconds=<age>"
// answers what that watchdog knows of the room, so that a decode-side
// watchdog can tell whether the prefill peer has stopped sending for its
// request (docs/decode.md).
const PathRoomVerdict = "/api/v1/rooms/"

// Query parameters of a verdict lookup: the decode request the verdict is
// for. A room is reused (a client or router may set bootstrap_room), so a
// verdict is bound to the request by its rid and by its age: a release
// older than the decode request answers for an earlier request.
const (
	VerdictParamRID = "rid"
	VerdictParamAge = "age_seconds"
)

// MaxVerdictRIDBytes caps the rid of a lookup; SGLang's rids are 32 hex
// digits, a client's own rids are short too.
const MaxVerdictRIDBytes = 256

// VerdictQuery names the decode request a verdict is asked for.
type VerdictQuery struct {
	// BootstrapAddr is the request's bootstrap_addr: its host names the
	// prefill peer to ask when PrefillRankAddrs is empty.
	BootstrapAddr string
	// PrefillRankAddrs are the request's prefill_rank_addrs: the hosts of
	// the prefill ranks its receiver talks to, each asked.
	PrefillRankAddrs []string
	Room             uint64
	RID              string
	// AgeSeconds is the decode request's age_seconds: how long ago the
	// decode side first saw it, a duration on its own clock.
	AgeSeconds float64
}

// Verdicts of the prefill side on one room.
const (
	// VerdictStopped: the prefill watchdog released the room of this rid,
	// after the decode request was first seen, with no chunk in flight
	// (at the last listing and at the re-read), and the room was never
	// listed as an orphaned transfer since.
	VerdictStopped = "stopped"
	// VerdictLive: the room was released, but a chunk of it may still be
	// written (in flight at release, or listed as an orphan since).
	VerdictLive = "live"
	// VerdictInQueue: a prefill inflight listing still holds the room.
	VerdictInQueue = "in_queue"
	// VerdictUnknown: this watchdog knows nothing of the room.
	VerdictUnknown = "unknown"
)

// RoomVerdict is the body of a verdict answer. Room is a decimal string,
// so that clients in any language keep all 64 bits.
type RoomVerdict struct {
	Room string `json:"room"`
	// RID echoes the rid the verdict was bound to; a watchdog that
	// predates binding leaves it out, and its "stopped" is refused.
	RID     string `json:"rid,omitempty"`
	Verdict string `json:"verdict"`
	// ReleasedSecondsAgo is how long ago the answering watchdog released
	// the room (stopped, live); a duration, so that no two hosts' wall
	// clocks are compared.
	ReleasedSecondsAgo float64 `json:"released_seconds_ago,omitempty"`
	Reason             string  `json:"reason,omitempty"`
}

// maxVerdictBytes caps a verdict body: a few hundred bytes in practice.
const maxVerdictBytes = 4096

// FetchVerdict asks the watchdog at base (e.g. http://10.0.0.7:9433) for its
// verdict on the room of q's request. Any error or unexpected answer is an
// error: the caller must then treat the transfer as possibly live.
func FetchVerdict(ctx context.Context, client *http.Client, base string, q VerdictQuery) (RoomVerdict, error) {
	room := q.Room
	params := url.Values{VerdictParamRID: {q.RID}, VerdictParamAge: {strconv.FormatFloat(q.AgeSeconds, 'f', 3, 64)}}
	target := strings.TrimRight(base, "/") + PathRoomVerdict + strconv.FormatUint(room, 10) + "?" + params.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: %w", target, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: %w", target, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxVerdictBytes+1))
	if err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: reading body: %w", target, err)
	}
	if len(body) > maxVerdictBytes {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: body exceeds %d bytes", target, maxVerdictBytes)
	}
	if resp.StatusCode != http.StatusOK {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: HTTP %d: %s", target, resp.StatusCode, snippet(body))
	}
	var v RoomVerdict
	if err := json.Unmarshal(body, &v); err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: malformed verdict: %w", target, err)
	}
	if v.Room != strconv.FormatUint(room, 10) {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: verdict for room %q, asked for %d", target, v.Room, room)
	}
	switch v.Verdict {
	case VerdictStopped:
		// A watchdog that predates binding answers for the room alone,
		// perhaps for an earlier request that had it.
		if v.RID != q.RID {
			return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: stopped for rid %q, asked for %q: a verdict not bound to this request (upgrade the prefill watchdog)", target, v.RID, q.RID)
		}
		return v, nil
	case VerdictLive, VerdictInQueue, VerdictUnknown:
		return v, nil
	}
	return RoomVerdict{}, errors.New("prefill watchdog " + target + ": unknown verdict " + strconv.Quote(v.Verdict))
}

// VerdictClientOptions configure a VerdictClient.
type VerdictClientOptions struct {
	// URLTemplate is the base URL of a prefill peer's watchdog with
	// "{host}" where the host of the decode request's bootstrap_addr
	// goes, e.g. http://{host}:9433.
	URLTemplate string
	// Networks are the networks a bootstrap host must be in; the host
	// comes from listing data, so nothing outside them is ever asked.
	Networks []netip.Prefix
	// Client carries the requests (TLS, authentication). Redirects are
	// never followed.
	Client *http.Client
	// Timeout bounds one lookup.
	Timeout time.Duration
	// CacheTTL keeps answers other than "stopped" (and failures) that
	// long, so that a held request does not cost its prefill peer a
	// lookup every cycle. "stopped" is never cached: an orphan listed
	// later turns it into "live".
	CacheTTL time.Duration
	// Now is the clock of the cache; nil means time.Now.
	Now func() time.Time
}

// maxVerdictCache bounds the cache; it is cleared when full.
const maxVerdictCache = 4096

type verdictCacheKey struct {
	host netip.Addr
	room uint64
	rid  string
}

type verdictCacheEntry struct {
	v   RoomVerdict
	err error
	at  time.Time
}

// VerdictClient asks the watchdogs of prefill peers for their verdicts on
// rooms, restricted to configured networks.
type VerdictClient struct {
	opts  VerdictClientOptions
	mu    sync.Mutex
	cache map[verdictCacheKey]verdictCacheEntry
}

// NewVerdictClient checks opts and returns a client.
func NewVerdictClient(opts VerdictClientOptions) (*VerdictClient, error) {
	if strings.Count(opts.URLTemplate, "{host}") != 1 {
		return nil, fmt.Errorf("prefill watchdog URL template %q must contain {host} once", opts.URLTemplate)
	}
	u, err := url.Parse(strings.Replace(opts.URLTemplate, "{host}", "127.0.0.1", 1))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("prefill watchdog URL template %q must be an http or https URL with {host} as its host, without user, query or fragment", opts.URLTemplate)
	}
	if u.Hostname() != "127.0.0.1" {
		return nil, fmt.Errorf("prefill watchdog URL template %q must have {host} as its whole host", opts.URLTemplate)
	}
	if len(opts.Networks) == 0 {
		return nil, errors.New("prefill watchdog lookups need at least one allowed network")
	}
	if opts.Client == nil {
		return nil, errors.New("prefill watchdog lookups need an HTTP client")
	}
	c := *opts.Client
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	opts.Client = &c
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &VerdictClient{opts: opts, cache: map[verdictCacheKey]verdictCacheEntry{}}, nil
}

// BaseURL returns the prefill watchdog URL for a bootstrap or prefill
// rank address, or an error, without any request, when its host is not an
// IP address in the allowed networks.
func (c *VerdictClient) BaseURL(addr string) (string, netip.Addr, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return "", netip.Addr{}, fmt.Errorf("prefill address %q: %w", addr, err)
	}
	ip, err := netip.ParseAddr(host)
	if err != nil || ip.Zone() != "" {
		return "", netip.Addr{}, fmt.Errorf("prefill address %q: the host must be an IP address (names are never resolved for a lookup)", addr)
	}
	ip = ip.Unmap()
	allowed := false
	for _, n := range c.opts.Networks {
		if n.Contains(ip) {
			allowed = true
			break
		}
	}
	if !allowed {
		return "", ip, fmt.Errorf("prefill address %q is outside the allowed prefill networks: not asked", addr)
	}
	h := ip.String()
	if ip.Is6() {
		h = "[" + h + "]"
	}
	return strings.Replace(c.opts.URLTemplate, "{host}", h, 1), ip, nil
}

// maxVerdictHosts bounds the prefill hosts asked for one request: the
// nodes of one prefill instance, 2 to 4 in SGLang's own examples.
const maxVerdictHosts = 8

// verdictRank orders the verdicts of several hosts: the combined answer is
// the one ranked highest.
var verdictRank = map[string]int{VerdictUnknown: 0, VerdictStopped: 1, VerdictInQueue: 2, VerdictLive: 3}

// Verdict asks for the prefill side's verdict on q's request: the watchdog
// on the host of each of its prefill ranks (q.PrefillRankAddrs), or, when
// the listing gave none, the one on the host of q.BootstrapAddr. Over
// several hosts (a prefill instance on several nodes, one watchdog each)
// any failure is the answer, then live, then in_queue, then stopped: a
// watchdog that watches none of the room's ranks, such as a worker node's,
// answers unknown and is outvoted by one that does, while a watchdog that
// watches a stage still holding the room answers in_queue.
func (c *VerdictClient) Verdict(ctx context.Context, q VerdictQuery) (RoomVerdict, error) {
	addrs := q.PrefillRankAddrs
	if len(addrs) == 0 {
		addrs = []string{q.BootstrapAddr}
	}
	type target struct {
		base string
		ip   netip.Addr
	}
	var targets []target
	for _, a := range addrs {
		base, ip, err := c.BaseURL(a)
		if err != nil {
			return RoomVerdict{}, err
		}
		if !slices.ContainsFunc(targets, func(t target) bool { return t.ip == ip }) {
			targets = append(targets, target{base, ip})
		}
	}
	if len(targets) > maxVerdictHosts {
		return RoomVerdict{}, fmt.Errorf("the request's prefill ranks are on %d hosts, more than the %d asked for one request", len(targets), maxVerdictHosts)
	}
	var out RoomVerdict
	for i, t := range targets {
		v, err := c.hostVerdict(ctx, t.base, t.ip, q)
		if err != nil {
			return RoomVerdict{}, err
		}
		// Of two releases, the later one says how long the room has been
		// quiet on every stage.
		if i == 0 || verdictRank[v.Verdict] > verdictRank[out.Verdict] ||
			(v.Verdict == out.Verdict && v.ReleasedSecondsAgo < out.ReleasedSecondsAgo) {
			out = v
		}
	}
	return out, nil
}

// hostVerdict asks the watchdog at base, on host ip, through the cache.
func (c *VerdictClient) hostVerdict(ctx context.Context, base string, ip netip.Addr, q VerdictQuery) (RoomVerdict, error) {
	key := verdictCacheKey{ip, q.Room, q.RID}
	now := c.opts.Now()
	c.mu.Lock()
	e, ok := c.cache[key]
	c.mu.Unlock()
	if ok && now.Sub(e.at) < c.opts.CacheTTL {
		return e.v, e.err
	}
	if c.opts.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.opts.Timeout)
		defer cancel()
	}
	v, err := FetchVerdict(ctx, c.opts.Client, base, q)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil && v.Verdict == VerdictStopped {
		delete(c.cache, key)
		return v, nil
	}
	if len(c.cache) >= maxVerdictCache {
		clear(c.cache)
	}
	c.cache[key] = verdictCacheEntry{v: v, err: err, at: now}
	return v, err
}
