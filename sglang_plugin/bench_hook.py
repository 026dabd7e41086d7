"""Measures what the hook adds to one inflight pass, with 100 inflight rooms.

    python3 sglang_plugin/bench_hook.py

The pass is the stand-in of SGLang's (tests/standins.py): it polls 100 NIXL
senders that stay in Transferring. Each figure is the best of several runs
of many back-to-back passes, in microseconds per pass; the runs of the
unwrapped and the hooked pass alternate, so that both see the same load.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.update({"SGLANG_WATCHDOG_PLUGIN_HOST": "127.0.0.1", "SGLANG_WATCHDOG_PLUGIN_PORT": "0"})

from sglang_watchdog_plugin import hook  # noqa: E402
from sglang_watchdog_plugin.monitor import REOBSERVE_INTERVAL_S  # noqa: E402
from tests import standins  # noqa: E402

ROOMS = 100
PASSES = 20000
RUNS = 7
TARGET_US = 20.0


def scheduler_with_rooms(count):
    s = standins.NewScheduler(backend="nixl")
    mgr = standins.NewestNixlKVManager()
    s.disagg_prefill_inflight_queue = [
        standins.Req(f"rid-{i:04d}", 2**63 + i, standins.NixlKVSender(mgr, 2**63 + i, chunk_id=i % 7))
        for i in range(count)
    ]
    return s


def per_pass_us(run_pass):
    return compare(run_pass)[0]


def compare(*run_passes):
    """Best per-pass time of each, with their runs interleaved so that all see the same machine load."""
    best = [float("inf")] * len(run_passes)
    for _ in range(RUNS):
        for i, run_pass in enumerate(run_passes):
            start = time.perf_counter()
            for _ in range(PASSES):
                run_pass()
            best[i] = min(best[i], (time.perf_counter() - start) / PASSES * 1e6)
    return best


def churn(scheduler, rooms):
    """One request in and one out per pass, as under steady traffic."""
    mgr = scheduler.disagg_prefill_inflight_queue[0].disagg_kv_sender.kv_mgr
    count = [0]

    def add_one_that_finishes():
        count[0] += 1
        room = count[0]
        scheduler.disagg_prefill_inflight_queue.append(
            standins.Req(f"churn-{room}", room, standins.NixlKVSender(mgr, room, status=standins.KVPoll.Success)))

    return add_one_that_finishes


def main():
    original = standins.PrefillMixin.process_disagg_prefill_inflight_queue
    scheduler = scheduler_with_rooms(ROOMS)

    def unwrapped():
        original(scheduler)

    def hooked():
        hook.around_inflight_pass(original, scheduler)

    hooked()  # starts the monitor and its listener, as the first real pass does
    monitor = hook.monitor_for(scheduler)

    bare, steady = compare(unwrapped, hooked)

    arrive = churn(scheduler, ROOMS)
    churn_bare, churn_hooked = compare(lambda: (arrive(), unwrapped()), lambda: (arrive(), hooked()))

    monitor._reobserve_interval = 0.0  # worst case: every pass re-reads every room
    every = per_pass_us(hooked)

    empty = standins.NewScheduler(backend="nixl")
    hook.around_inflight_pass(original, empty)
    empty_bare, empty_hooked = compare(lambda: original(empty), lambda: hook.around_inflight_pass(original, empty))

    start = time.perf_counter()
    for _ in range(200):
        json.dumps(monitor.listing(), separators=(",", ":"))
    listing_us = (time.perf_counter() - start) / 200 * 1e6

    print(f"inflight rooms: {ROOMS}, best of {RUNS} runs x {PASSES} passes, python {sys.version.split()[0]}")
    print(f"unwrapped pass:                         {bare:8.2f} us")
    print(f"hooked pass, steady state:              {steady:8.2f} us  added {steady - bare:6.2f} us "
          f"(target <= {TARGET_US:g} us)")
    print(f"hooked pass, one room in + one out:     {churn_hooked:8.2f} us  added {churn_hooked - churn_bare:6.2f} us")
    print(f"hooked pass, re-reading every room:     {every:8.2f} us  added {every - bare:6.2f} us "
          f"(once per {REOBSERVE_INTERVAL_S:g} s)")
    print(f"empty queue, unwrapped -> hooked:       {empty_bare:8.2f} -> {empty_hooked:.2f} us")
    print(f"GET /debug/inflight JSON (HTTP thread): {listing_us:8.2f} us for {ROOMS} rooms")
    for m in (monitor, hook.monitor_for(empty)):
        m.close()
    return 0 if steady - bare <= TARGET_US else 1


if __name__ == "__main__":
    sys.exit(main())
