// Package alertwebhook receives Alertmanager webhook notifications and lets
// a firing stuck-request alert force-fail the stuck requests of the rank it
// names. It adds no rail of its own: the watchdog's actuator applies the same
// rails as in auto mode, and counts the calls under trigger "alert".
//
// The endpoint turns a dry run into real force-fails, so it has its own
// credential (a bearer token read from a file on every delivery), and it
// acts only on alerts whose labels name this watchdog (Options.Match): an
// alert about another pod, delivered here by mistake or forged, is refused
// and counted.
package alertwebhook

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sglang-watchdog/sglang-watchdog/tokenfile"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// Refusal reasons, the reason label of
// sglang_watchdog_alert_webhook_refusals_total.
const (
	// RefusedUnauthorized: a delivery without the webhook's bearer token
	// (or with a wrong one). Not counted in alert_webhook_requests_total.
	RefusedUnauthorized = "unauthorized"
	// RefusedForeignTarget: one firing stuck-request alert whose labels do
	// not name this watchdog (Options.Match), counted per alert.
	RefusedForeignTarget = "foreign_target"
)

// RefusalReasons lists every refusal reason.
var RefusalReasons = []string{RefusedUnauthorized, RefusedForeignTarget}

// Options configure a Receiver.
type Options struct {
	// TokenFile holds the bearer token Alertmanager must present. It is
	// read on every delivery, so a rotated Secret needs no restart.
	// Required.
	TokenFile string
	// Match names this watchdog: an alert is acted on only if it carries
	// every one of these labels with exactly this value (for example
	// pod=<pod name>, namespace=<namespace>). At least one is required.
	Match map[string]string
}

// Path is where the receiver listens.
const Path = "/alertmanager/webhook"

// AlertName is the alert that triggers force-fails.
const AlertName = "SGLangWatchdogRequestStuck"

const maxBody = 1 << 20

// Trigger is the part of the watchdog the receiver drives.
type Trigger interface {
	TriggerRank(ctx context.Context, dpRank, ppRank int) (int, error)
	CountWebhook(result string)
}

// Message is the part of Alertmanager's webhook payload (version 4) used.
type Message struct {
	Version string  `json:"version"`
	Status  string  `json:"status"`
	Alerts  []Alert `json:"alerts"`
}

// Alert is one alert of a notification.
type Alert struct {
	Status string            `json:"status"`
	Labels map[string]string `json:"labels"`
}

type rank struct{ dp, pp int }

// Receiver handles POST /alertmanager/webhook. Triggers run on one
// background worker, so that a slow admin call never holds Alertmanager's
// request open past its timeout (which would make it retry).
type Receiver struct {
	trigger Trigger
	logger  log.Logger
	queue   chan rank
	opts    Options

	mu       sync.Mutex
	refusals map[string]uint64
	refusedD *prometheus.Desc
}

// New returns a receiver; Run must be started for triggers to act. It
// refuses options without a token file or without a label to match.
func New(t Trigger, logger log.Logger, opts Options) (*Receiver, error) {
	if opts.TokenFile == "" {
		return nil, errors.New("the Alertmanager webhook needs a bearer token file")
	}
	if len(opts.Match) == 0 {
		return nil, errors.New("the Alertmanager webhook needs at least one label that names this watchdog (for example pod=<pod name>)")
	}
	for k, v := range opts.Match {
		if k == "" || v == "" {
			return nil, fmt.Errorf("webhook match label %q=%q: name and value must not be empty", k, v)
		}
	}
	if _, err := tokenfile.Read(opts.TokenFile); err != nil {
		return nil, fmt.Errorf("webhook token: %w", err)
	}
	return &Receiver{
		trigger: t, logger: logger, queue: make(chan rank, 64), opts: opts,
		refusals: map[string]uint64{},
		refusedD: prometheus.NewDesc("sglang_watchdog_alert_webhook_refusals_total",
			"Alertmanager webhook refusals: deliveries without the webhook's bearer token (unauthorized), and firing stuck-request alerts whose labels name another watchdog (foreign_target, one per alert).",
			[]string{"reason"}, nil),
	}, nil
}

// Describe implements prometheus.Collector.
func (r *Receiver) Describe(ch chan<- *prometheus.Desc) { ch <- r.refusedD }

// Collect implements prometheus.Collector.
func (r *Receiver) Collect(ch chan<- prometheus.Metric) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, reason := range RefusalReasons {
		ch <- prometheus.MustNewConstMetric(r.refusedD, prometheus.CounterValue, float64(r.refusals[reason]), reason)
	}
}

func (r *Receiver) refuse(reason string, n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refusals[reason] += uint64(n)
}

// authorized checks the bearer token against the file, read now.
func (r *Receiver) authorized(req *http.Request) (bool, error) {
	want, err := tokenfile.Read(r.opts.TokenFile)
	if err != nil {
		return false, err
	}
	got, ok := strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1, nil
}

// ours reports whether labels name this watchdog.
func (r *Receiver) ours(labels map[string]string) bool {
	for k, v := range r.opts.Match {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// identity is the part of labels that Match looks at, for logs.
func (r *Receiver) identity(labels map[string]string) []string {
	var out []string
	for k := range r.opts.Match {
		out = append(out, k+"="+strconv.Quote(labels[k]))
	}
	sort.Strings(out)
	return out
}

// Run works through queued triggers until ctx ends.
func (r *Receiver) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case rk := <-r.queue:
			n, err := r.trigger.TriggerRank(ctx, rk.dp, rk.pp)
			if err != nil {
				level.Error(r.logger).Log("msg", "alert-triggered force-fail refused", "dp_rank", rk.dp, "pp_rank", rk.pp, "err", err)
				continue
			}
			level.Info(r.logger).Log("msg", "alert-triggered force-fail pass done", "dp_rank", rk.dp, "pp_rank", rk.pp, "stuck_requests", n)
		}
	}
}

type answer struct {
	Result  string   `json:"result"`
	Ranks   []string `json:"queued_ranks,omitempty"`
	Foreign int      `json:"refused_alerts,omitempty"`
	Error   string   `json:"error,omitempty"`
}

func (r *Receiver) reply(w http.ResponseWriter, status int, a answer) {
	if a.Result != RefusedUnauthorized {
		r.trigger.CountWebhook(a.Result)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(a)
}

// ServeHTTP implements http.Handler.
func (r *Receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		r.reply(w, http.StatusMethodNotAllowed, answer{Result: watchdog.WebhookBadRequest, Error: "use POST"})
		return
	}
	ok, err := r.authorized(req)
	if err != nil {
		// Our own token file is unusable (a bad rotation): nothing can be
		// authenticated until it is fixed. 503 makes Alertmanager retry.
		level.Error(r.logger).Log("msg", "Alertmanager webhook refused: the webhook's token file is unusable", "err", err)
		r.refuse(RefusedUnauthorized, 1)
		r.reply(w, http.StatusServiceUnavailable, answer{Result: RefusedUnauthorized, Error: "the watchdog cannot read its webhook token"})
		return
	}
	if !ok {
		level.Warn(r.logger).Log("msg", "Alertmanager webhook refused: missing or wrong bearer token", "remote", req.RemoteAddr)
		r.refuse(RefusedUnauthorized, 1)
		w.Header().Set("WWW-Authenticate", `Bearer realm="sglang-watchdog alertmanager webhook"`)
		r.reply(w, http.StatusUnauthorized, answer{Result: RefusedUnauthorized, Error: "missing or wrong bearer token"})
		return
	}
	alerts, err := parse(io.LimitReader(req.Body, maxBody+1))
	if err != nil {
		level.Warn(r.logger).Log("msg", "unusable Alertmanager webhook payload", "remote", req.RemoteAddr, "err", err)
		r.reply(w, http.StatusBadRequest, answer{Result: watchdog.WebhookBadRequest, Error: err.Error()})
		return
	}
	seen := map[rank]bool{}
	var ranks []rank
	foreign := 0
	for _, a := range alerts {
		if !r.ours(a.labels) {
			foreign++
			level.Warn(r.logger).Log("msg", "Alertmanager webhook: refused an alert about another watchdog", "dp_rank", a.rank.dp, "pp_rank", a.rank.pp,
				"alert_labels", strings.Join(r.identity(a.labels), ","), "want", strings.Join(r.identity(r.opts.Match), ","))
			continue
		}
		if !seen[a.rank] {
			seen[a.rank] = true
			ranks = append(ranks, a.rank)
		}
	}
	if foreign > 0 {
		r.refuse(RefusedForeignTarget, foreign)
	}
	if len(ranks) == 0 && foreign > 0 {
		// 403: Alertmanager does not retry a 4xx, and a retry would not help.
		r.reply(w, http.StatusForbidden, answer{Result: watchdog.WebhookIgnored, Foreign: foreign,
			Error: "no alert names this watchdog (" + strings.Join(r.identity(r.opts.Match), ",") + ")"})
		return
	}
	if len(ranks) == 0 {
		r.reply(w, http.StatusOK, answer{Result: watchdog.WebhookIgnored})
		return
	}
	var queued []string
	for _, rk := range ranks {
		select {
		case r.queue <- rk:
			queued = append(queued, fmt.Sprintf("dp%d/pp%d", rk.dp, rk.pp))
		default:
			r.reply(w, http.StatusServiceUnavailable, answer{Result: watchdog.WebhookBusy, Error: "trigger queue full; Alertmanager will retry"})
			return
		}
	}
	r.reply(w, http.StatusAccepted, answer{Result: watchdog.WebhookAccepted, Ranks: queued, Foreign: foreign})
}

// stuckAlert is one firing stuck-request alert.
type stuckAlert struct {
	rank   rank
	labels map[string]string
}

// parse returns the firing stuck-request alerts. Every error names the
// alert index and the field.
func parse(body io.Reader) ([]stuckAlert, error) {
	b, err := io.ReadAll(body)
	if err != nil {
		return nil, fmt.Errorf("reading body: %w", err)
	}
	if len(b) > maxBody {
		return nil, fmt.Errorf("body exceeds %d bytes", maxBody)
	}
	var m Message
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("not an Alertmanager webhook message: %w", err)
	}
	if m.Alerts == nil {
		return nil, errors.New("message has no alerts array")
	}
	var out []stuckAlert
	for i, a := range m.Alerts {
		if a.Labels["alertname"] != AlertName || a.Status != "firing" {
			continue
		}
		dp, err := rankLabel(a.Labels, "dp_rank")
		if err != nil {
			return nil, fmt.Errorf("alerts[%d] (%s): %w", i, AlertName, err)
		}
		pp, err := rankLabel(a.Labels, "pp_rank")
		if err != nil {
			return nil, fmt.Errorf("alerts[%d] (%s): %w", i, AlertName, err)
		}
		out = append(out, stuckAlert{rank: rank{dp, pp}, labels: a.Labels})
	}
	return out, nil
}

func rankLabel(labels map[string]string, name string) (int, error) {
	v, ok := labels[name]
	if !ok {
		return 0, fmt.Errorf("label %s is missing", name)
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("label %s=%q is not a rank number", name, v)
	}
	return n, nil
}
