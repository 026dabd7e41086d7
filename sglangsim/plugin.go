package sglangsim

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// MaxBodyBytes is the largest force-fail body accepted (64 KiB).
const MaxBodyBytes = 64 << 10

// Listing is the plugin's view of one rank, as GET /debug/inflight serves
// it: poll and progress as observed by the last pass, ages and now_unix from
// the clock at the time of the call.
func (s *Sim) Listing(rank int) pluginapi.Listing {
	r := s.rank(rank)
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.listing(s, s.clock.Now())
}

func (s *Sim) authorized(authorization string) bool {
	if s.opts.Token == "" {
		return true
	}
	scheme, token, ok := strings.Cut(authorization, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		token = ""
	}
	return subtle.ConstantTimeCompare([]byte(strings.TrimSpace(token)), []byte(s.opts.Token)) == 1
}

func unauthorized() (int, pluginapi.ForceFailResponse) {
	return 401, pluginapi.ForceFailResponse{Result: pluginapi.ResultUnauthorized,
		Error: "a valid Authorization: Bearer token is required for /admin/*"}
}

func badRequest(msg string) (int, pluginapi.ForceFailResponse) {
	return 400, pluginapi.ForceFailResponse{Result: pluginapi.ResultBadRequest, Error: msg}
}

// ForceFail does what POST /admin/force_fail does on one rank, with an
// already decoded body and the request's Authorization header. See the
// package documentation for when the order is applied.
func (s *Sim) ForceFail(ctx context.Context, rank int, req pluginapi.ForceFailRequest, authorization string) (status int, resp pluginapi.ForceFailResponse) {
	if !s.authorized(authorization) {
		return unauthorized()
	}
	if req.RID == "" {
		return badRequest("rid is required and must be a non-empty string")
	}
	if rank < 0 || rank >= len(s.ranks) {
		return 404, pluginapi.ForceFailResponse{Result: pluginapi.ResultNotFound, RID: req.RID,
			Error: "no such rank " + strconv.Itoa(rank)}
	}
	if s.Booting() {
		return 503, pluginapi.ForceFailResponse{Result: pluginapi.ResultSchedulerUnresponsive, RID: req.RID,
			Error: "the server is restarting"}
	}
	r := s.ranks[rank]
	r.mu.Lock()
	// Clarification 2 and round 2: answer at once from the latest observation.
	if _, st, resp, refused := lookupOrder(req, r.byRID); refused {
		r.mu.Unlock()
		return st, resp
	}
	// After the lookup, as the plugin decides: a health check answers 409
	// health_check even where no lever works.
	if levers, note := s.levers(); len(levers) == 0 {
		r.mu.Unlock()
		return 501, pluginapi.ForceFailResponse{Result: pluginapi.ResultUnsupported, RID: req.RID,
			Error: "no lever releases a request on this SGLang: " + note}
	}
	return s.submit(ctx, r.mu, &r.pending, r.running || r.paused, req, func(now time.Time) (int, pluginapi.ForceFailResponse) {
		return r.applyOrder(s, req, now)
	})
}

// submit hands an order that passed the lookup to its scheduler and
// unlocks mu (held by the caller). With no scheduler loop (step-driven) it
// is applied inline, as the next pass would; else it is queued on pending
// for the next pass and awaited.
func (s *Sim) submit(ctx context.Context, mu *sync.Mutex, pending *[]*order, looping bool, req pluginapi.ForceFailRequest,
	apply func(now time.Time) (int, pluginapi.ForceFailResponse)) (int, pluginapi.ForceFailResponse) {
	if !looping {
		st, resp := apply(s.clock.Now())
		mu.Unlock()
		return st, resp
	}
	o := &order{req: req, done: make(chan orderResult, 1)}
	*pending = append(*pending, o)
	mu.Unlock()
	return s.await(ctx, o, mu, pending)
}

// await waits for the scheduler to answer a queued order, or withdraws it
// after OrderTimeout (clarification 4).
func (s *Sim) await(ctx context.Context, o *order, mu *sync.Mutex, pending *[]*order) (int, pluginapi.ForceFailResponse) {
	req := o.req
	timer := time.NewTimer(s.opts.OrderTimeout)
	defer timer.Stop()
	select {
	case res := <-o.done:
		return res.status, res.resp
	case <-timer.C:
	case <-ctx.Done():
	}
	mu.Lock()
	if o.state == orderPending {
		o.state = orderWithdrawn
		for i, p := range *pending {
			if p == o {
				*pending = append((*pending)[:i], (*pending)[i+1:]...)
				break
			}
		}
		mu.Unlock()
		return 503, pluginapi.ForceFailResponse{Result: pluginapi.ResultSchedulerUnresponsive, RID: req.RID,
			Error: "the scheduler loop did not pick the order up within " + s.opts.OrderTimeout.String() +
				"; the order was withdrawn"}
	}
	mu.Unlock()
	// Claimed just in time: the result was sent under the lock.
	res := <-o.done
	return res.status, res.resp
}

// AdminRestart does what POST /admin/restart does on one rank (docs/plugin-api.md,
// round 2), with an already decoded body: 401 without a configured or a
// valid token, 403 unless Options.AllowRestart, 409 when req.PID is not the
// rank's pid, 200 would_restart for a dry run, and 202 restarting, after
// which the whole server restarts (see Restart).
func (s *Sim) AdminRestart(rank int, req pluginapi.RestartRequest, authorization string) (int, pluginapi.RestartResponse) {
	st, resp := s.decideRestart(rank, req, authorization)
	if st == http.StatusAccepted {
		s.Restart()
	}
	return st, resp
}

func (s *Sim) decideRestart(rank int, req pluginapi.RestartRequest, authorization string) (int, pluginapi.RestartResponse) {
	r := s.rank(rank)
	r.mu.Lock()
	pid := r.pid
	r.mu.Unlock()
	return s.restartAnswer(pid, req, authorization)
}

// restartAnswer decides a restart call for the process pid (round 2).
func (s *Sim) restartAnswer(pid int, req pluginapi.RestartRequest, authorization string) (int, pluginapi.RestartResponse) {
	switch {
	case s.opts.Token == "" || !s.authorized(authorization):
		return 401, pluginapi.RestartResponse{Result: pluginapi.ResultUnauthorized, PID: pid,
			Error: "a valid Authorization: Bearer token is required for /admin/restart, and a token must be configured"}
	case !s.opts.AllowRestart:
		return 403, pluginapi.RestartResponse{Result: pluginapi.ResultRestartDisabled, PID: pid,
			Error: "restarts are not allowed in this process (SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=1 allows them)"}
	case req.PID <= 0:
		return 400, pluginapi.RestartResponse{Result: pluginapi.ResultBadRequest, PID: pid,
			Error: "pid is required and must be a positive integer"}
	case req.PID != pid:
		return 409, pluginapi.RestartResponse{Result: pluginapi.ResultPIDMismatch, PID: pid,
			Error: "pid " + strconv.Itoa(req.PID) + " is not this process (" + strconv.Itoa(pid) + ")"}
	case req.DryRun:
		return 200, pluginapi.RestartResponse{Result: pluginapi.ResultWouldRestart, PID: pid}
	}
	return 202, pluginapi.RestartResponse{Result: pluginapi.ResultRestarting, PID: pid}
}

// ParseRestart decodes a restart body. It returns a non-empty message when
// the body is a bad request.
func ParseRestart(body []byte) (pluginapi.RestartRequest, string) {
	var req pluginapi.RestartRequest
	obj, msg := jsonObject(body)
	if msg != "" {
		return req, msg
	}
	n, ok := obj["pid"].(json.Number)
	if !ok {
		return req, "pid is required and must be a positive integer"
	}
	pid, err := strconv.ParseInt(n.String(), 10, 32)
	if err != nil || pid <= 0 {
		return req, "pid is required and must be a positive integer"
	}
	req.PID = int(pid)
	if msg := boolField(obj, "dry_run", &req.DryRun); msg != "" {
		return req, msg
	}
	if reason, ok := obj["reason"].(string); ok {
		req.Reason = reason
	}
	return req, ""
}

// whileUp refuses every request while the server boots: the connection is
// closed without an answer, as a port nobody listens on would be.
func (s *Sim) whileUp(h http.Handler) http.Handler { return refuseWhile(s.Booting, h) }

func refuseWhile(down func() bool, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if down() {
			if hj, ok := w.(http.Hijacker); ok {
				if conn, _, err := hj.Hijack(); err == nil {
					_ = conn.Close()
					return
				}
			}
			http.Error(w, "the server is restarting", http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, req)
	})
}

// PluginHandler serves the plugin API of one rank: GET /healthz, GET
// /debug/inflight, POST /admin/force_fail, POST /admin/restart and
// (unless Options.PreRound4Plugin) POST /admin/wedge_order. While
// the server boots after a restart it refuses connections. It panics if the
// rank does not exist.
func (s *Sim) PluginHandler(rank int) http.Handler {
	s.rank(rank)
	var wedge func(pluginapi.WedgeOrderRequest, string) (int, pluginapi.WedgeOrderResponse)
	if !s.opts.PreRound4Plugin {
		wedge = func(wo pluginapi.WedgeOrderRequest, auth string) (int, pluginapi.WedgeOrderResponse) {
			return s.WedgeOrder(rank, wo, auth)
		}
	}
	return s.pluginMux(pluginEndpoints{
		listing: func() any { return s.Listing(rank) },
		forceFail: func(ctx context.Context, ff pluginapi.ForceFailRequest, auth string) (int, pluginapi.ForceFailResponse) {
			return s.ForceFail(ctx, rank, ff, auth)
		},
		decideRestart: func(rr pluginapi.RestartRequest, auth string) (int, pluginapi.RestartResponse) {
			return s.decideRestart(rank, rr, auth)
		},
		restart:    s.Restart,
		down:       s.Booting,
		wedgeOrder: wedge,
	})
}

// pluginEndpoints are what one plugin listener serves, on prefill or decode.
type pluginEndpoints struct {
	listing       func() any
	forceFail     func(context.Context, pluginapi.ForceFailRequest, string) (int, pluginapi.ForceFailResponse)
	decideRestart func(pluginapi.RestartRequest, string) (int, pluginapi.RestartResponse)
	restart       func()
	down          func() bool
	// wedgeOrder serves POST /admin/wedge_order; nil: the path does not
	// exist (decode, older plugins).
	wedgeOrder func(pluginapi.WedgeOrderRequest, string) (int, pluginapi.WedgeOrderResponse)
}

func (s *Sim) pluginMux(e pluginEndpoints) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc(pluginapi.PathHealthz, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "ok")
	})
	mux.HandleFunc(pluginapi.PathInflight, func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodGet && req.Method != http.MethodHead {
			w.Header().Set("Allow", "GET")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		writeJSON(w, http.StatusOK, e.listing())
	})
	mux.HandleFunc(pluginapi.PathForceFail, func(w http.ResponseWriter, req *http.Request) {
		body, msg, ok := postBody(w, req)
		if !ok {
			return
		}
		auth := req.Header.Get("Authorization")
		if !s.authorized(auth) {
			st, resp := unauthorized()
			writeJSON(w, st, resp)
			return
		}
		var ff pluginapi.ForceFailRequest
		if msg == "" {
			ff, msg = ParseForceFail(body)
		}
		if msg != "" {
			st, resp := badRequest(msg)
			writeJSON(w, st, resp)
			return
		}
		st, resp := e.forceFail(req.Context(), ff, auth)
		writeJSON(w, st, resp)
	})
	if e.wedgeOrder != nil {
		mux.HandleFunc(pluginapi.PathWedgeOrder, func(w http.ResponseWriter, req *http.Request) {
			body, msg, ok := postBody(w, req)
			if !ok {
				return
			}
			auth := req.Header.Get("Authorization")
			if !s.authorized(auth) {
				st, resp := wedgeAnswer(401, pluginapi.ResultUnauthorized, "a valid Authorization: Bearer token is required for /admin/*")
				writeJSON(w, st, resp)
				return
			}
			var wo pluginapi.WedgeOrderRequest
			if msg == "" {
				wo, msg = ParseWedgeOrder(body)
			}
			if msg != "" {
				writeJSON(w, 400, pluginapi.WedgeOrderResponse{Result: pluginapi.ResultBadRequest, Failed: []pluginapi.FailedRoom{}, Error: msg})
				return
			}
			st, resp := e.wedgeOrder(wo, auth)
			writeJSON(w, st, resp)
		})
	}
	mux.HandleFunc(pluginapi.PathRestart, func(w http.ResponseWriter, req *http.Request) {
		body, msg, ok := postBody(w, req)
		if !ok {
			return
		}
		var rr pluginapi.RestartRequest
		if msg == "" {
			rr, msg = ParseRestart(body)
		}
		st, resp := e.decideRestart(rr, req.Header.Get("Authorization"))
		if msg != "" && st != 401 && st != 403 {
			st, resp = 400, pluginapi.RestartResponse{Result: pluginapi.ResultBadRequest, PID: resp.PID, Error: msg}
		}
		writeJSON(w, st, resp)
		if st == http.StatusAccepted {
			if f, ok := w.(http.Flusher); ok {
				f.Flush()
			}
			e.restart()
		}
	})
	return refuseWhile(e.down, mux)
}

// postBody refuses any method but POST (ok false: answered) and reads an
// admin body of at most MaxBodyBytes; msg says why a body that could not
// be read is a bad request.
func postBody(w http.ResponseWriter, req *http.Request) (body []byte, msg string, ok bool) {
	if req.Method != http.MethodPost {
		w.Header().Set("Allow", "POST")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return nil, "", false
	}
	body, err := io.ReadAll(io.LimitReader(req.Body, MaxBodyBytes+1))
	switch {
	case err != nil:
		return nil, "cannot read the body: " + err.Error(), true
	case len(body) > MaxBodyBytes:
		return nil, "the body is larger than 64 KiB", true
	}
	return body, "", true
}

// ParseForceFail decodes a force-fail body under the rules of clarification
// 1. It returns a non-empty message when the body is a bad request.
func ParseForceFail(body []byte) (pluginapi.ForceFailRequest, string) {
	var req pluginapi.ForceFailRequest
	obj, msg := jsonObject(body)
	if msg != "" {
		return req, msg
	}
	switch rid := obj["rid"].(type) {
	case nil:
		return req, "rid is required"
	case string:
		if rid == "" {
			return req, "rid must not be empty"
		}
		req.RID = rid
	default:
		return req, "rid must be a string"
	}
	// null is refused rather than read as absent: a client that meant to
	// name the room but lost it must not fail whichever request has the rid.
	if raw, ok := obj["bootstrap_room"]; ok {
		n, isNum := raw.(json.Number)
		if !isNum {
			return req, "bootstrap_room must be a non-negative integer below 2^64"
		}
		room, err := strconv.ParseUint(n.String(), 10, 64)
		if err != nil {
			return req, "bootstrap_room must be a non-negative integer below 2^64"
		}
		req.BootstrapRoom = &room
	}
	if msg := boolField(obj, "dry_run", &req.DryRun); msg != "" {
		return req, msg
	}
	if msg := boolField(obj, "prefill_stopped", &req.PrefillStopped); msg != "" {
		return req, msg
	}
	if reason, ok := obj["reason"].(string); ok {
		req.Reason = reason
	}
	return req, ""
}

// boolField reads the optional boolean field name of obj into dst; it
// returns a message naming the field when it is not a boolean (null
// included).
func boolField(obj map[string]any, name string, dst *bool) string {
	raw, ok := obj[name]
	if !ok {
		return ""
	}
	b, isBool := raw.(bool)
	if !isBool {
		return name + " must be a boolean"
	}
	*dst = b
	return ""
}

// jsonObject decodes a body that must be exactly one JSON object, numbers
// kept as json.Number.
func jsonObject(body []byte) (map[string]any, string) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, "the body is not valid JSON"
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, "the body has data after the JSON object"
	}
	obj, ok := v.(map[string]any)
	if !ok {
		return nil, "the body is not a JSON object"
	}
	return obj, ""
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// Listen serves /metrics and every rank's plugin API on 127.0.0.1 ports
// chosen by the system until ctx ends. metricsURL ends in /metrics;
// pluginURLs[i] is the base URL of rank i (append pluginapi.Path*).
func (s *Sim) Listen(ctx context.Context) (metricsURL string, pluginURLs []string, err error) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", s.MetricsHandler())
	// The bootstrap server's /health, which decode's heartbeat reads.
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	plugins := make([]http.Handler, len(s.ranks))
	for i := range s.ranks {
		plugins[i] = s.PluginHandler(i)
	}
	return listen(ctx, s.whileUp(mux), plugins)
}

// ListenDecode serves the decode server, a separate pod: its /metrics and
// every decode rank's plugin API, on 127.0.0.1 ports chosen by the system
// until ctx ends. pluginURLs[i] is the base URL of decode rank i.
func (s *Sim) ListenDecode(ctx context.Context) (metricsURL string, pluginURLs []string, err error) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", s.DecodeMetricsHandler())
	plugins := make([]http.Handler, len(s.dranks))
	for i := range s.dranks {
		plugins[i] = s.DecodePluginHandler(i)
	}
	return listen(ctx, refuseWhile(s.DecodeBooting, mux), plugins)
}

// ListenNode serves one node of a multi-node instance until ctx ends, as
// the real node does on its own address: its /metrics (NodeMetricsHandler)
// on host:metricsPort and the plugin API of each of the given ranks on
// host:basePort + rank index, the plugin's port rule. Every node uses the
// same ports on its own host.
func (s *Sim) ListenNode(ctx context.Context, host string, metricsPort, basePort int, ranks []int) (metricsURL string, err error) {
	var servers []*http.Server
	serve := func(port int, h http.Handler) error {
		ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		go func() { _ = srv.Serve(ln) }()
		return nil
	}
	err = serve(metricsPort, s.NodeMetricsHandler(ranks))
	for _, r := range ranks {
		if err != nil {
			break
		}
		err = serve(basePort+r, s.PluginHandler(r))
	}
	go func() {
		<-ctx.Done()
		for _, srv := range servers {
			_ = srv.Close()
		}
	}()
	if err != nil {
		return "", err
	}
	return "http://" + net.JoinHostPort(host, strconv.Itoa(metricsPort)) + "/metrics", nil
}

func listen(ctx context.Context, metrics http.Handler, plugins []http.Handler) (metricsURL string, pluginURLs []string, err error) {
	var servers []*http.Server
	serve := func(h http.Handler) (string, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		go func() { _ = srv.Serve(ln) }()
		return "http://" + ln.Addr().String(), nil
	}
	shutdown := func() {
		for _, srv := range servers {
			_ = srv.Close()
		}
	}
	base, err := serve(metrics)
	if err != nil {
		return "", nil, err
	}
	metricsURL = base + "/metrics"
	for _, h := range plugins {
		u, err := serve(h)
		if err != nil {
			shutdown()
			return "", nil, err
		}
		pluginURLs = append(pluginURLs, u)
	}
	go func() {
		<-ctx.Done()
		shutdown()
	}()
	return metricsURL, pluginURLs, nil
}
