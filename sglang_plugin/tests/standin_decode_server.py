"""Runs the real plugin on a stand-in SGLang decode scheduler, for cross-language tests.

    python3 sglang_plugin/tests/standin_decode_server.py --port 0 --metrics-port 0 \\
        [--token-file FILE] [--backend nixl|mooncake] [--deferred-release on|off|absent]
        [--prefill-acks yes|no] [--deferred-timeout SECONDS] [--live-room ROOM] [--allow-restart]

The plugin is installed on the stand-in decode mixin exactly as the .pth
loader installs it on SGLang's ``SchedulerDisaggregationDecodeMixin``, reads
its settings from the same environment variables (set here from the
flags), and runs on a stand-in scheduler loop thread that calls
``process_decode_queue`` every 10 ms. Port 0 picks a free port. Once both
listeners are up, the one line ``READY plugin=<port> metrics=<port>`` goes
to stdout (logs go to stderr). The process exits when stdin closes or on
SIGTERM.

Options:

* ``--backend`` (``nixl``): which receivers the stand-in copies.
  ``nixl``: the newest NIXL receiver (``started_transfer`` once metadata is
  sent, WaitingForInput until every chunk and the aux arrived; the manager's
  per-room transfer status gives ``progress`` and ``chunks_expected``).
  ``mooncake``: Transferring once prefill started writing, never timed out
  there (upstream PR #31800); ``progress`` -1, ``chunks_expected`` null.
* ``--deferred-release`` (``on``): SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE,
  set for the process and held by the KV manager: ``server.deferred_release`` true, false, or
  null (``absent``: a release without the feature). With ``on``, a
  force-fail in the transfer queue answers ``levers ["abort",
  "deferred_abort"]``; otherwise ``["abort"]``.
* ``--prefill-acks`` (``yes``): whether the stand-in prefill peer answers an
  ABORT with ABORT_ACK once it has no chunk of the room in flight. ``no``:
  it never answers (a dead or wedged prefill).
* ``--deferred-timeout`` (30): seconds a deferred release waits for the
  ABORT_ACK before it frees the pages anyway.
* ``--live-room`` (18446744073709551557): the bootstrap_room of
  live-0002. Cross-language tests set it to a room of the prefill
  stand-in's parity scene (pinned-0001's 9223372036854775001), so that a
  prefill watchdog that released that room can answer "stopped" for it.
* ``--live-rid`` (live-0002): the rid of that request. Prefill verdicts
  are bound to the request's rid (a router that gives both legs one rid),
  so cross-language tests give it pinned-0001's rid as well.
* ``--allow-restart``: sets SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=1, as in
  standin_server.py (the SIGQUIT to the parent is logged, not sent).

Scene "decode" (fixed; "start" is when the process starts). Scheduler:
dp_rank 0, pp_rank 0, tp_rank 0, attn_tp_rank 0, pp_size 1,
disaggregation_mode "decode", transfer_backend = --backend, ``levers``
``["abort"]``, ``lever_note`` "". ``inflight`` is [] and ``queues`` has
bootstrap, waiting and inflight 0. ``decode_requests``, in this order:

1. rid "waiting-0001", bootstrap_room 9223372036854775011, bootstrap_addr
   "10.0.0.7:8998", queue "prealloc", poll Bootstrapping for ever (its
   handshake never completes), progress 0 (nixl) or -1 (mooncake),
   chunks_expected null, transfer_started false. No pages, no metadata
   sent: safe to release without ``prefill_stopped``. A force-fail answers
   200 flipped ``["abort"]`` (dry run: would_flip ``["abort"]``); on the
   next pass the request leaves the listing and
   ``sglang:num_bootstrap_failed_reqs_total`` goes from 0 to 1.
2. rid "HEALTH_CHECK_1764403200.0", bootstrap_room 0, bootstrap_addr
   "2.2.2.2", queue "prealloc", the fake receiver (no room of its own),
   poll Bootstrapping, progress -1, transfer_started false, health_check
   true. Every force-fail answers 409 health_check, dry runs included.
3. rid "warmup-0005": as 2, without the rid prefix (a warm-up): health_check
   true, 409 health_check.
4. rid "live-0002", bootstrap_room 18446744073709551557 (above 2^63),
   bootstrap_addr "10.0.0.8:8998", queue "transfer", transfer_started true,
   nixl: poll WaitingForInput, progress 2, chunks_expected null (2 of its 4
   chunks arrived, the third is in flight for ever: a wedged prefill
   handle); mooncake: poll Transferring, progress -1. A force-fail without
   ``"prefill_stopped": true`` answers 409 transfer_live, dry runs too, and
   changes nothing. With it: 200 flipped ``["abort", "deferred_abort"]``
   (``["abort"]`` unless deferred release is on); on the next pass the
   request leaves the listing, the client gets a 500 and
   ``sglang:num_transfer_failed_reqs_total`` goes from 0 to 1; its pages
   stay held (the peer has a chunk in flight, so no ABORT_ACK) until
   --deferred-timeout, or are freed at once without deferred release.
5. rid "healthy-0003", bootstrap_room 9223372036854775019, bootstrap_addr
   "10.0.0.7:8998", queue "transfer", transfer_started true; a chunk lands
   every 100 ms: nixl progress 1, 2, ... 20 (chunks_expected 20 with the
   last), mooncake poll Transferring. After 2 s the transfer completes (poll
   Success) and the request leaves both queues for decoding, without
   counting anything. A force-fail before that answers 409 transfer_live
   (without prefill_stopped).

GET /metrics on the metrics port answers, in SGLang's text format (gauges
show the live queue lengths):

    sglang:num_decode_prealloc_queue_reqs{model_name="standin",engine_type="decode",tp_rank="0",pp_rank="0"} <len>
    sglang:num_decode_transfer_queue_reqs{model_name="standin",engine_type="decode",tp_rank="0",pp_rank="0"} <len>
    sglang:num_bootstrap_failed_reqs_total{model_name="standin"} <count>
    sglang:num_transfer_failed_reqs_total{model_name="standin"} <count>
"""

import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_watchdog_plugin import hook  # noqa: E402
from tests import standins  # noqa: E402
from tests.standin_server import (  # noqa: E402
    log_instead_of_kill,
    plugin_environment,
    serve_metrics,
    standin_parser,
    stop_event,
)

PASS_INTERVAL_S = 0.01
CHUNK_PERIOD_S = 0.1
HEALTHY_CHUNKS = 20

WAITING_ROOM = 9223372036854775011
LIVE_ROOM = 18446744073709551557
HEALTHY_ROOM = 9223372036854775019


def decode_scenario(backend, deferred, acks, deferred_timeout, live_room=LIVE_ROOM, live_rid="live-0002"):
    """Builds the scheduler and the per-pass tick of the "decode" scene."""
    manager = (standins.NixlDecodeKVManager if backend == "nixl" else standins.DecodeKVManager)(deferred)
    scheduler = standins.DecodeScheduler(backend=backend, manager=manager)
    scheduler.disagg_decode_transfer_queue.deferred_kv_release_timeout = deferred_timeout
    peer = standins.PrefillPeer(acks=acks)
    scheduler.add_request("waiting-0001", WAITING_ROOM, host="10.0.0.7", peer=peer, handshake=False)
    scheduler.add_request("HEALTH_CHECK_1764403200.0", 0, host=standins.FAKE_BOOTSTRAP_HOST, port=None,
                          handshake=False)
    scheduler.add_request("warmup-0005", 0, host=standins.FAKE_BOOTSTRAP_HOST, port=None, handshake=False)
    live = scheduler.add_request(live_rid, live_room, host="10.0.0.8", peer=peer)
    healthy = scheduler.add_request("healthy-0003", HEALTHY_ROOM, host="10.0.0.7", peer=peer)
    # One pass before the plugin starts: the handshaken requests get pages and move to the transfer queue.
    standins.DecodeMixin.process_decode_queue.__wrapped__(scheduler)
    peer.writing.add(live_room)  # its third chunk never settles
    if backend == "nixl":
        manager.receive_chunk(live_room, 0)
        manager.receive_chunk(live_room, 1)
    else:
        live.kv_receiver.start_transfer()
        healthy.kv_receiver.start_transfer()
    start = time.perf_counter()
    landed = [0]

    def tick():
        # healthy-0003's chunks land on the loop thread, as SGLang's notifications are read in poll().
        due = min(HEALTHY_CHUNKS, int((time.perf_counter() - start) / CHUNK_PERIOD_S))
        while landed[0] < due:
            chunk = landed[0]
            landed[0] += 1
            if backend == "nixl":
                manager.receive_chunk(HEALTHY_ROOM, chunk, last_of=HEALTHY_CHUNKS if landed[0] == HEALTHY_CHUNKS else None)
                if landed[0] == HEALTHY_CHUNKS:
                    manager.receive_aux(HEALTHY_ROOM)
            elif landed[0] == HEALTHY_CHUNKS and healthy.kv_receiver is not None:
                healthy.kv_receiver.finish_transfer()

    return scheduler, tick


def metrics_text(scheduler):
    labels = '{model_name="standin",engine_type="decode",tp_rank="0",pp_rank="0"}'
    series = (
        ("sglang:num_decode_prealloc_queue_reqs", "gauge", "The number of requests in the decode prealloc queue.",
         labels, len(scheduler.disagg_decode_prealloc_queue.queue)),
        ("sglang:num_decode_transfer_queue_reqs", "gauge", "The number of requests in the decode transfer queue.",
         labels, len(scheduler.disagg_decode_transfer_queue.queue)),
        ("sglang:num_bootstrap_failed_reqs_total", "counter", "The number of bootstrap failed requests.",
         '{model_name="standin"}', scheduler.num_bootstrap_failed_reqs),
        ("sglang:num_transfer_failed_reqs_total", "counter", "The number of transfer failed requests.",
         '{model_name="standin"}', scheduler.num_transfer_failed_reqs),
    )
    return "".join(f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name}{label} {float(value)}\n"
                   for name, kind, text, label, value in series).encode()


def main():
    parser = standin_parser(__doc__)
    parser.add_argument("--deferred-release", choices=("on", "off", "absent"), default="on")
    parser.add_argument("--prefill-acks", choices=("yes", "no"), default="yes")
    parser.add_argument("--deferred-timeout", type=float, default=standins.DEFERRED_RELEASE_TIMEOUT_S)
    parser.add_argument("--live-room", type=int, default=LIVE_ROOM)
    parser.add_argument("--live-rid", default="live-0002")
    args = parser.parse_args()
    if args.deferred_timeout <= 0:
        parser.error("--deferred-timeout must be above 0")
    if not 0 < args.live_room < 2**64 or args.live_room in (WAITING_ROOM, HEALTHY_ROOM):
        parser.error("--live-room must be a room below 2^64, above 0 and not another request's")
    if not args.live_rid or args.live_rid in ("waiting-0001", "healthy-0003", "warmup-0005"):
        parser.error("--live-rid must be a rid, not another request's")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    plugin_environment(args.port, args.token_file, args.allow_restart)
    hook.install(standins.DecodeMixin, hook.DECODE_METHOD)
    deferred = {"on": True, "off": False, "absent": None}[args.deferred_release]
    # The transfer queue reads SGLang's own setting, the manager keeps its flag: both say the same here.
    os.environ["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"] = "1" if deferred else "0"
    scheduler, tick = decode_scenario(args.backend, deferred, args.prefill_acks == "yes", args.deferred_timeout,
                                      args.live_room, args.live_rid)
    loop = standins.SchedulerLoop(scheduler, interval=PASS_INTERVAL_S, before_pass=tick).start()
    loop.wait_passes(1)
    monitor = hook.monitor_for(scheduler)
    if monitor is None:
        print("the plugin did not start its listener; see the log above", file=sys.stderr)
        return 1
    log_instead_of_kill(monitor)
    metrics = serve_metrics(lambda: metrics_text(scheduler), args.metrics_port)
    stop = stop_event()
    print(f"READY plugin={monitor.listener.port} metrics={metrics.server_address[1]}", flush=True)
    while not stop.wait(0.5):
        pass
    loop.stop()
    metrics.shutdown()
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
