// Package sglangsim is a model of an SGLang prefill server in prefill/decode
// (PD) disaggregated serving, faithful enough to drive the watchdog in the
// demo, in end-to-end tests and in benchmarks. It serves SGLang's /metrics
// (prometheus_client multiprocess text output, per label era) and the
// watchdog plugin's HTTP API (docs/plugin-api.md, including its "Project
// clarifications") for every (dp, pp) rank. References like "facts §1.6"
// point into the project's SGLang fact sheet (sglang-facts.md).
//
// # Time
//
// The simulator never reads the process clock: every decision uses the
// clock.Clock given in Options. Two ways to drive it:
//
//   - Start(ctx) runs one goroutine per rank that makes a scheduler pass every
//     millisecond of wall time, each pass reading Clock.Now(). This is the
//     live mode of the demo and of end-to-end tests.
//   - Step() makes one synchronous pass of every rank at Clock.Now(). A replay
//     harness advances a clock.Fake and calls Step (a pass per 100 ms of
//     simulated time is plenty); 100k requests replay in a few seconds.
//
// # The model of one rank (facts §3.1, §3.2)
//
// A request arrives in the bootstrap queue (KVPoll Bootstrapping for a few
// milliseconds), moves to the waiting queue, is taken into a prefill batch
// (this is when the scheduler logs stats and rewrites the PD queue gauges),
// and enters the inflight queue, where the sender is first WaitingForInput
// (until a transfer worker picks the room up), then Transferring (each chunk
// sent advances progress), then Success. Every pass polls the inflight
// queue: Success releases the request (prefill_transfer_kv_cache stage
// latency, kv_transfer_* metrics, the tokenizer's num_requests_total,
// prompt_tokens_total, generation_tokens_total); Failed releases it too and
// increments sglang:num_transfer_failed_reqs_total (facts §3.2, §7.4).
//
// Healthy transfer times are lognormal (sigma 1: p99.9 is about 22x the
// median). A SlowFraction of requests transfer for 30 s to 150 s but send a
// chunk at least every SlowChunkEvery: they keep making progress and must
// never be force-failed. Health checks (rid "HEALTH_CHECK_<time.time()>",
// room 0, host 2.2.2.2) use SGLang's fake sender: Success on the first poll
// after the forward. Their progress is -1 (the fake sender exposes none,
// like the Python plugin reports it).
//
// Simplifications: each (dp, pp) rank is an independent scheduler with its
// own queues and traffic (real PP stages share requests); the forward pass
// takes no simulated time; a prefill batch takes the whole waiting queue up
// to 64k tokens; only the attention-TP leader (tp_rank 0) is modelled.
//
// # Gauge refresh (facts §1.6, §7.1)
//
// The PD queue gauges are written only when the scheduler logs stats: when a
// prefill batch is formed, and by the idle refresh every IdleRefresh, which
// the PD prefill loop skips while the inflight queue is non-empty. Era
// "newest" logs after the batch result is processed (facts §3.1:
// report_prefill_stats after the requests were appended to the inflight
// queue), so a lone stuck request with no further traffic pins
// num_prefill_inflight_queue_reqs at 1 for ever. Older eras log when the
// batch is formed, before its requests enter the inflight queue: there the
// gauge shows a stuck request only once a later batch (more traffic, or a
// health check) is formed, and it then stays at that value while no traffic
// comes. A healthy completion followed by idleness lets the idle refresh
// write 0 after IdleRefresh. A warm-up batch at start (and after Restart)
// writes every gauge once, so the gauges exist from the first scrape.
//
// # Pins (facts §3.4, §3.5, §7.6) and the lever
//
//   - PinResurrection: the transfer fails (status Failed = 0) after a few
//     chunks, but a late Transferring update through a max()-based
//     update_status resurrects it: poll reads Transferring for ever, progress
//     frozen.
//   - PinAbortBeforeRegister: an ABORT popped transfer_infos before the room
//     was registered: the room reads WaitingForInput for ever, progress 0.
//   - PinStuckHandle: a transfer handle that never completes wedges its
//     transfer-worker shard (room % 4, per rank): the room stays Transferring
//     with progress frozen, and every room of that rank and shard that the
//     serial worker had not picked up yet waits behind it (WaitingForInput,
//     progress 0) until the wedge clears; rooms it had already picked up were
//     ahead of the handle and finish. The waiting rooms' record kind becomes
//     "blocked_by_wedge". Simplification: the simulated worker
//     abandons the handle as soon as the stuck room's lever is set, so the
//     shard recovers after the force-fail; real NIXL may stay blocked in
//     check_xfer_state.
//
// The lever is `_send_failed = True` on NIXL senders and `conclude_state =
// KVPoll.Failed` on Mooncake and fake senders (facts §3.5 remedy matrix):
// the next poll reads Failed and the pass releases the request. Each pin
// stays pinned until its lever is set, on either backend. A health check
// stuck in WaitingForInput (the FakeKVSender accumulation bug, PR #28652) is
// available as BehaviorStuckHealthCheck.
//
// # Force-fail orders (docs/plugin-api.md, Project clarifications)
//
// 401 and 400 are decided at once; 404 and 409 at once against the rank's
// latest observation (the inflight queue as of the last pass). Otherwise the
// order is queued. With Start running, the rank's goroutine picks it up at
// the start of its next inflight pass (before polling, so a flipped request
// is released in that same pass); if it has not within OrderTimeout (real
// time), the order is withdrawn atomically and the answer is 503; a
// withdrawn order is never applied. Without Start (Step-driven replay) and
// with the rank not paused, the order is applied inline, exactly as the next
// pass would apply it, and the next Step releases the request; a synchronous
// harness therefore never deadlocks. On a paused rank (PauseLoop) orders
// time out with 503 in both modes. already_failed (lever already set, or the
// last poll Failed) takes precedence over would_flip, as in the Python plugin.
// The loop counter (listing loop.iterations) counts inflight passes: every
// pass with HookRunsWhenEmpty (newest loops), otherwise only passes with a
// non-empty inflight queue (facts §8, §9); orders are only picked up by
// passes that run the hook.
//
// # /metrics (facts §1)
//
// MetricsHandler renders what prometheus_client's MultiProcessCollector
// serves: HELP/TYPE lines, sglang: names, labels sorted by name, values in
// Python's float formatting ("1.0", "8.128902e+06"), histograms as all _sum
// lines, then _bucket{le} and _count per series, one scheduler series per
// (dp, pp) attention-TP leader with tp_rank="0". Label eras:
//
//   - "name" (~v0.3.5): name=<model> everywhere.
//   - "model_name" (late 2024): model_name everywhere.
//   - "engine_type" (~v0.4.9): scheduler series add engine_type="unified".
//   - "v0.5": scheduler series model_name, engine_type="unified", tp_rank,
//     pp_rank, plus dp_rank when DPSize > 1; num_prefill_prealloc_queue_reqs;
//     kv_transfer_* gauges; per_stage_req_latency_seconds; a pid label on
//     num_retracted_reqs and num_paused_reqs (multiprocess_mode "all").
//   - "newest": engine_type="prefill", tp_rank, pp_rank, moe_ep_rank,
//     dp_rank, priority="" on queue-count gauges;
//     num_prefill_bootstrap_queue_reqs; kv_transfer_* histograms;
//     scheduler_loop_iterations_total; num_prefill_retries_total.
//
// The three eras without rank labels merge the ranks the way multiprocess
// mode does: "mostrecent" gauges take the value of the rank that logged last,
// counters and histograms are summed. The PD families are emitted in every
// era so that label handling can be exercised, although the releases of the
// two oldest eras predate PD disaggregation. Counters exist from start at 0;
// per-stage and other histogram series appear once observed. realtime_tokens_total
// (v0.5 and newest) counts prefill tokens when the forward runs, as the
// scheduler does. A DP8 newest-era payload with traffic has about 3.3k series.
//
// # Ground truth
//
// Records returns one Record per request (kind, rank, times, outcome, and
// whether a force-fail hit a request that would have completed by itself),
// so tests can assert that a watchdog never force-failed a progressing
// request. SetScenario("parity") sets up the fixed scene that the Python
// stand-in reproduces for the cross-language test.
package sglangsim
