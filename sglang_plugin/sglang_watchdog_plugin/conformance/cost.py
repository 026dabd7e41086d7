"""What the plugin adds to SGLang's own prefill inflight pass, with 10, 100 and 1,000 requests queued.

    SGLANG_SRC=DIR /usr/bin/python3 -m sglang_watchdog_plugin.conformance.cost [--backend nixl] [--rooms 10,100,1000]

The pass is the release's own ``process_disagg_prefill_inflight_queue`` over
real senders whose transfers hang (the steady state of a wedge: every room
polled, none leaving). Each figure is the best of several runs of
back-to-back passes, unwrapped and hooked runs alternating so that both see
the same load, in microseconds per pass.
"""

import argparse
import json
import os
import sys
import time

from . import runtime, transports
from . import bench as bench_module

RUNS = 5


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
    assert len(s.disagg_prefill_inflight_queue) == rooms, "a hung room left the queue during the measurement"
    transports.fabric.end_hangs(range(base, base + rooms))
    return best_plain, best_hooked


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=runtime.BACKENDS)
    parser.add_argument("--rooms", default="10,100,1000")
    args = parser.parse_args(argv)
    rt = runtime.Runtime(plugin=False)
    results = []
    for backend in args.backend or list(runtime.BACKENDS):
        for rooms in (int(n) for n in args.rooms.split(",")):
            passes = max(20, 20000 // rooms)
            plain, hooked = measure(rt, backend, rooms, passes)
            results.append({"backend": backend, "rooms": rooms, "unwrapped_us": round(plain, 1),
                            "hooked_us": round(hooked, 1), "added_us": round(hooked - plain, 1)})
            print(f"{backend:9s} {rooms:5d} rooms: unwrapped {plain:9.1f} us  hooked {hooked:9.1f} us  "
                  f"added {hooked - plain:7.1f} us per pass", flush=True)
    print(json.dumps({"sglang": rt.version, "source": runtime.loader.loaded.source, "results": results}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
