"""Runs the real plugin on a stand-in SGLang prefill scheduler, for cross-language tests.

    python3 sglang_plugin/tests/standin_server.py --port 0 --metrics-port 0 \\
        [--token-file FILE] [--backend nixl|mooncake] [--scenario parity|wedge]
        [--era newest|mid2025|early] [--pp-size 1|2] [--allow-restart]

The plugin is installed on the stand-in mixin exactly as the .pth loader
installs it on SGLang's, reads its settings from the same environment
variables (set here from the flags), and runs on a stand-in scheduler loop
thread. Port 0 picks a free port. Once both listeners are up, the one line
``READY plugin=<port> metrics=<port>`` goes to stdout (logs go to stderr).
The process exits when stdin closes or on SIGTERM.

Options (all default to the scene described below):

* ``--era``: which SGLang the stand-in copies (``newest``: v0.5.18,
  ``mid2025``: v0.4.10, ``early``: v0.4.6).
  ``newest`` (default): the newest scheduler and senders; levers
  ``["abort", "_send_failed"]`` on nixl, ``["abort"]`` on mooncake.
  ``mid2025``: nixl only; the mid-2025 NIXL sender (no ``_send_failed``,
  poll() ignores conclude_state) and manager (max()-only update_status, no
  transfer queues), v0.4/v0.5 scheduler layout. ``server.levers`` is ``[]``
  with a ``lever_note`` naming update_status and conclude_state; every
  force-fail of a listed non-health-check rid answers ``501 unsupported``
  and changes nothing; ``transfer_queues`` is null, every room has
  ``transfer_in_flight`` false and ``transfer_queue`` null;
  ``transfer_tracking`` false (the manager counts nothing).
  ``early``: the earliest scheduler, whose Failed branch raises, with the
  backend's newest senders. ``server.levers`` is ``[]`` with a note saying
  the Failed branch raises; force-fails answer ``501 unsupported``.
* ``--pp-size 2``: two PP stages of dp_rank 0, one scheduler loop and one
  listener each: pp_rank 0 on ``--port`` and pp_rank 1 on ``--port`` + 1
  (with ``--port 0`` a free pair is picked). Both list the same four
  requests (same rids and rooms, each stage with its own senders). A
  request leaves a stage's queue only once **both** stages poll it
  terminal: a force-fail on one stage answers "flipped" and releases
  nothing until the other stage is force-failed too. The READY line names
  the first port and ends with `` pp_size=2``. /metrics shows both stages'
  series, each with its ``pp_rank`` label (the counter too).
* ``--allow-restart``: sets SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=1. A real
  POST /admin/restart (token required) then answers 202 and ends this
  process with exit status 1. The SIGQUIT that the plugin sends to SGLang's
  launcher is logged and not sent: this process's parent is the test runner.
* ``--scenario wedge``: the parity scene, except that pinned-0001 has one
  chunk outstanding in its transfer worker for ever (a handle that never
  completes): ``transfer_in_flight`` true, and once the request is released
  ``orphaned_transfers`` lists ``{"bootstrap_room": 9223372036854775001,
  "transfer_queue": 2, "outstanding_chunks": 1}`` (newest era only).

Scenario "parity" (fixed and deterministic; sglangsim implements the same):

* Scheduler: dp_rank 0, pp_rank 0, tp_rank 0, attn_tp_rank 0, pp_size 1,
  disaggregation_mode "prefill", transfer_backend = --backend. The loop runs
  a pass every 10 ms. Bootstrap and waiting queues are empty.
* Round 2 fields: ``server.levers`` ``["abort", "_send_failed"]`` (nixl) or
  ``["abort"]`` (mooncake), ``lever_note`` "", ``pp_size`` 1,
  ``transfer_queues`` 4, ``transfer_tracking`` true (both managers count
  each room's outstanding chunks, ``_staging_outstanding``; also on
  ``--era early``); ``orphaned_transfers`` []. ``transfer_in_flight``
  is true for healthy-0002 (a chunk of its transfer is always outstanding)
  and false for the others; ``transfer_queue`` 2 for pinned-0001 (one
  destination, decode port 17002), 1 for healthy-0002 (port 17001), null for
  the health check and the warm-up. A force-fail answer's ``levers`` is the
  server's list.
* Inflight queue, in this order ("start" is when the process starts):

  1. rid "pinned-0001", bootstrap_room 9223372036854775001, bootstrap_host
     "10.0.0.7", bootstrap_port 8998 (bootstrap_addr "10.0.0.7:8998"),
     4096 prompt tokens, poll Transferring, progress 3 forever (NIXL
     chunk_id / Mooncake curr_idx), entered 120 s before start.
  2. rid "healthy-0002", bootstrap_room 18446744073709551557 (above 2^63),
     bootstrap_host "10.0.0.8", bootstrap_port 8998, 1024 prompt tokens,
     poll Transferring, progress = whole 100 ms periods since start (0, 1,
     2, ...; it never finishes), entered 5 s before start.
  3. rid "HEALTH_CHECK_1764403200.0", bootstrap_room 0, bootstrap_host
     "2.2.2.2" (SGLang's fake host) with no port (bootstrap_addr "2.2.2.2"),
     1 prompt token, a fake sender that never sent: poll WaitingForInput,
     progress -1, health_check true, entered 200 s before start.
  4. rid "5f1e0c2a9b7d4e3f8a6b1c0d2e4f6a8b", a warm-up request (SGLang's
     server warm-up: fake host and room 0, a plain rid without the
     HEALTH_CHECK prefix), otherwise like the health check, entered 150 s
     before start.

* Release: like SGLang's inflight pass, a poll of Failed removes the request
  from the queue and adds 1 to sglang:num_transfer_failed_reqs_total; a
  poll of Success would remove it without counting (nothing here succeeds).
  So a force-fail of pinned-0001 is answered "flipped" with lever
  "_send_failed" (nixl) or "conclude_state" (mooncake), and on the next pass
  the room leaves /debug/inflight and the counter goes from 0 to 1. A
  force-fail of the health check or the warm-up answers ``409 health_check``.
* GET /metrics on the metrics port answers, in SGLang's text format:

      sglang:num_transfer_failed_reqs_total{model_name="standin"} <failed>
      sglang:num_prefill_inflight_queue_reqs{model_name="standin",engine_type="prefill",tp_rank="0",pp_rank="0"} <len>

  The gauge shows the live queue length (real SGLang only rewrites it when
  it logs a batch).
"""

import argparse
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_watchdog_plugin import hook, process_tree  # noqa: E402
from tests import standins  # noqa: E402

PASS_INTERVAL_S = 0.01
PROGRESS_PERIOD_S = 0.1


PINNED_ROOM = 9223372036854775001
HEALTHY_ROOM = 18446744073709551557
WARMUP_RID = "5f1e0c2a9b7d4e3f8a6b1c0d2e4f6a8b"


def parity_scenario(backend, era="newest", scheduler=None, wedge=False):
    """Builds the scheduler and the per-pass tick of the "parity" scene (or the given scheduler's queue)."""
    start = time.perf_counter()
    if era == "mid2025":
        scheduler = scheduler or standins.OldScheduler(backend=backend, dp_rank=0)
        mgr = standins.Mid2025NixlKVManager()
        pinned = standins.Mid2025NixlKVSender(mgr, PINNED_ROOM, chunk_id=3)
        healthy = standins.Mid2025NixlKVSender(mgr, HEALTHY_ROOM, chunk_id=0)
        progress_attribute = "chunk_id"
    else:
        if scheduler is None:
            scheduler = (standins.EarlyScheduler(backend=backend, dp_rank=0) if era == "early"
                         else standins.NewScheduler(mode="prefill", backend=backend))
        if backend == "nixl":
            mgr = standins.NewestNixlKVManager()
            pinned = standins.NixlKVSender(mgr, PINNED_ROOM, chunk_id=3, dst_ports=(17002,))
            healthy = standins.NixlKVSender(mgr, HEALTHY_ROOM, chunk_id=0, dst_ports=(17001,))
            progress_attribute = "chunk_id"
        else:
            mgr = standins.KVManager()
            pinned = standins.MooncakeKVSender(mgr, PINNED_ROOM, curr_idx=3, dst_ports=(17002,))
            healthy = standins.MooncakeKVSender(mgr, HEALTHY_ROOM, curr_idx=0, dst_ports=(17001,))
            progress_attribute = "curr_idx"
        scheduler.disagg_prefill_bootstrap_queue.kv_manager = mgr
        # healthy-0002's transfer is under way: a chunk of it is always in flight.
        mgr.add_transfer_request(HEALTHY_ROOM)
        if wedge:
            mgr.add_transfer_request(PINNED_ROOM, is_last=True)  # never settled
    scheduler.disagg_prefill_inflight_queue = [
        standins.Req("pinned-0001", PINNED_ROOM, pinned,
                     host="10.0.0.7", port=8998, prompt_tokens=4096, entered=start - 120),
        standins.Req("healthy-0002", HEALTHY_ROOM, healthy,
                     host="10.0.0.8", port=8998, prompt_tokens=1024, entered=start - 5),
        standins.Req("HEALTH_CHECK_1764403200.0", 0, standins.FakeKVSender(standins.FakeKVManager()),
                     host=standins.FAKE_BOOTSTRAP_HOST, port=None, prompt_tokens=1, entered=start - 200),
        standins.Req(WARMUP_RID, 0, standins.FakeKVSender(standins.FakeKVManager()),
                     host=standins.FAKE_BOOTSTRAP_HOST, port=None, prompt_tokens=1, entered=start - 150),
    ]

    def tick():
        # The transfer of healthy-0002 keeps moving, on the loop thread like SGLang's send().
        setattr(healthy, progress_attribute, int((time.perf_counter() - start) / PROGRESS_PERIOD_S))

    return scheduler, tick


def pp_scenario(backend):
    """Two PP stages of dp_rank 0 listing the parity requests, releasing them by consensus."""
    group = standins.PPGroup(2)
    return [parity_scenario(backend, scheduler=standins.PPStageScheduler(group, pp_rank, backend=backend))
            for pp_rank in (0, 1)]


def metrics_text(schedulers):
    if len(schedulers) == 1:
        scheduler = schedulers[0]
        failed = f'sglang:num_transfer_failed_reqs_total{{model_name="standin"}} {float(scheduler.num_transfer_failed_reqs)}\n'
        gauge = ("sglang:num_prefill_inflight_queue_reqs"
                 '{model_name="standin",engine_type="prefill",tp_rank="0",pp_rank="0"} '
                 f"{float(len(scheduler.disagg_prefill_inflight_queue))}\n")
    else:
        failed = "".join(
            f'sglang:num_transfer_failed_reqs_total{{model_name="standin",pp_rank="{i}"}} '
            f"{float(s.num_transfer_failed_reqs)}\n" for i, s in enumerate(schedulers))
        gauge = "".join(
            "sglang:num_prefill_inflight_queue_reqs"
            f'{{model_name="standin",engine_type="prefill",tp_rank="0",pp_rank="{i}"}} '
            f"{float(len(s.disagg_prefill_inflight_queue))}\n" for i, s in enumerate(schedulers))
    return (
        "# HELP sglang:num_transfer_failed_reqs_total The number of transfer failed requests.\n"
        "# TYPE sglang:num_transfer_failed_reqs_total counter\n"
        + failed
        + "# HELP sglang:num_prefill_inflight_queue_reqs The number of requests in the prefill inflight queue.\n"
        "# TYPE sglang:num_prefill_inflight_queue_reqs gauge\n"
        + gauge
    ).encode()


def serve_metrics(render, port):
    """Serves render() (exposition bytes) on /metrics of 127.0.0.1:port from a daemon thread."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            body = render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def standin_parser(doc):
    """The flags every stand-in server takes; the caller adds its scene's own."""
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--token-file", default="")
    parser.add_argument("--backend", choices=("nixl", "mooncake"), default="nixl")
    parser.add_argument("--allow-restart", action="store_true")
    return parser


def plugin_environment(port, token_file, allow_restart):
    """Sets the plugin's settings from the flags, as an operator would in SGLang's environment."""
    os.environ.update({
        "SGLANG_WATCHDOG_PLUGIN_HOST": "127.0.0.1",
        "SGLANG_WATCHDOG_PLUGIN_PORT": str(port),
        "SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE": token_file,
        "SGLANG_WATCHDOG_PLUGIN_DISABLE": "",
        "SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART": "1" if allow_restart else "",
    })


def log_instead_of_kill(monitor):
    monitor.kill = lambda pid, sig: logging.getLogger("standin").info(
        "not sending signal %d to parent %d: it is the test runner, not SGLang's launcher", sig, pid)
    # The test runner above this stand-in is no SGLang launcher: stand in for the one a real scheduler has.
    monitor.find_restart_target = lambda: process_tree.Target(
        os.getppid(), signal.SIGQUIT, "the test runner (standing in for SGLang's launcher)", [os.getpid(), os.getppid()])


def stop_event():
    """An event set on SIGTERM or when stdin closes."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def watch_stdin():
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered
        # reader aborts interpreter shutdown after SIGTERM.
        while os.read(0, 4096):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    return stop


def main():
    parser = standin_parser(__doc__)
    parser.add_argument("--scenario", choices=("parity", "wedge"), default="parity")
    parser.add_argument("--era", choices=("newest", "mid2025", "early"), default="newest")
    parser.add_argument("--pp-size", type=int, choices=(1, 2), default=1)
    args = parser.parse_args()
    if args.era == "mid2025" and args.backend != "nixl":
        parser.error("--era mid2025 copies mid-2025 NIXL: use --backend nixl")
    if args.era != "newest" and (args.pp_size != 1 or args.scenario != "parity"):
        parser.error("--era mid2025 and early serve the parity scene with --pp-size 1 only")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    base_port = args.port
    if args.pp_size == 2 and base_port == 0:
        base_port = free_port_pair()
    plugin_environment(base_port, args.token_file, args.allow_restart)
    for mixin in (standins.PrefillMixin, standins.OldPrefillMixin, standins.EarlyPrefillMixin):
        hook.install(mixin)
    if args.pp_size == 2:
        scenes = pp_scenario(args.backend)
    else:
        scenes = [parity_scenario(args.backend, args.era, wedge=args.scenario == "wedge")]
    loops = [standins.SchedulerLoop(scheduler, interval=PASS_INTERVAL_S, before_pass=tick).start()
             for scheduler, tick in scenes]
    for loop in loops:
        loop.wait_passes(1)
    monitors = [hook.monitor_for(scheduler) for scheduler, _ in scenes]
    if any(monitor is None for monitor in monitors):
        print("the plugin did not start its listener; see the log above", file=sys.stderr)
        return 1
    for monitor in monitors:
        log_instead_of_kill(monitor)
    schedulers = [scheduler for scheduler, _ in scenes]
    metrics = serve_metrics(lambda: metrics_text(schedulers), args.metrics_port)
    stop = stop_event()
    suffix = f" pp_size={args.pp_size}" if args.pp_size > 1 else ""
    print(f"READY plugin={monitors[0].listener.port} metrics={metrics.server_address[1]}{suffix}", flush=True)
    while not stop.wait(0.5):
        pass
    for loop in loops:
        loop.stop()
    metrics.shutdown()
    for monitor in monitors:
        monitor.close()
    return 0


def free_port_pair():
    """A port p such that p and p+1 are free on 127.0.0.1 right now."""
    import socket

    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + 1 > 65535:
            continue
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no pair of free ports found")


if __name__ == "__main__":
    sys.exit(main())
