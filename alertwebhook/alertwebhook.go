// Package alertwebhook receives Alertmanager webhook notifications and lets
// a firing stuck-request alert force-fail the stuck requests of the rank it
// names. It adds no rail of its own: the watchdog's actuator applies the same
// rails as in auto mode, and counts the calls under trigger "alert".
package alertwebhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

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
}

// New returns a receiver; Run must be started for triggers to act.
func New(t Trigger, logger log.Logger) *Receiver {
	return &Receiver{trigger: t, logger: logger, queue: make(chan rank, 64)}
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
	Result string   `json:"result"`
	Ranks  []string `json:"queued_ranks,omitempty"`
	Error  string   `json:"error,omitempty"`
}

func (r *Receiver) reply(w http.ResponseWriter, status int, a answer) {
	r.trigger.CountWebhook(a.Result)
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
	ranks, err := parse(io.LimitReader(req.Body, maxBody+1))
	if err != nil {
		level.Warn(r.logger).Log("msg", "unusable Alertmanager webhook payload", "remote", req.RemoteAddr, "err", err)
		r.reply(w, http.StatusBadRequest, answer{Result: watchdog.WebhookBadRequest, Error: err.Error()})
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
	r.reply(w, http.StatusAccepted, answer{Result: watchdog.WebhookAccepted, Ranks: queued})
}

// parse returns the ranks of the firing stuck-request alerts. Every error
// names the alert index and the field.
func parse(body io.Reader) ([]rank, error) {
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
	seen := map[rank]bool{}
	var out []rank
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
		rk := rank{dp, pp}
		if !seen[rk] {
			seen[rk] = true
			out = append(out, rk)
		}
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
