// Package sglangsim is a model of an SGLang prefill server and the decode
// server it feeds in prefill/decode (PD) disaggregated serving, faithful
// enough to drive the watchdog in the demo, in end-to-end tests and in
// benchmarks. It serves SGLang's /metrics (prometheus_client multiprocess
// text output, per label era) and the watchdog plugin's HTTP API
// (docs/plugin-api.md, including its "Project clarifications", "Round 2
// additions", "Round 3 additions", "Round 4 additions" and, for the
// ranks of an attention-TP group, "Round 5 additions"; the round-4
// fields and path go with Options.PreRound4Plugin) for every prefill
// (dp, pp) rank and
// every decode rank. It is
// meant to be as unforgiving as SGLang: a watchdog that passes only because
// the simulator is kind is wrong. References like "SGLang v0.5.18:
// disaggregation/prefill.py" name the file, under python/sglang/srt/, and
// the SGLang release where the behaviour modelled was read; v0.5.18 is the
// newest release read, and older eras are named where they differ.
//
// # Time
//
// The simulator never reads the process clock: every decision uses the
// clock.Clock given in Options. Two ways to drive it:
//
//   - Start(ctx) runs one goroutine per rank that makes a scheduler pass every
//     millisecond of wall time, each pass reading Clock.Now(). This is the
//     live mode of the demo and of end-to-end tests.
//   - Step() makes one synchronous pass of every rank at Clock.Now(), prefill
//     ranks first, then decode ranks. A replay
//     harness advances a clock.Fake and calls Step (a pass per 100 ms of
//     simulated time is plenty); 100k requests replay in a few seconds.
//
// # The model of one DP rank
//
// Read in SGLang v0.5.18: disaggregation/prefill.py,
// managers/scheduler_pp_mixin.py.
//
// Each (dp, pp) rank is one scheduler process with its own pid, loop
// counter, metrics, plugin listener, KV manager and transfer workers. The
// PP stages of one DP rank share the same requests: stage 0 carries a
// request from arrival into every stage's inflight queue at once (same rid
// and room everywhere), and each stage holds its own sender for it, with
// its own poll, status and levers. A request leaves the inflight queues
// only when every stage reports it terminal (Success or Failed): a stage
// that is done keeps it (listing its terminal poll) while another stage is
// not, so a force-fail on one stage answers flipped and releases nothing
// until every stage is failed. A stage releases on its own next pass once
// all are terminal, so the stages may let go one pass apart.
//
// A request arrives in the bootstrap queue (KVPoll Bootstrapping for a few
// milliseconds), moves to the waiting queue, is taken into a prefill batch
// (this is when the scheduler logs stats and rewrites the PD queue gauges),
// and enters the inflight queue, where the sender is first WaitingForInput
// (until its transfer worker picks the room up), then Transferring (the
// worker sends its chunks) on NIXL v0.5.18, whose worker writes it; on
// Mooncake and mid-2025 NIXL, which never write it, WaitingForInput until
// Success (mooncake/conn.py v0.5.11 and v0.5.18, nixl/conn.py v0.5.11). Every pass polls the inflight
// queue (with PP, once every stage is terminal): Success releases the
// request (prefill_transfer_kv_cache stage
// latency, kv_transfer_* metrics, the tokenizer's num_requests_total,
// prompt_tokens_total, generation_tokens_total); Failed releases it too and
// increments sglang:num_transfer_failed_reqs_total (SGLang v0.5.18:
// disaggregation/prefill.py).
//
// Healthy transfer times are lognormal (sigma 1: p99.9 is about 22x the
// median): the time the room's transfer worker spends on it, to which the
// wait for the worker adds (below). A SlowFraction of requests transfer for
// 30 s to 150 s but send a chunk at least every SlowChunkEvery: they would
// complete by themselves, so a force-fail of one is a false force-fail
// (Record.ProgressingWhenForced), but their listed progress stands still
// like every room's (below), so the listing cannot tell them from a pin.
//
// The listing's progress stands still (SGLang v0.5.18, v0.5.11:
// disaggregation/nixl/conn.py NixlKVSender.send, disaggregation/common/conn.py
// CommonKVSender.send, disaggregation/prefill.py; seen with SGLang's own PD
// code run on CPU). The plugin lists NIXL's chunk_id, the scheduler's send()
// calls (one per prefill chunk: ceil(prompt / 8192) here), or the common
// sender's curr_idx (Mooncake), the KV pages handed over (page size 1: the
// prompt's tokens). The scheduler hands the last chunk over as the request
// enters the inflight queue, so that value is final for the whole stay
// there, whatever the transfer worker does. What the worker sent (chunks
// of 1,024 tokens here) shows only on decode (Decode, below). The parity
// scene alone (SetScenario) lists the worker's chunks, as the Python
// stand-in it is compared with sets them by hand. Health checks (rid "HEALTH_CHECK_<time.time()>",
// room 0, host 2.2.2.2) use SGLang's fake sender: Success on the first poll
// after the forward. Their progress is -1 (the fake sender exposes none,
// like the Python plugin reports it).
//
// Warm-up requests (RequestSpec.Warmup) use the same fake host and room 0
// with a plain random rid, no HEALTH_CHECK prefix; they are listed with
// health_check true and recorded as kind health_check. The automatic
// warm-up at start and after a restart is not listed: it only writes the
// gauges (below).
//
// Simplifications: the forward pass takes no simulated time; a prefill
// batch takes the waiting queue in order up to 64k tokens, as far as the
// pools below allow; attention TP is modelled on the transfer side only
// (Attention TP, below); a decode endpoint has one port; what prefill does with
// decode's ABORT frame beyond acknowledging it (Decode, below) is not
// modelled, so a pin stays on prefill until a lever or a restart.
//
// # Pools
//
// Read in SGLang v0.5.18: disaggregation/prefill.py,
// managers/schedule_batch.py.
//
// Each prefill scheduler process has finite pools, and a request holds its
// share of them from the moment it takes it until a terminal poll releases
// it (a force-fail, fail-fast, its own Success or Failed) or the server
// restarts: the KV pool (Options.KVPoolTokens, default 786,432 tokens,
// max_total_num_tokens of Llama-3.1-8B bf16 on one 80 GB GPU; a request
// holds its prompt's tokens from its prefill batch on), the req_to_token
// pool (Options.MaxRunningRequests, default 3,072: SGLang's size for that
// pool and a 131,072-token context) and the metadata buffers (twice
// MaxRunningRequests, taken when the request leaves the bootstrap queue). A
// prefill batch takes waiting requests in order while they fit; the first
// that does not fit waits, and the ones behind it with it (PrefillAdder
// stops there), unless the rank holds nothing. With no metadata buffer free
// a bootstrapped request stays in the bootstrap queue. So the rooms piling
// up behind a wedged transfer worker, which hold their pages for ever,
// fill the pool, and then no prefill batch is formed on that rank: healthy
// traffic bound for healthy queues stalls in the waiting queue (no batch,
// so the gauges are not written either) until the pile is released or the
// server restarts. At the detection benchmark's rate (25,000 requests an
// hour over DP8, prompts about 2k tokens) a wedge on a queue that takes a
// third of a rank's traffic fills the default pool in about 17 minutes
// (TestPoolFillsWithinAnHourAtBenchmarkRate). Healthy traffic at the
// demo's and the benchmark's rates never stalls, but the rooms piled
// behind a slow transfer on its serial queue hold up to a third of the
// pool (TestPoolNoStallWithoutPins: 229k tokens at the demo's rate, 164k
// at the benchmark's). The KV pool
// shows in sglang:num_used_tokens, sglang:token_usage,
// sglang:max_total_num_tokens and, era "newest", sglang:kv_used_tokens and
// sglang:kv_available_tokens, written when the scheduler logs stats; Pool
// reads all three pools at any time. The radix cache is not modelled: a
// request's prompt holds its tokens whatever it shares with others.
//
// # Gauge refresh
//
// Read in SGLang v0.5.18: managers/scheduler_components/metrics_reporter.py.
//
// The PD queue gauges are written only when the scheduler logs stats: when a
// prefill batch is formed, and by the idle refresh every IdleRefresh, which
// the PD prefill loop skips while the inflight queue is non-empty. Era
// "newest" logs after the batch result is processed (SGLang v0.5.18:
// disaggregation/prefill.py:
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
// # Transfer queues and workers
//
// Read in SGLang v0.5.18: disaggregation/nixl/conn.py, managers/scheduler.py,
// disaggregation/common/conn.py.
//
// Each scheduler process has TransferQueues (4) transfer worker queues,
// each served by one worker thread, serially (SGLang v0.5.18 and v0.5.11:
// disaggregation/nixl/conn.py and mooncake/conn.py transfer_worker; seen
// with SGLang's own NixlKVManager run on CPU: a hung handle on one decode
// destination held every later request to the same destination). A
// normal request is bound for one decode endpoint (RequestSpec.DecodePort,
// else one of Options.DecodePorts picked from the room); its queue is the
// sum of its destination decode ports modulo 4 (QueueKeyDecodePorts,
// newest NIXL: rooms bound for the same endpoints share a queue) or room % 4
// (QueueKeyRoom, older NIXL and the seeds' incident). Health checks use the
// fake sender and no queue. The scheduler hands a room's last chunk over as
// it enters the inflight queue, which queues it on its worker. The worker
// serves its rooms in that order, one at a time: it takes a chunk, posts
// it, waits for its handles, then takes the next, so a room is done (its
// last chunk settled, its transfer failed, a resurrection pin's failure)
// before the room behind it starts. A room waits in WaitingForInput, with
// nothing in flight, until its worker picks it up, then has a chunk
// outstanding (_staging_outstanding) until it succeeds, Transferring on
// NIXL and still WaitingForInput on Mooncake. So a
// slow healthy transfer holds every room behind it on its queue for as long
// as it takes (30 s to 150 s), and a stuck handle holds them until the
// process restarts (Pins, below). The worker waits for its handles with no
// deadline. It skips the chunks of a room whose status is Failed (an abort
// took, SGLang v0.5.18: disaggregation/nixl/conn.py transfer_worker) or that
// the scheduler released, after the chunk in flight, if any, settles.
//
// # Chunks, links and transfer progress (round 4)
//
// Read in SGLang v0.5.18: disaggregation/nixl/conn.py and mooncake/conn.py
// transfer_worker.
//
// A room's transfer is a run of chunks queued whole as it enters the
// inflight queue: 1,024 tokens a chunk, at least one every SlowChunkEvery
// of a long transfer, or RequestSpec.Chunks (1: one huge chunk); the
// prompt's pages (page size 1) are split evenly over them. The worker
// takes one chunk at a time: chunk i of a room ends at pickup + (i+1) x
// chunkEvery of its planned transfer time (the first includes the pickup),
// and that time runs at the speed of the room's link: a link is a decode
// destination of one rank (and attention-TP rank), not a queue, since
// destinations of any speed share a queue. Its speed is a factor of the
// planned speed, changeable at any time and kept across restarts
// (SetDestinationSpeed per destination; SetLinkSpeed for every
// destination on a queue: 0.01 makes every chunk take 100 times as long, 0
// stops it). So the worker's time per chunk is pages over its link's
// speed of the moment. A chunk that errors (BehaviorTransferFail) ends when it
// fails; a stuck handle (PinStuckHandle) is the chunk held for ever. The
// worker skips the chunks of a Failed or released room when it reaches
// them, all at once and in no time, as SGLang's check_status(room) ==
// Failed does; until then they stay queued. A released room's chunk in
// flight settles when the worker's time reaches its end (its orphan's end
// was guessed at the release at the link speed of the time, and is
// corrected then).
//
// A link is named as the plugin names it from SGLang's transfer_infos: the
// destination's key there, one per room here (Mooncake: the decode session
// id, "127.0.0.1:<decode port>"; NIXL: the decode agent's name, a uuid4 in
// SGLang, here one per port, "5eed0000-0000-4000-8000-<port, 12 digits>").
// Every attention-TP rank names its decode peer by the same name: the
// watchdog keeps links per rank.
//
// The plugin lists what a round-4 plugin lists: server.transfer_progress
// (true with worker queues; false on mid-2025 NIXL, whose manager has
// none), transfer_workers (tracked is always true: the plugin loads with
// the process; depth, chunks_taken, in_flight with the time held and its
// link, recent: the last 32 chunks that carried pages, [pages, seconds
// held], a skipped chunk with 0 s; finished: the same chunks with the
// number in_flight gave each and its link) and each room's chunks_queued (0 for an endless transfer
// and an unregistered room, null for health checks). Listing a rank plays
// its workers up to the clock's present time.
//
// POST /admin/wedge_order (WedgeOrder) follows the contract: 401, 400 (the
// field named), 503 while booting or with the loop paused, 501 without
// transfer progress or without a lever (lever_note), 404 for a queue
// beyond TransferQueues, 409 wedge_cleared when the worker does not hold
// that chunk (any standing order for the queue is dropped), 200
// would_order for a dry run (nothing stands), else 200 ordered. The order
// is taken under the scheduler's lock as between two passes, and fails
// nothing in its first answer: from the next pass on, every pass applies
// it, before the inflight poll, until it
// expires (ttl_seconds after the last call) or the worker holds another
// chunk. It fails, with the force-fail levers, every room of the rank's
// inflight queue bound for that queue except health checks, rooms whose
// status is Success or Failed, rooms already failed and rooms younger than
// min_age_seconds; each call answers the rooms failed since the previous
// one, this call's own included. Record.WedgeOrdered marks them. A
// restart forgets every order. ClientAbort is a client's abort (SGLang's
// own abort(), nobody's force-fail).
//
// # Pins
//
// Read in SGLang v0.5.18: disaggregation/common/conn.py,
// disaggregation/nixl/conn.py, mooncake/conn.py.
//
//   - PinResurrection: the transfer fails (status Failed = 0) after a few
//     chunks, but a late Transferring update through a max()-based
//     update_status resurrects it: the room is present with status
//     Transferring for ever, progress frozen, nothing outstanding.
//   - PinAbortBeforeRegister: an ABORT popped transfer_infos before the room
//     was registered: the room is absent from request_status and reads
//     WaitingForInput for ever, progress 0.
//   - PinStuckHandle: a transfer handle stays PROC for ever: the room stays
//     Transferring (WaitingForInput on Mooncake and mid-2025 NIXL) with
//     progress frozen and its chunk outstanding, and its
//     queue's worker is wedged until the scheduler process restarts,
//     whatever lever is pulled on the room. Every room of that process and
//     queue behind it (later traffic included; none on mid-2025 NIXL,
//     which has no worker queue) waits in WaitingForInput
//     with nothing sent; the rooms ahead of it were done before it started.
//     The waiting rooms' record kind becomes "blocked_by_wedge" (rooms
//     waiting behind a slow healthy transfer keep their kind: they
//     complete). Rooms on other queues are not affected.
//
// A pin holds on every PP stage (Inject) or on the stages in
// RequestSpec.PinStages; the other stages transfer normally, and the
// request stays on all stages until the pinned ones are terminal too.
//
// # Levers and lever eras (Options.LeverEra)
//
// Read in SGLang v0.5.18: disaggregation/nixl/conn.py, mooncake/conn.py,
// managers/scheduler.py, disaggregation/common/conn.py; the releases each
// era stands for were shown with SGLang's own PD code run on CPU
// (sglang_plugin/sglang_watchdog_plugin/conformance/).
//
// The plugin pulls, in order, abort (CommonKVSender.abort: record_failure,
// update_status(room, Failed), conclude_state = Failed) and, on NIXL,
// _send_failed = True. What they do:
//
//   - LeversNewest (default): Mooncake in every release from v0.4.10 to
//     v0.5.18 (abort), NIXL in v0.5.18 (abort and _send_failed).
//     update_status(Failed) overwrites any status of
//     a present room and is a no-op for an absent one; NIXL's poll() reads
//     _send_failed first and never conclude_state; Mooncake and fake senders
//     return conclude_state once set. So abort releases the resurrection and
//     stuck-handle rooms on both backends, the absent (ABORT-before-register)
//     room only through conclude_state on Mooncake and _send_failed on NIXL.
//     server.levers is [abort, _send_failed] on NIXL, [abort] on Mooncake.
//   - LeversNIXLMid2025 (NIXL only): NIXL up to v0.5.11, where poll() reads
//     the transfer handles once sent and SGLang's own abort does not release
//     the room (disaggregation/nixl/conn.py). No _send_failed is read, poll() ignores
//     conclude_state and a max()-only update_status ignores Failed: nothing
//     releases a pin. The plugin lists no lever, says why in lever_note and
//     answers 501 unsupported. A transfer that fails makes poll() raise
//     "KVSender transfer encountered an error." into the scheduler's pass:
//     the server goes down, as in LeversEarly.
//   - LeversEarly: releases before the abort lever (about v0.4.5, older
//     than every release the conformance harness loads): the scheduler's
//     Failed branch raises. The plugin lists no
//     lever and answers 501. Should a poll read Failed anyway (a lever pulled
//     by hand with PullLever, or a transfer that fails by itself) the
//     scheduler process crashes, which takes the whole server down as a
//     restart does (below).
//
// A release frees the request, not the transfer: a room released while its
// chunk is outstanding stays in the listing's orphaned_transfers until the
// chunk settles (a healthy chunk: the end of the chunk in flight; a stuck
// handle: never, until a restart). A room whose queued chunks the worker had
// not taken yet leaves no orphan. The newest NIXL and Mooncake managers
// both report transfer_queue (Mooncake keys its queues by the sum of the
// destination session ports: one port per simulated endpoint, so the same
// queue as NIXL), transfer_in_flight and orphaned_transfers (the common
// manager's _staging_outstanding), with server.transfer_tracking true: a
// transfer_in_flight of false then proves no chunk in flight. Mooncake up
// to v0.5.11 has worker queues but no such count
// (Options.UntrackedTransfers): transfer_in_flight false, no
// orphaned_transfers, server.transfer_tracking false. Mid-2025 NIXL
// has no transfer worker: its scheduler thread posts each chunk of a room
// and poll() reads the room's own handles (disaggregation/nixl/conn.py,
// v0.5.11), so each room is played on its own and a stuck handle holds
// its room alone, none behind it. It reports none of them (transfer_queue and
// server.transfer_queues null, transfer_in_flight false, orphaned_transfers
// empty, server.transfer_tracking false).
//
// # Attention TP (Options.AttnTP)
//
// Read in SGLang v0.5.18: disaggregation/utils.py poll_and_all_reduce and
// poll_and_all_reduce_attn_cp_tp_group, disaggregation/prefill.py
// process_disagg_prefill_inflight_queue and
// handle_inflight_transfer_failure, disaggregation/nixl/conn.py and
// mooncake/conn.py transfer_worker and failure_exception,
// disaggregation/common/conn.py.
//
// With AttnTP N > 1 every (dp, pp) scheduler process stands for a group of
// N attention-TP ranks. Each rank has its own KV manager: its own sender
// for every room, its own transfer workers and queues (same keys, same
// link speed), its own _staging_outstanding and its own orphans. Each
// sends its share of the room's pages to its decode peer on the same plan
// (chunks, timing) as the leader; they differ by their worker state (what
// each queue holds) and by pins: RequestSpec.PinTPRanks puts a pin on
// some ranks only ({1}: a handle hung on the non-leader rank alone). The
// scheduler polls every rank's sender and acts on the MIN over the group
// (Failed < Bootstrapping < WaitingForInput < Transferring < Success):
// the room is Success only once every rank's share landed, and Failed on
// every rank as soon as one rank's poll is, in the same pass. The plugin
// lists the leader's own poll (so a room whose leader finished lists
// Success); a force-fail of such a room pulls the levers while a watched
// rank still has a chunk of it out, as the plugin does (the Success branch
// would wait for that rank for ever). Where no watched rank does, it
// answers 409 transfer_succeeded if every rank is watched, and 409
// group_unwatched (naming the ranks) if one is not; the leader-only view
// answers transfer_succeeded as a round 4 plugin did. A room held by an
// unwatched rank's wedge is ended only by a restart on prefill, and by
// decode's own waiting timeout on decode. The levers (force-fail and
// wedge orders) go to the leader's sender only; the Failed branch then
// runs on every rank, where
// failure_exception() clears the room (request_status, transfer_infos), so
// every worker drops the room's queued chunks, but a chunk a worker holds
// is not recalled: it keeps writing until it settles, and a hung one never
// does. Such a chunk is an orphan of its rank. A client's abort reaches
// every rank (the AbortReq is broadcast).
//
// The plugin (docs/plugin-api.md, round 5) lists transfer_ranks N and
// transfer_ranks_watched: the leader plus every peer it reads, which is
// all but the last Options.TPUnwatched (a peer that stopped publishing);
// 0 where no manager keeps the count (mid-2025 NIXL). A room's
// transfer_in_flight is true when the leader or any watched peer has a
// chunk of it outstanding; a watched peer's orphan is added to the
// leader's entry for the room or listed with no transfer_queue. The
// leader's transfer_workers and wedge orders are the leader's alone; the
// listing also carries each watched peer's transfer workers
// (peer_transfer_workers, "tp<R>-cp0") and each room's chunks queued on
// them (peer_chunks_queued), so the watchdog judges a chunk a peer holds
// by that peer's own worker and link (none where no manager keeps the
// count).
// Options.LeaderOnlyView lists what the watchdog read up to round 4: the
// leader alone, transfer_ranks and transfer_ranks_watched 1, as if it
// were the only writer; it exists to measure that hazard. Decode (below)
// sees a request done only once every rank's share arrived, and any
// rank's chunk outstanding counts as a live write on its pages. With
// AttnTP 1 every figure is the same as without the option.
//
// # KV manager threads (issue 24)
//
// Read in SGLang v0.5.18: disaggregation/mooncake/conn.py,
// disaggregation/nixl/conn.py.
//
// The plugin lists kv_threads (docs/plugin-api.md): on prefill the
// bootstrap thread ("bootstrap_thread") and, where the manager has worker
// queues, one transfer worker ("transfer_worker") per queue; on decode the
// listener of prefill's status frames ("decode_thread") and the heartbeat
// checker ("heartbeat_checker"). None with Options.PreRound4Plugin, nor in
// the parity scene, whose stand-in starts no threads. Every thread is
// alive until KillTransferWorker kills the leader's worker of one queue,
// as an exception it does not handle does: at once if it holds no chunk,
// else as it lets go of the one it holds. It takes no chunk after that:
// the rooms with chunks on its queue (later ones too) wait with nothing
// in flight and are recorded blocked_by_wedge, until a restart, whose
// process starts its threads alive. The bootstrap thread and the decode
// threads do not die here.
//
// # Restarts and crashes
//
// Restart, POST /admin/restart (202) and a crash restart the whole prefill
// server (the decode server is another pod: RestartDecode),
// every DP and PP rank at once, as SGLang's launcher tears the server down
// on SIGQUIT: every request held is lost (Outcome "restarted"; the client
// got an error), and for Options.BootTime (default 30 s of clock time) the
// plugin listeners and /metrics close every connection unanswered and the
// schedulers make no passes. Then each process serves with a new pid, empty
// queues, a loop counter, counters and histograms from 0, no wedge and no
// orphaned transfer. Requests that arrive while it boots (Submit, and the
// built-in traffic, which keeps arriving) are refused: the HTTP server is
// down and the router's connection is refused, so they are never admitted
// and never reach decode; each gets a Record with Outcome
// "refused_booting" (TrySubmit returns ErrRefusedBooting). The server's own
// health checks resume when it serves. POST /admin/restart follows the
// contract: 401 without a configured or a valid token, 403 unless
// Options.AllowRestart, 400 for a bad body, 409 pid_mismatch, 200
// would_restart for a dry run. A prefill process that dies ends its
// transfers: decode's heartbeat then fails its rooms (Decode, below).
//
// # Decode
//
// Read in SGLang v0.5.18: environ.py, disaggregation/decode.py.
//
// The decode server is a separate pod: Options.DecodeDPSize scheduler
// processes (decode ranks, PP 1, attention-TP leader only), its own pids,
// loop counters, /metrics (DecodeMetricsHandler) and plugin listeners
// (DecodePluginHandler; ListenDecode serves them all). Decode endpoint
// Options.DecodePorts[i] belongs to decode rank i % DecodeDPSize. Every
// normal request that arrives at prefill (Submit, Inject, traffic) arrives
// at its endpoint's decode rank at the same moment (the router sends it to
// both); prefill's health checks and warm-ups stay on prefill. Decode's own
// health checks (HealthCheckEvery, round-robin over the decode ranks) and
// SubmitDecodeHealthCheck use the fake receiver: room 0, host 2.2.2.2,
// rid HEALTH_CHECK_<time> (a warm-up: a plain rid); they pass through
// both queues (a pass in each) and succeed, or with stuck never leave the
// transfer queue, and have no Record.
//
// A decode request waits in the prealloc queue (receiver Bootstrapping)
// until prefill's handshake is done; then, in one pass, it gets its KV
// pages, sends its metadata (init_time = the handshake's end) and moves to
// the transfer queue. (SGLang's prefill writes nothing before that metadata;
// the simulator's prefill does not wait for it, so when decode's loop was
// paused or down a request can reach the prealloc queue with every chunk
// delivered: its receiver reads Success and it moves on the same way, and
// never sits in the prealloc queue with a Success poll.) There it reads what the prefill side's senders did:
// progress is the chunks written (summed over prefill's PP stages,
// chunks_expected = chunks per stage x stages), transfer_started from the
// metadata on (the whole transfer queue: SGLang v0.5.18 sets NIXL's
// started_transfer and Mooncake's init_time in send_metadata, after which
// prefill may write at any time), or once a chunk was posted. The receiver's poll is a latched Failed (abort), Success
// once every chunk of every stage arrived, else WaitingForInput: no
// release's decode receiver reads Transferring on either backend (only
// Mooncake's prefill sender does, and the hicache mixin's; v0.4.6 to
// v0.5.18 and upstream main, disaggregation/mooncake/conn.py and
// nixl/conn.py; shown on SGLang's own code by
// e2e/parity_decode_test.go). The waiting timeout (DecodeWaitingTimeout,
// 300 s from init_time) fails WaitingForInput rooms, so both backends time
// out a started incomplete transfer too. On Success the
// request leaves the queues, decodes for 20 ms and frees its pages.
//
// The router sends a request to both servers, waits for both legs and
// returns decode's response: Record.ClientAnswered is the later of the two.
//
// Nothing on a prefill release tells decode: neither the flip nor the Failed
// branch sends KV_STATUS, and a transfer that fails by itself is treated the
// same way (newest NIXL's KV_STATUS after a worker error is not modelled).
// Decode learns of a dead prefill through its heartbeat: HeartbeatDetection
// (5 s x 2 failures) after a prefill restart or crash it fails every room of
// that prefill, in both queues.
//
// A failure in the prealloc queue counts num_bootstrap_failed_reqs_total and
// frees nothing (no pages yet); in the transfer queue it counts
// num_transfer_failed_reqs_total and the client gets a 500. The waiting
// timeout sends ABORT to prefill (LeversNewest); so does the lever.
// Deferred release (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE) does
// not exist in any release up to v0.5.18 (environ.py, disaggregation/decode.py)
// and is off by default in later upstream code, so it is off unless
// Options.DeferredRelease (LeversNewest only); server.deferred_release is
// then null, as the plugin lists a release without it, and a failure frees
// the pages at once, under a live write if prefill still has a chunk of the
// room outstanding. With deferred release on and ABORT sent, the pages and metadata slot are held until prefill's
// ABORT_ACK, which means "this room's transfer has drained": an alive
// prefill process with no chunk of the room outstanding on any stage acks
// at once; one with a healthy chunk in flight acks when it settles; a wedged
// handle or a dead prefill never acks, and after DeferredReleaseTimeout
// (30 s) the pages are freed anyway. The heartbeat's failure sends no ABORT
// and frees at once (a dead prefill writes no more).
//
// The lever (decode force-fail, round 3): 409 health_check, 409
// transfer_succeeded (every chunk arrived), 409 transfer_live (the request
// is in the transfer queue, its transfer started and it is not failed, and
// prefill_stopped was not asserted), already_failed, would_flip, else
// kv_receiver.abort(): Failed latched, ABORT sent, and in the transfer
// queue with deferred release on the room registered as a deferred abort
// (levers ["abort", "deferred_abort"]; ["abort"] in the prealloc queue or
// without deferred release, the default). The next pass fails the request as above. 501
// unsupported in LeversEarly (no lever). LeversNIXLMid2025 keeps the
// lever (its receiver latches abort()'s Failed) but sends no ABORT; both
// keep the timeout and the heartbeat and have no deferred release
// (server.deferred_release is null). Orders are queued,
// applied inline and withdrawn after OrderTimeout as on prefill; a paused
// decode loop (PauseDecodeLoop) answers 503. RestartDecode and POST
// /admin/restart on a decode listener restart the decode server: its
// requests are lost (DecodeEnd "restarted"), it refuses connections and
// makes no passes for BootTime, and requests that arrive meanwhile are
// seen when it is back.
//
// Pages and corruption. Each decode request owns one page slot; a freed
// slot goes to the next request that preallocates (the most recently freed
// first: the worst case of SGLang's allocator). Freeing a request's pages
// while prefill still has a chunk of its room outstanding (a posted chunk
// not settled, on a living prefill) is a corruption hazard: the record gets
// UnsafeFree, DecodeForceFail when a force-fail freed them, DecodeTimeout
// when SGLang's own waiting timeout did (real SGLang does that to the head
// room of a wedged NIXL worker after 300 s; 300 s + 30 s with deferred
// release on). The late write then
// lands: a chunk that settles writes into the slot's owner at that time (a
// free slot is harmless), and a wedged handle's write, which can land at
// any time, lands as soon as the slot has a new owner. The owner's record
// gets CorruptedBy, and Corruptions lists each landing. A prefill restart
// ends the writes. (A chunk that prefill posts only after the free is not
// counted, and the simulator's prefill does not act on decode's ABORT: a
// decode release that did not wait for prefill_stopped after the metadata
// went out is undercounted.) So the pins leave decode as follows: ABORT-before-register
// and the rooms queued behind a wedged worker have no chunk in flight (safe
// once prefill stopped them, but prefill_stopped must be asserted: their
// metadata was sent); the resurrection pin started and has
// every chunk settled (safe, but prefill_stopped must be asserted); the
// stuck handle has a chunk outstanding for ever (unsafe until prefill
// restarts).
//
// Record.DecodeAdmitted (when decode first saw the request: event times,
// not the harness's pass times), DecodeReleased (when its pages were
// freed) and DecodeEnd give the decode slot hold time, e.g. 300 s for a
// request prefill failed on stock SGLang, against an early decode release.
// Decode's gauges are written when a decode batch runs (a request is
// decoding) or by the idle refresh (IdleRefresh); the counters at once.
// Decode never runs out of pages (no admission back-pressure on prefill;
// prefill's own pools are above).
// The parity scene's requests have no decode side.
//
// # Force-fail orders (docs/plugin-api.md, Project clarifications, Round 2)
//
// 401 and 400 are decided at once, then 503 while the server boots; 404,
// 409 room_mismatch and 409 health_check (fake host, room 0 or a
// HEALTH_CHECK rid: health checks and warm-ups, dry runs too) at once
// against the rank's latest observation (the inflight queue as of the last
// pass), then 501 unsupported when the lever era has no lever (so a health
// check answers 409 even there, as the plugin does). Otherwise the
// order is queued. With Start running, the rank's goroutine picks it up at
// the start of its next inflight pass (before polling, so a flipped request
// is released in that same pass); if it has not within OrderTimeout (real
// time), the order is withdrawn atomically and the answer is 503; a
// withdrawn order is never applied. Without Start (Step-driven replay) and
// with the rank not paused, the order is applied inline, exactly as the next
// pass would apply it, and the next Step releases the request; a synchronous
// harness therefore never deadlocks. On a paused rank (PauseLoop) orders
// time out with 503 in both modes. On the scheduler thread the order is
// decided again: not_found, room_mismatch, health_check, then 409
// transfer_succeeded when the room's status is Success at that moment
// (nothing touched), then already_failed (the last poll Failed, or every
// lever already set), then would_flip for a dry run, else the levers are
// pulled (flipped). Every 200 answer carries the levers pulled, already set
// or that would be pulled.
// The loop counter (listing loop.iterations) counts inflight passes: every
// pass with HookRunsWhenEmpty (newest loops), otherwise only passes with a
// non-empty inflight queue (SGLang v0.5.18: disaggregation/prefill.py; SGLang
// plugins/hook_registry.py, v0.5.11 to v0.5.18); orders are only picked up by
// passes that run the hook.
//
// # /metrics
//
// Read in SGLang v0.5.18: observability/metrics_collector.py.
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
// whether a force-fail hit a request that would have completed by itself,
// and on decode when it was admitted and freed, how it left, whether its
// pages were freed under a live transfer and whether another request's late
// write corrupted it), so tests can assert that a watchdog never
// force-failed a progressing request nor freed pages under a live transfer
// (no Record.UnsafeFree and no Corruption with cause DecodeForceFail; SGLang's
// own timeout may cause some on a wedged worker), and
// benchmarks can report decode slot hold times. SetScenario("parity") sets
// up the fixed scene that the Python stand-in reproduces for the
// cross-language test.
package sglangsim
