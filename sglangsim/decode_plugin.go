package sglangsim

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// DecodeListing is the decode plugin's view of one decode rank, as GET
// /debug/inflight serves it (round 3).
func (s *Sim) DecodeListing(rank int) pluginapi.Listing {
	dr := s.drank(rank)
	dr.mu.Lock()
	defer dr.mu.Unlock()
	return dr.listing(s, s.clock.Now())
}

// decodeListingJSON writes the round 3 fields that pluginapi's omitempty
// tags would drop: decode_requests and the decode queue lengths when 0, and
// server.deferred_release as null where unknown.
type decodeListingJSON struct {
	pluginapi.Listing
	Server         decodeServerJSON          `json:"server"`
	Queues         decodeQueuesJSON          `json:"queues"`
	DecodeRequests []pluginapi.DecodeRequest `json:"decode_requests"`
}

type decodeServerJSON struct {
	pluginapi.Server
	DeferredRelease *bool `json:"deferred_release"`
}

type decodeQueuesJSON struct {
	Bootstrap int `json:"bootstrap"`
	Waiting   int `json:"waiting"`
	Inflight  int `json:"inflight"`
	Prealloc  int `json:"prealloc"`
	Transfer  int `json:"transfer"`
}

func decodeJSON(l pluginapi.Listing) decodeListingJSON {
	return decodeListingJSON{Listing: l,
		Server:         decodeServerJSON{Server: l.Server, DeferredRelease: l.Server.DeferredRelease},
		Queues:         decodeQueuesJSON{Prealloc: l.Queues.Prealloc, Transfer: l.Queues.Transfer},
		DecodeRequests: l.DecodeRequests}
}

// DecodeForceFail does what POST /admin/force_fail does on a decode rank
// (round 3), with an already decoded body: the prefill answers' order
// (401, 400, 503 while booting, 501, 404, 409 room_mismatch, 409
// health_check at once), then on the scheduler thread 409
// transfer_succeeded, 409 transfer_live (a started transfer without
// prefill_stopped), already_failed, would_flip, or flipped with levers
// ["abort"] or ["abort", "deferred_abort"].
func (s *Sim) DecodeForceFail(ctx context.Context, rank int, req pluginapi.ForceFailRequest, authorization string) (int, pluginapi.ForceFailResponse) {
	if !s.authorized(authorization) {
		return unauthorized()
	}
	if req.RID == "" {
		return badRequest("rid is required and must be a non-empty string")
	}
	if rank < 0 || rank >= len(s.dranks) {
		return 404, pluginapi.ForceFailResponse{Result: pluginapi.ResultNotFound, RID: req.RID,
			Error: "no such decode rank " + strconv.Itoa(rank)}
	}
	if s.DecodeBooting() {
		return 503, pluginapi.ForceFailResponse{Result: pluginapi.ResultSchedulerUnresponsive, RID: req.RID,
			Error: "the server is restarting"}
	}
	if levers, note := s.decodeLevers(); len(levers) == 0 {
		return 501, pluginapi.ForceFailResponse{Result: pluginapi.ResultUnsupported, RID: req.RID,
			Error: "no lever releases a decode request on this SGLang: " + note}
	}
	dr := s.dranks[rank]
	dr.mu.Lock()
	if _, st, resp, refused := lookupOrder(req, dr.byRID); refused {
		dr.mu.Unlock()
		return st, resp
	}
	return s.submit(ctx, &dr.mu, &dr.pending, dr.running || dr.paused, req, func(now time.Time) (int, pluginapi.ForceFailResponse) {
		return dr.applyOrder(s, req, now)
	})
}

func (s *Sim) decideDecodeRestart(rank int, req pluginapi.RestartRequest, authorization string) (int, pluginapi.RestartResponse) {
	dr := s.drank(rank)
	dr.mu.Lock()
	pid := dr.pid
	dr.mu.Unlock()
	return s.restartAnswer(pid, req, authorization)
}

// DecodeAdminRestart does what POST /admin/restart does on a decode rank:
// the prefill rules, and 202 restarts the decode server (RestartDecode).
func (s *Sim) DecodeAdminRestart(rank int, req pluginapi.RestartRequest, authorization string) (int, pluginapi.RestartResponse) {
	st, resp := s.decideDecodeRestart(rank, req, authorization)
	if st == http.StatusAccepted {
		s.RestartDecode()
	}
	return st, resp
}

// DecodePluginHandler serves the plugin API of one decode rank (round 3).
// While the decode server boots it refuses connections.
func (s *Sim) DecodePluginHandler(rank int) http.Handler {
	s.drank(rank)
	return s.pluginMux(pluginEndpoints{
		listing: func() any { return decodeJSON(s.DecodeListing(rank)) },
		forceFail: func(ctx context.Context, ff pluginapi.ForceFailRequest, auth string) (int, pluginapi.ForceFailResponse) {
			return s.DecodeForceFail(ctx, rank, ff, auth)
		},
		decideRestart: func(rr pluginapi.RestartRequest, auth string) (int, pluginapi.RestartResponse) {
			return s.decideDecodeRestart(rank, rr, auth)
		},
		restart: s.RestartDecode,
		down:    s.DecodeBooting,
	})
}

// DecodeMetricsHandler serves the decode server's /metrics.
func (s *Sim) DecodeMetricsHandler() http.Handler {
	return metricsHandler(s.DecodeBooting, s.DecodeMetricsText)
}

// DecodeMetricsText renders the decode server's /metrics: the decode queue
// gauges, num_running_reqs and the failure counters of every decode rank,
// labelled as the prefill side is in the same era (engine_type="decode" in
// the newest).
func (s *Sim) DecodeMetricsText() []byte {
	model := s.modelName()
	era := s.opts.Era
	snaps := make([]rankMetrics, len(s.dranks))
	for i, dr := range s.dranks {
		dr.mu.Lock()
		snaps[i] = dr.m
		dr.mu.Unlock()
	}
	var sched []series
	switch era {
	case EraName, EraModelName, EraEngineType:
		merged := mergeProcesses(snaps)
		sched = []series{{base: schedLabels(era, model, "", 0, 0, false), m: &merged}}
	default:
		for i := range s.dranks {
			sched = append(sched, series{base: schedLabels(era, model, "decode", i, 0, len(s.dranks) > 1), m: &snaps[i]})
		}
	}
	var prio []lbl
	if era == EraNewest {
		prio = []lbl{{"priority", ""}}
	}
	w := &expWriter{}
	for _, d := range gaugeDefs {
		if d.idx != gRunning && d.idx != gDecodePrealloc && d.idx != gDecodeTransfer {
			continue
		}
		help := d.help
		if (era == EraName || era == EraModelName) && d.oldHelp != "" {
			help = d.oldHelp
		}
		w.header(d.name, help, "gauge")
		for _, se := range sched {
			w.sample(d.name, se.base, prio, se.m.g[d.idx])
		}
	}
	w.counter("sglang:num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests.", sched, nil,
		func(m *rankMetrics) float64 { return m.bootstrapFailed })
	w.counter("sglang:num_transfer_failed_reqs_total", "The number of transfer failed requests.", sched, nil,
		func(m *rankMetrics) float64 { return m.transferFailed })
	if era == EraNewest {
		w.counter("sglang:scheduler_loop_iterations_total", "Total number of scheduler event loop iterations.", sched, nil,
			func(m *rankMetrics) float64 { return m.loopIterations })
	}
	return w.buf.Bytes()
}
