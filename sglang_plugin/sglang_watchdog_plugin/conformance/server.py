"""A real-code prefill (or decode) server: SGLang's own queue pass in a loop, the plugin loaded, SGLang's /metrics.

    SGLANG_SRC=DIR python3 -m sglang_watchdog_plugin.conformance.server \\
        --backend nixl|mooncake --port-file FILE [--token-file FILE] [--pass-interval SECONDS] [--mode decode]

One ``Bench`` (bench.py): SGLang's real KV managers and bootstrap server over
the fake transports, and a loop thread running the release's own
``process_disagg_prefill_inflight_queue`` with the plugin loaded as that
release loads it. The plugin serves its own endpoints on its own listener
(127.0.0.1, a free port). A second listener on 127.0.0.1 serves:

* ``GET /metrics``: SGLang's own ``SchedulerMetricsCollector`` (found where
  the release keeps it) on prometheus_client's default registry. It is the
  scheduler's ``metrics_collector``, so SGLang's own Failed branch bumps
  ``sglang:num_transfer_failed_reqs_total`` (releases whose branch does);
  after each pass ``sglang:num_prefill_inflight_queue_reqs`` is set from the
  queue the way the release's scheduler stats do (its ``QueueCount`` where it
  has one, else the length) through the collector's own ``log_stats``. Where
  the collector does not import or construct, or lacks a family, the
  project's minimal equivalent serves it, and the output says so.
* ``POST /scenario/admit`` ``{"room": 7001, "behaviour": "hang"|"complete"|"fail"|"slow:5"|"fail:5", "rid":
  "optional", "chunks": 1}``: admits a request the way SGLang does
  (bootstrapped sender and receiver, the KV sent in ``chunks`` chunks (1 to
  4; the request has 4 pages), the request appended to the inflight queue on
  the scheduler thread); answers ``{"rid", "bootstrap_room",
  "transfer_queue"}`` once the plugin lists it. ``behaviour`` may be a list,
  one per chunk in the order the worker posts them (the last repeats), e.g.
  ``["slow:0.5", "hang"]`` for a long prompt whose second chunk wedges.
* ``POST /scenario/link`` ``{"seconds_per_page": 2.5, "transfer_queue": 0}``:
  the link speed, for one transfer queue or (without ``transfer_queue``)
  every one: each KV chunk then takes its page count times that, on top of
  its behaviour (a link at 1% of a healthy 0.01 s per page: 1.0).
* ``POST /scenario/destination`` ``{"link": "A", "transfer_queue": 1,
  "seconds_per_page": 0.01}``: one more decode destination of the prefill
  rank, named "A" here: SGLang's own decode KV manager (its own NIXL agent,
  or Mooncake session), whose port is chosen so that SGLang's port-sum rule
  puts its rooms on that queue (optional); with its own link speed
  (optional: else its queue's). Answers ``{"link", "key", "port",
  "transfer_queue"}``, ``key`` being the name SGLang's prefill side keys
  the destination by in ``transfer_infos``. ``/scenario/admit`` then takes
  ``"link": "A"`` (the request goes there) and answers the room's
  ``destinations`` as SGLang's ``transfer_infos`` keys them;
  ``/scenario/link`` takes ``"link": "A"`` instead of ``transfer_queue``: that
  destination's speed from its next transfer on (a link that slows down or
  recovers). On a TP2 group (``--attn-tp 2``) each rank sends to its own
  decode peer: ``/scenario/link`` takes ``"rank": 1`` for rank 1's peer, and
  ``/scenario/state`` lists each rank's peer key as ``destinations``.
* ``POST /scenario/end_hang`` ``{"room": 7001, "outcome": "complete"|"fail"}``:
  the room's hung transfers (and those still to come) end that way, so the
  worker that holds them moves on: a wedge that clears.
* ``POST /scenario/abort`` ``{"rid": "..."}``: a client's abort, as
  ``Scheduler.abort_request`` handles it for the inflight queue (the
  sender's ``abort()`` on the scheduler thread).
* ``GET /scenario/state``: passes run, exceptions SGLang's pass raised, the
  rids in the inflight queue, and every request the pass let go with its
  finish reason's class name (``FINISH_ABORT``, ``FINISH_LENGTH``).

With ``--mode decode`` the server is a decode server instead: one
``DecodeBench`` (decode_bench.py), SGLang's own ``process_decode_queue`` in
the loop and the plugin's decode listing. ``/scenario/admit`` then puts a
request in SGLang's decode transfer queue with its pages sent to the bench's
own prefill peer (whose transfer behaves as told: ``hang`` keeps the request
waiting with its transfer started, as behind a pinned prefill), and answers
``{"rid", "bootstrap_room", "queue"}``; ``/scenario/state`` lists the decode
queues' rids as ``queued`` and the requests SGLang's decode pass let go as
``released``. It serves no ``/metrics`` (404): SGLang's prefill queue gauges
have no decode counterpart the watchdog reads.

With ``--attn-tp 2`` the server is a TP2 prefill group instead (tp2.py: two
real prefill managers and their schedulers, the plugin's leader on rank 0,
its publisher on rank 1, a TP2 decode): ``/scenario/admit`` takes
``"rank_behaviour": {"1": "hang"}`` for one rank's share of the room (over
``behaviour``; one chunk, no ``abort``), ``/scenario/state`` reports rank 0
and, under ``"ranks"``, each rank's queue, releases and outstanding chunks
per room (its manager's ``_staging_outstanding``), and
``POST /scenario/stop_publishing`` stops rank 1's publisher, as a wedged or
dead non-leader process would.

Once both listeners are up, the JSON port file is written (atomically):
``{"plugin": port, "metrics": port, "collector": "...", "sglang_version": "...",
"backend": "...", "pid": ...}``. Loopback only. Ends on SIGTERM, SIGINT or
when stdin closes (with ``--exit-on-stdin-close``); it exits hard, as SGLang's
NIXL bootstrap thread never ends.
"""

import argparse
import contextlib
import http.server
import json
import logging
import os
import signal
import sys
import threading

from . import bench as bench_module
from . import decode_bench, loader, runtime, tp2, transports
from . import scheduler as sch

logger = logging.getLogger("sglang_watchdog_plugin.conformance.server")

_COLLECTOR_MODULES = ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector")
_GAUGE = "num_prefill_inflight_queue_reqs"


_TIMED = {"slow:": transports.slow, "fail:": transports.fail_after}


def parse_behaviour(text):
    """One behaviour, or a list of them (one per chunk)."""
    if isinstance(text, list) and text:
        return [parse_behaviour(item) for item in text]
    text = str(text).strip().lower()
    if text in (transports.COMPLETE, transports.HANG, transports.FAIL):
        return text
    for prefix, make in _TIMED.items():
        if text.startswith(prefix):
            seconds = float(text[len(prefix):])
            if seconds >= 0:
                return make(seconds)
    raise ValueError(f"behaviour {text!r}: want complete, hang, fail, slow:SECONDS, fail:SECONDS or a "
                     "non-empty list of those")



class Metrics:
    """SGLang's scheduler metrics collector where it loads, else the project's minimal equivalent."""

    def __init__(self, rt, scheduler):
        self.scheduler = scheduler
        self.notes = []
        self.collector = None
        self.source = "minimal"
        self._stats_type = self._queue_count = None
        self._own_gauge = None
        try:
            import prometheus_client  # noqa: F401  (the loader would otherwise stand in for it)
        except ImportError:
            self.notes.append("prometheus_client is not installed (Debian: python3-prometheus-client)")
        else:
            self._load(rt)
        if self.collector is None:
            self.notes.append("serving the project's minimal equivalent: sglang:num_transfer_failed_reqs_total "
                              "counted by the scheduler's increment_transfer_failed_reqs, "
                              "sglang:num_prefill_inflight_queue_reqs set from the queue length after each pass")
            self.minimal = sch.Metrics()
            scheduler.metrics_collector = self.minimal

    def _load(self, rt):
        module = None
        for name in _COLLECTOR_MODULES:
            try:
                module = loader.load(name)[0]
                break
            except ImportError as e:
                self.notes.append(f"{name} does not import: {e}")
        cls = getattr(module, "SchedulerMetricsCollector", None) if module is not None else None
        if cls is None or isinstance(cls, loader.Placeholder):
            self.notes.append("no SchedulerMetricsCollector in this release")
            return
        # The labels SGLang's scheduler gives its collector (names vary by release; any set is accepted).
        labels = {"model_name": "conformance", "engine_type": "prefill", "tp_rank": 0, "pp_rank": 0,
                  "moe_ep_rank": 0}
        kwargs = sch._accepted(cls, labels=labels, server_args=rt.server_args, enable_lora=False,
                               enable_hierarchical_cache=False, enable_streaming_session=False)
        try:
            with _gauge_modes_of_newer_prometheus_client(self.notes):
                self.collector = cls(**kwargs)
        except Exception as e:
            self.notes.append(f"{module.__name__}.SchedulerMetricsCollector did not construct: {e!r}")
            return
        self.source = f"{module.__name__}.SchedulerMetricsCollector"
        self.scheduler.metrics_collector = self.collector
        self._stats_type = getattr(module, "SchedulerStats", None)
        self._queue_count = getattr(module, "QueueCount", None)
        if not hasattr(self.collector, _GAUGE):
            from prometheus_client import Gauge

            self.notes.append(f"this release's collector has no sglang:{_GAUGE}: the project's gauge serves it")
            self._own_gauge = Gauge(f"sglang:{_GAUGE}", "The number of requests in the prefill inflight queue "
                                    "(project's equivalent: not in this release's collector).", list(labels))
            self._labels = labels
        elif not hasattr(self.collector, "increment_transfer_failed_reqs"):
            self.notes.append("this release's collector has no transfer-failed counter (nor does its Failed branch)")

    def observe(self):
        """After a pass: the inflight gauge from the queue, as the release's scheduler stats set it."""
        queue = list(self.scheduler.disagg_prefill_inflight_queue)
        if self.collector is None:
            return
        if self._own_gauge is not None:
            self._own_gauge.labels(**self._labels).set(len(queue))
            return
        value = self._queue_count.from_reqs(queue) if self._queue_count is not None else len(queue)
        if self._stats_type is not None and not getattr(self, "_log_stats_failed", False):
            stats = self._stats_type()
            setattr(stats, _GAUGE, value)
            try:
                self.collector.log_stats(stats)
                return
            except Exception as e:  # a release whose log_stats wants more of the scheduler than is here
                self._log_stats_failed = True
                self.notes.append(f"log_stats did not run ({e!r}): the gauge is set through the collector's own helper")
                logger.warning(self.notes[-1])
        gauge = getattr(self.collector, _GAUGE)
        helper = getattr(self.collector, "_log_gauge_queue_count", None)
        if self._queue_count is not None and helper is not None:
            helper(gauge, value)
        else:
            gauge.labels(**self.collector.labels).set(getattr(value, "total", value))

    def render(self):
        if self.collector is not None:
            import prometheus_client

            return prometheus_client.generate_latest(prometheus_client.REGISTRY), prometheus_client.CONTENT_TYPE_LATEST
        labels = 'model_name="conformance",engine_type="prefill",tp_rank="0",pp_rank="0"'
        text = ("# HELP sglang:num_transfer_failed_reqs_total The number of transfer failed requests.\n"
                "# TYPE sglang:num_transfer_failed_reqs_total counter\n"
                f"sglang:num_transfer_failed_reqs_total{{{labels}}} {float(self.minimal.transfer_failed_reqs)}\n"
                f"# HELP sglang:{_GAUGE} The number of requests in the prefill inflight queue.\n"
                f"# TYPE sglang:{_GAUGE} gauge\n"
                f"sglang:{_GAUGE}{{{labels}}} {float(len(self.scheduler.disagg_prefill_inflight_queue))}\n")
        return text.encode(), "text/plain; version=0.0.4; charset=utf-8"


@contextlib.contextmanager
def _gauge_modes_of_newer_prometheus_client(notes):
    """Lets a too-old prometheus_client accept the gauge modes SGLang's collector names, while it is built.

    SGLang's collectors create gauges with ``multiprocess_mode="mostrecent"``
    (prometheus_client 0.17 and later); Debian 12 ships 0.16, which refuses
    the name. The mode only chooses how several processes' files are merged
    under PROMETHEUS_MULTIPROC_DIR; this server is one process without it,
    where every mode exposes the same value. So, only where the installed
    library lacks the mode and no multiprocess directory is set, such a gauge
    is created with mode "all" instead, and the output says so.
    """
    import prometheus_client
    from prometheus_client import metrics

    modes = getattr(metrics.Gauge, "_MULTIPROC_MODES", None)
    if modes is None or "mostrecent" in modes or os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    original = metrics.Gauge
    mapped = set()

    class Gauge(original):
        def __init__(self, *args, multiprocess_mode="all", **kwargs):
            if multiprocess_mode not in modes:
                mapped.add(multiprocess_mode)
                multiprocess_mode = "all"
            super().__init__(*args, multiprocess_mode=multiprocess_mode, **kwargs)

    prometheus_client.Gauge = metrics.Gauge = Gauge
    try:
        yield
    finally:
        prometheus_client.Gauge = metrics.Gauge = original
        if mapped:
            notes.append(f"prometheus_client {_version('prometheus_client')} lacks the gauge modes "
                         f"{sorted(mapped)} SGLang's collector names (newer releases have them); single process, "
                         "no PROMETHEUS_MULTIPROC_DIR: created with mode 'all', which exposes the same values")


def _version(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "?"


class Server:
    def __init__(self, rt, backend, pass_interval, mode="prefill", attn_tp=1):
        self.rt = rt
        self.mode = mode
        self.metrics = None
        self.group = None
        if mode == "decode":
            self.bench = decode_bench.DecodeBench(rt, backend, pass_interval=pass_interval)
        else:
            self.group = tp2.Tp2Group(rt, backend, pass_interval=pass_interval) if attn_tp == 2 else None
            self.bench = self.group or bench_module.Bench(rt, backend, pass_interval=pass_interval)
            self.metrics = Metrics(rt, self.bench.scheduler)
            self.bench.after_pass.append(self.metrics.observe)
        self.admit_lock = threading.Lock()  # one admission at a time, as one scheduler thread admits

    def admit(self, body):
        room = body.get("room")
        if not isinstance(room, int) or isinstance(room, bool) or room <= 0:
            raise ValueError("room must be a positive integer")
        behaviour = parse_behaviour(body.get("behaviour", transports.COMPLETE))
        rid = body.get("rid")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError("rid must be a non-empty string")
        chunks = body.get("chunks", 1)
        if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= 4:
            raise ValueError("chunks must be an integer from 1 to 4 (a request has 4 KV pages)")
        if self.group is not None:
            return self._admit_group(room, behaviour, rid, body)
        link = body.get("link")
        if link is not None and (self.mode == "decode" or not isinstance(link, str) or not link):
            raise ValueError("link must be the non-empty name of a destination (prefill only)")
        with self.admit_lock:
            if link is None:
                req = self.bench.admit(room, behaviour, chunks=chunks, rid=rid)
            else:
                req = self.bench.admit(room, behaviour, chunks=chunks, rid=rid, link=link)
        logger.info("admitted %s (room %d, %s, %d chunks, link %s)", req.rid, room, body.get("behaviour", "complete"),
                    chunks, link)
        if self.mode == "decode":
            return {"rid": req.rid, "bootstrap_room": req.bootstrap_room, "queue": self.bench.queue_of(req.rid)}
        return {"rid": req.rid, "bootstrap_room": req.bootstrap_room,
                "transfer_queue": self.bench.links[req.rid].queue, "destinations": self.bench.links[req.rid].destinations}

    def destination(self, body):
        if self.mode == "decode" or self.group is not None:
            raise ValueError("destinations are added to a TP1 prefill server (a TP2 rank sends to its own peer)")
        name = body.get("link")
        if not isinstance(name, str) or not name:
            raise ValueError("link must be a non-empty name")
        queue = body.get("transfer_queue")
        if queue is not None and (not isinstance(queue, int) or isinstance(queue, bool)):
            raise ValueError("transfer_queue must be an integer, or absent")
        seconds = _seconds_per_page(body, required=False)
        with self.admit_lock:
            dest = self.bench.destination(name, queue, seconds)
        logger.info("destination %s: %s, port %d", name, dest.key, dest.port)
        count = len(getattr(self.bench.prefill_mgr, "transfer_queues", None) or ())
        return {"link": name, "key": dest.key, "port": dest.port,
                "transfer_queue": dest.port % count if count else None}

    def _admit_group(self, room, behaviour, rid, body):
        per_rank = body.get("rank_behaviour") or {}
        if not isinstance(per_rank, dict):
            raise ValueError("rank_behaviour must be an object: rank -> behaviour")
        plans = {}
        for rank, text in per_rank.items():
            if not str(rank).isdigit() or int(rank) >= self.group.size:
                raise ValueError(f"rank_behaviour: no rank {rank} in a group of {self.group.size}")
            plans[int(rank)] = parse_behaviour(text)
        with self.admit_lock:
            reqs = self.group.admit(room, behaviour, per_rank=plans, rid=rid)
        logger.info("admitted %s on %d ranks (room %d, %s, per rank %s)", reqs[0].rid, len(reqs), room,
                    body.get("behaviour", "complete"), per_rank)
        return {"rid": reqs[0].rid, "bootstrap_room": room, "transfer_queue": None}

    def stop_publishing(self, body):
        if self.group is None:
            raise ValueError("not a TP group (--attn-tp 2)")
        self.group.publisher.stop()
        return {"stopped": self.group.publisher.path}

    def link(self, body):
        seconds = _seconds_per_page(body, required=True)
        if "link" in body:
            if self.group is not None:
                raise ValueError("a TP2 group's links are its ranks' peers: name one by rank")
            self.bench.destination_speed(body["link"], seconds)
            return {"seconds_per_page": seconds, "link": body["link"]}
        if "rank" in body:
            rank = body["rank"]
            if self.group is None or not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.group.size:
                raise ValueError("rank must name a rank of a TP group (--attn-tp 2)")
            transports.fabric.destination_speed(self.group.destinations[rank], seconds)
            return {"seconds_per_page": seconds, "rank": rank}
        queue = body.get("transfer_queue")
        if queue is not None and (not isinstance(queue, int) or isinstance(queue, bool) or queue < 0):
            raise ValueError("transfer_queue must be an integer >= 0, or absent for every queue")
        transports.fabric.link_speed(seconds, queue)
        return {"seconds_per_page": seconds, "transfer_queue": queue}

    def end_hang(self, body):
        room = body.get("room")
        if not isinstance(room, int) or isinstance(room, bool) or room <= 0:
            raise ValueError("room must be a positive integer")
        outcome = body.get("outcome", "complete")
        if outcome not in (transports.COMPLETE, transports.FAIL):
            raise ValueError("outcome must be complete or fail")
        transports.fabric.end_hangs([room], outcome)
        return {"room": room, "outcome": outcome}

    def abort(self, body):
        if self.group is not None:
            raise ValueError("a client's abort is not played on a TP group here")
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise ValueError("rid must be a non-empty string")
        self.bench.abort(rid)
        return {"rid": rid}

    def state(self):
        s = self.bench.scheduler
        released = [{"rid": r.rid, "finished_reason": type(r.finished_reason).__name__} for r in list(s.streamed)]
        if self.mode == "decode":
            queued = [d.req.rid for q in (s.disagg_decode_prealloc_queue, s.disagg_decode_transfer_queue)
                      for d in list(q.queue)]
        else:
            queued = [r.rid for r in list(s.disagg_prefill_inflight_queue)]
        return {
            "passes": self.bench.passes,
            "errors": [repr(e) for e in self.bench.errors],
            "queued": queued,
            "released": released,
            "collector": self.metrics.source if self.metrics is not None else None,
            "notes": self.metrics.notes if self.metrics is not None else [],
            "ranks": None if self.group is None else [_rank_state(s, m) for s, m in zip(
                self.group.schedulers, self.group.prefill_mgrs)],
            "destinations": None if self.group is None else list(self.group.destinations),
        }

    def handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):
                logger.debug("control: " + fmt, *args)

            def _send(self, status, body, content_type="application/json"):
                if not isinstance(body, bytes):
                    body = (json.dumps(body) + "\n").encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/metrics" and server.metrics is not None:
                    self._send(200, *server.metrics.render())
                elif path == "/scenario/state":
                    self._send(200, server.state())
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(min(length, 65536))
                action = {"/scenario/admit": server.admit, "/scenario/link": server.link,
                          "/scenario/destination": server.destination,
                          "/scenario/end_hang": server.end_hang, "/scenario/abort": server.abort,
                          "/scenario/stop_publishing": server.stop_publishing}.get(self.path.split("?", 1)[0])
                if action is None:
                    self._send(404, {"error": "not found"})
                    return
                try:
                    body = json.loads(raw or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError("body must be a JSON object")
                    self._send(200, action(body))
                except (ValueError, TypeError) as e:
                    self._send(400, {"error": str(e)})
                except Exception as e:
                    logger.exception("%s failed", self.path)
                    self._send(500, {"error": repr(e)})

        return Handler


def _seconds_per_page(body, required):
    seconds = body.get("seconds_per_page")
    if seconds is None and not required:
        return None
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
        raise ValueError("seconds_per_page must be a number >= 0")
    return float(seconds)


def _rank_state(scheduler, manager):
    counts = getattr(manager, "_staging_outstanding", None)
    return {
        "queued": [r.rid for r in list(scheduler.disagg_prefill_inflight_queue)],
        "released": [{"rid": r.rid, "finished_reason": type(r.finished_reason).__name__}
                     for r in list(scheduler.streamed)],
        "outstanding": None if counts is None else {str(room): n for room, n in list(counts.items()) if n > 0},
    }


def _write_port_file(path, content):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(content, f)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m sglang_watchdog_plugin.conformance.server",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backend", choices=runtime.BACKENDS, default="nixl")
    parser.add_argument("--port-file", required=True, help="JSON file written once both listeners are up")
    parser.add_argument("--token-file", default="", help="the plugin's token (SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE)")
    parser.add_argument("--pass-interval", type=float, default=0.005, help="seconds between two passes")
    parser.add_argument("--exit-on-stdin-close", action="store_true")
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill",
                        help="which of SGLang's PD schedulers to run (default prefill)")
    parser.add_argument("--attn-tp", type=int, choices=(1, 2), default=1,
                        help="2: a TP2 prefill group, both ranks in this process (tp2.py); prefill only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.token_file:
        os.environ["SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE"] = os.path.abspath(args.token_file)
    os.environ["SGLANG_WATCHDOG_PLUGIN_HOST"] = "127.0.0.1"

    rt = runtime.Runtime()
    if args.mode == "decode" and args.attn_tp != 1:
        parser.error("--attn-tp 2 is a prefill group: not with --mode decode")
    server = Server(rt, args.backend, args.pass_interval, args.mode, attn_tp=args.attn_tp)
    source = server.metrics.source if server.metrics is not None else "none (decode)"
    notes = server.metrics.notes if server.metrics is not None else []
    print(f"real-code server: SGLang {rt.version}, {args.mode}, backend {args.backend}, metrics from {source}",
          file=sys.stderr, flush=True)
    for note in notes:
        print(f"real-code server: metrics: {note}", file=sys.stderr, flush=True)
    server.bench.start()
    control = http.server.ThreadingHTTPServer(("127.0.0.1", 0), server.handler())
    control.daemon_threads = True
    threading.Thread(target=control.serve_forever, name="control", daemon=True).start()

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    if args.exit_on_stdin_close:
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), name="stdin", daemon=True).start()

    _write_port_file(args.port_file, {
        "plugin": server.bench.monitor.listener.port, "metrics": control.server_address[1],
        "collector": source, "metrics_notes": notes, "mode": args.mode,
        "sglang_version": rt.version, "backend": args.backend, "pid": os.getpid(),
    })
    print(f"READY plugin={server.bench.monitor.listener.port} metrics={control.server_address[1]}", flush=True)
    done.wait()
    code = 1 if server.bench.errors else 0
    for e in server.bench.errors:
        print(f"real-code server: SGLang's pass raised {e!r}", file=sys.stderr)
    control.shutdown()
    server.bench.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
