"""What the plugin adds to SGLang's own prefill inflight pass, with 10, 100 and 1,000 requests queued.

    SGLANG_SRC=DIR /usr/bin/python3 -m sglang_watchdog_plugin.conformance.cost [--backend nixl] [--rooms 10,100,1000]
    SGLANG_SRC=DIR /usr/bin/python3 -m sglang_watchdog_plugin.conformance.cost --mode decode

The pass is the release's own ``process_disagg_prefill_inflight_queue`` over
real senders whose transfers hang (the steady state of a wedge: every room
polled, none leaving). With ``--mode decode`` it is the release's own
``process_decode_queue`` (the decode monitor's hook) over real receivers in
SGLang's own ``DecodeTransferQueue``, their transfers hanging likewise: every
request is polled by ``pop_transferred`` on every pass, none leaves. Each
figure is the best of several runs of back-to-back passes, unwrapped and
hooked runs alternating so that both see the same load, in microseconds per
pass.
"""

import argparse
import json
import os
import sys
import time

from . import runtime, transports
from . import bench as bench_module

RUNS = 5
LABELS = {"hook_alone_us": "hook alone", "reread_us": "re-read of every request (once per 0.1 s)"}


def per_pass_us(fn, passes):
    start = time.perf_counter()
    for _ in range(passes):
        fn()
    return (time.perf_counter() - start) / passes * 1e6


def measure(rt, backend, rooms, passes):
    from .. import hook

    rt.slots = max(rt.slots, rooms + 8)
    bench = bench_module.Bench(rt, backend)
    s = bench.scheduler
    original = rt.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue
    base = 100000 * (rooms + 1)
    s.disagg_prefill_inflight_queue = [bench.prepare(base + i, transports.HANG) for i in range(rooms)]
    os.environ["SGLANG_WATCHDOG_PLUGIN_PORT"] = "0"
    hook.around_inflight_pass(original, s)  # starts the monitor and its listener, as the first pass does
    plain = lambda: original(s)  # noqa: E731
    hooked = lambda: hook.around_inflight_pass(original, s)  # noqa: E731
    best_plain = best_hooked = float("inf")
    for _ in range(RUNS):
        best_plain = min(best_plain, per_pass_us(plain, passes))
        best_hooked = min(best_hooked, per_pass_us(hooked, passes))
    apart = _plugin_apart(hook.around_inflight_pass, hook.monitor_for(s), s, passes)
    assert len(s.disagg_prefill_inflight_queue) == rooms, "a hung room left the queue during the measurement"
    transports.fabric.end_hangs(range(base, base + rooms))
    return best_plain, best_hooked, apart


def _plugin_apart(around, monitor, s, passes):
    """The plugin's own part, timed apart on the same queue: SGLang's own pass varies by more than the hook costs
    (its polls and the gloo all-reduce share the GIL with the transfer workers, the bootstrap threads and the other
    work on the machine). The hook around an empty pass (its steady state), and one pass that re-reads every
    request, which the monitor does once per 0.1 s (REOBSERVE_INTERVAL_S) and which best of N mostly leaves out of
    the hooked figure."""
    empty = lambda scheduler: None  # noqa: E731

    def reread():
        monitor._next_reobserve = 0.0  # due now, as on the first pass after each 0.1 s
        around(empty, s)

    alone = min(per_pass_us(lambda: around(empty, s), passes) for _ in range(RUNS))
    reread_us = min(per_pass_us(reread, 1) for _ in range(RUNS))
    return {"hook_alone_us": round(alone, 1), "reread_us": round(reread_us, 1)}


def measure_decode(rt, backend, requests, passes):
    """The same measurement on decode: ``requests`` hung requests in SGLang's own decode transfer queue."""
    from .. import hook
    from ..decode_monitor import DecodeMonitor
    from . import decode_bench

    # The KV managers' pages and metadata slots (runtime.manager) and the decode scheduler's metadata allocator
    # and buffers hold 32 to 64 requests by default: sized here so that every request has its own slot.
    rt.slots = max(rt.slots, requests + 8)
    bench = decode_bench.DecodeBench(rt, backend, metadata_slots=requests + 8)
    s = bench.scheduler
    original = rt.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue
    if getattr(original, "__sglang_watchdog_hook__", False):
        # The unwrapped figure would then be a hooked one: the comparison would measure nothing.
        raise SystemExit("process_decode_queue is already hooked by the plugin: the unwrapped pass cannot be measured")
    transfer = s.disagg_decode_transfer_queue
    rooms = []
    for _ in range(requests):
        # Unique rooms across the process (SGLang's managers and the fabric's plans are keyed by room).
        room = next(bench_module._first_rooms)
        decode_req, link = bench.prepare(room, transports.HANG)
        # On this thread, which is the scheduler thread here: no bench loop runs, the passes below are the only ones.
        transfer.extend([decode_req])
        link.send(1)
        rooms.append(room)
    _check_every_request_polled(s, original, requests)
    os.environ.setdefault("SGLANG_WATCHDOG_PLUGIN_HOST", "127.0.0.1")
    os.environ["SGLANG_WATCHDOG_PLUGIN_PORT"] = "0"
    hook.around_decode_pass(original, s)  # starts the decode monitor and its listener, as the first pass does
    monitor = hook.monitor_for(s)
    if not isinstance(monitor, DecodeMonitor):
        # The hook then passes straight through (another mode, disabled, no listener): "hooked" would be unwrapped.
        raise SystemExit(f"the plugin did not hook this decode scheduler (monitor: {monitor!r}); see its log")
    plain = lambda: original(s)  # noqa: E731
    hooked = lambda: hook.around_decode_pass(original, s)  # noqa: E731
    iterations = monitor.iterations
    best_plain = best_hooked = float("inf")
    for _ in range(RUNS):
        best_plain = min(best_plain, per_pass_us(plain, passes))
        best_hooked = min(best_hooked, per_pass_us(hooked, passes))
    if monitor.iterations - iterations != RUNS * passes:
        raise SystemExit(f"the decode monitor saw {monitor.iterations - iterations} of {RUNS * passes} hooked passes")
    apart = _plugin_apart(hook.around_decode_pass, monitor, s, passes)
    listed = len(monitor.snapshot.rooms)
    if listed != requests:
        raise SystemExit(f"the decode monitor lists {listed} requests, {requests} are queued")
    assert len(transfer.queue) == requests, "a hung request left the transfer queue during the measurement"
    assert not s.waiting_queue, "a hung request was handed to the waiting queue during the measurement"
    # The wedge clears (completes) rather than fails: a failed NIXL transfer makes SGLang's transfer worker print a
    # traceback for every room queued behind it, while the next measurement is being set up.
    transports.fabric.end_hangs(rooms, transports.COMPLETE)
    if monitor.listener is not None:
        monitor.listener.close()
    return best_plain, best_hooked, apart


def _check_every_request_polled(s, original, requests):
    """One unwrapped pass with each receiver's poll counted: the measured pass must poll all of them.

    Guards against a pass that returns early (a retracted request left in the prealloc queue, a polling interval
    above 1) and would measure an empty pass. The counters are instance attributes, removed before timing.
    """
    transfer = s.disagg_decode_transfer_queue
    polled = []
    for decode_req in transfer.queue:
        receiver = decode_req.kv_receiver
        receiver.poll = (lambda r, p: lambda: (polled.append(r), p())[1])(receiver, receiver.poll)
    try:
        original(s)
    finally:
        for decode_req in transfer.queue:
            vars(decode_req.kv_receiver).pop("poll", None)
    if len(set(map(id, polled))) != requests or len(transfer.queue) != requests:
        raise SystemExit(f"SGLang's decode pass polled {len(set(map(id, polled)))} of {requests} receivers and "
                         f"left {len(transfer.queue)} queued: the measured pass would not be the steady state")


def main(argv=None):
    global RUNS  # --runs: the measurements read the module's RUNS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=runtime.BACKENDS)
    parser.add_argument("--rooms", default="10,100,1000", help="requests queued, per measurement")
    parser.add_argument("--runs", type=int, default=RUNS, help="alternating runs per figure (the best is kept)")
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill",
                        help="prefill: process_disagg_prefill_inflight_queue; decode: process_decode_queue")
    args = parser.parse_args(argv)
    RUNS = args.runs
    run = measure_decode if args.mode == "decode" else measure
    unit = "requests" if args.mode == "decode" else "rooms"
    rt = runtime.Runtime(plugin=False)
    results = []
    for backend in args.backend or list(runtime.BACKENDS):
        for rooms in (int(n) for n in args.rooms.split(",")):
            passes = max(20, 20000 // rooms)
            plain, hooked, extras = run(rt, backend, rooms, passes)
            results.append({"backend": backend, "rooms": rooms, "unwrapped_us": round(plain, 1),
                            "hooked_us": round(hooked, 1), "added_us": round(hooked - plain, 1), **extras})
            apart = "".join(f"  {LABELS[name]} {value:.1f} us" for name, value in extras.items())
            print(f"{backend:9s} {rooms:5d} {unit}: unwrapped {plain:9.1f} us  hooked {hooked:9.1f} us  "
                  f"added {hooked - plain:7.1f} us per pass{apart}", flush=True)
    summary = {"sglang": rt.version, "source": runtime.loader.loaded.source, "results": results}
    if args.mode != "prefill":  # the prefill output has no mode key, as before
        summary["mode"] = args.mode
    print(json.dumps(summary))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
