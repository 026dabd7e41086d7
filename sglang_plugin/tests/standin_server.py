"""Runs the real plugin on a stand-in SGLang prefill scheduler, for cross-language tests.

    python3 sglang_plugin/tests/standin_server.py --port 0 --metrics-port 0 \\
        [--token-file FILE] [--backend nixl|mooncake] [--scenario parity]

The plugin is installed on the stand-in mixin exactly as the .pth loader
installs it on SGLang's, reads its settings from the same environment
variables (set here from the flags), and runs on a stand-in scheduler loop
thread. Port 0 picks a free port. Once both listeners are up, the one line
``READY plugin=<port> metrics=<port>`` goes to stdout (logs go to stderr).
The process exits when stdin closes or on SIGTERM.

Scenario "parity" (fixed and deterministic; sglangsim implements the same):

* Scheduler: dp_rank 0, pp_rank 0, tp_rank 0, attn_tp_rank 0, pp_size 1,
  disaggregation_mode "prefill", transfer_backend = --backend. The loop runs
  a pass every 10 ms. Bootstrap and waiting queues are empty.
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

* Release: like SGLang's inflight pass, a poll of Failed removes the request
  from the queue and adds 1 to sglang:num_transfer_failed_reqs_total; a
  poll of Success would remove it without counting (nothing here succeeds).
  So a force-fail of pinned-0001 is answered "flipped" with lever
  "_send_failed" (nixl) or "conclude_state" (mooncake), and on the next pass
  the room leaves /debug/inflight and the counter goes from 0 to 1.
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

from sglang_watchdog_plugin import hook  # noqa: E402
from tests import standins  # noqa: E402

PASS_INTERVAL_S = 0.01
PROGRESS_PERIOD_S = 0.1


def parity_scenario(backend):
    """Builds the scheduler and the per-pass tick of the "parity" scenario."""
    start = time.perf_counter()
    scheduler = standins.NewScheduler(mode="prefill", backend=backend)
    if backend == "nixl":
        mgr = standins.NewestNixlKVManager()
        pinned = standins.NixlKVSender(mgr, 9223372036854775001, chunk_id=3)
        healthy = standins.NixlKVSender(mgr, 18446744073709551557, chunk_id=0)
        progress_attribute = "chunk_id"
    else:
        mgr = standins.KVManager()
        pinned = standins.MooncakeKVSender(mgr, 9223372036854775001, curr_idx=3)
        healthy = standins.MooncakeKVSender(mgr, 18446744073709551557, curr_idx=0)
        progress_attribute = "curr_idx"
    scheduler.disagg_prefill_inflight_queue = [
        standins.Req("pinned-0001", 9223372036854775001, pinned,
                     host="10.0.0.7", port=8998, prompt_tokens=4096, entered=start - 120),
        standins.Req("healthy-0002", 18446744073709551557, healthy,
                     host="10.0.0.8", port=8998, prompt_tokens=1024, entered=start - 5),
        standins.Req("HEALTH_CHECK_1764403200.0", 0, standins.FakeKVSender(standins.FakeKVManager()),
                     host=standins.FAKE_BOOTSTRAP_HOST, port=None, prompt_tokens=1, entered=start - 200),
    ]

    def tick():
        # The transfer of healthy-0002 keeps moving, on the loop thread like SGLang's send().
        setattr(healthy, progress_attribute, int((time.perf_counter() - start) / PROGRESS_PERIOD_S))

    return scheduler, tick


def metrics_text(scheduler):
    return (
        "# HELP sglang:num_transfer_failed_reqs_total The number of transfer failed requests.\n"
        "# TYPE sglang:num_transfer_failed_reqs_total counter\n"
        f'sglang:num_transfer_failed_reqs_total{{model_name="standin"}} {float(scheduler.num_transfer_failed_reqs)}\n'
        "# HELP sglang:num_prefill_inflight_queue_reqs The number of requests in the prefill inflight queue.\n"
        "# TYPE sglang:num_prefill_inflight_queue_reqs gauge\n"
        "sglang:num_prefill_inflight_queue_reqs"
        '{model_name="standin",engine_type="prefill",tp_rank="0",pp_rank="0"} '
        f"{float(len(scheduler.disagg_prefill_inflight_queue))}\n"
    ).encode()


def serve_metrics(scheduler, port):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            body = metrics_text(scheduler)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--token-file", default="")
    parser.add_argument("--backend", choices=("nixl", "mooncake"), default="nixl")
    parser.add_argument("--scenario", choices=("parity",), default="parity")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    os.environ.update({
        "SGLANG_WATCHDOG_PLUGIN_HOST": "127.0.0.1",
        "SGLANG_WATCHDOG_PLUGIN_PORT": str(args.port),
        "SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE": args.token_file,
        "SGLANG_WATCHDOG_PLUGIN_DISABLE": "",
    })
    hook.install(standins.PrefillMixin)
    scheduler, tick = parity_scenario(args.backend)
    loop = standins.SchedulerLoop(scheduler, interval=PASS_INTERVAL_S, before_pass=tick).start()
    loop.wait_passes(1)
    monitor = hook.monitor_for(scheduler)
    if monitor is None:
        print("the plugin did not start its listener; see the log above", file=sys.stderr)
        return 1
    metrics = serve_metrics(scheduler, args.metrics_port)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def watch_stdin():
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered
        # reader aborts interpreter shutdown after SIGTERM.
        while os.read(0, 4096):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(f"READY plugin={monitor.listener.port} metrics={metrics.server_address[1]}", flush=True)
    while not stop.wait(0.5):
        pass
    loop.stop()
    metrics.shutdown()
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
