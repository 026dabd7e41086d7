"""Measures what the hooks add to one pass, with 100 rooms: prefill's inflight pass and decode's queue pass.

    python3 sglang_plugin/bench_hook.py

The passes are the stand-ins of SGLang's (tests/standins.py). Prefill: the
inflight pass polls 100 NIXL senders that stay in Transferring. Decode:
process_decode_queue with 50 requests waiting in the prealloc queue
(handshake pending) and 50 NIXL receivers in the transfer queue with chunks
arriving, none finished. Each figure is the best of several runs of many
back-to-back passes, in microseconds per pass; the runs of the unwrapped and
the hooked pass alternate, so that both see the same load.
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


def decode_scheduler_with_rooms(count):
    s = standins.DecodeScheduler(backend="nixl", pages=standins.PagePool(count))
    for i in range(count):
        s.add_request(f"rid-{i:04d}", 2**63 + i, handshake=i % 2 == 0)
    standins.DecodeMixin.process_decode_queue.__wrapped__(s)  # the handshaken half moves to the transfer queue
    for i in range(0, count, 2):
        s.kv_manager.receive_chunk(2**63 + i, 0)
    return s


def decode_main():
    hook.install(standins.DecodeMixin, hook.DECODE_METHOD)
    original = standins.DecodeMixin.process_decode_queue.__wrapped__
    scheduler = decode_scheduler_with_rooms(ROOMS)

    def unwrapped():
        original(scheduler)

    def hooked():
        hook.around_decode_pass(original, scheduler)

    hooked()
    monitor = hook.monitor_for(scheduler)
    bare, steady = compare(unwrapped, hooked)

    count = [0]

    def arrive():
        # One request in (prealloc, handshake done, so it moves on in the pass) and one out
        # (the oldest transferring room completes) per pass.
        count[0] += 1
        room = 2**62 + count[0]
        scheduler.add_request(f"churn-{count[0]}", room)
        transfer = scheduler.disagg_decode_transfer_queue.queue
        if transfer:
            done_room = transfer[0].req.bootstrap_room
            scheduler.kv_manager.receive_chunk(done_room, 0)
            scheduler.kv_manager.receive_chunk(done_room, 1, last_of=2)
            scheduler.kv_manager.receive_aux(done_room)

    churn_bare, churn_hooked = compare(lambda: (arrive(), unwrapped()), lambda: (arrive(), hooked()))

    monitor._reobserve_interval = 0.0
    every = per_pass_us(hooked)
    monitor._reobserve_interval = REOBSERVE_INTERVAL_S

    start = time.perf_counter()
    for _ in range(200):
        json.dumps(monitor.listing(), separators=(",", ":"))
    listing_us = (time.perf_counter() - start) / 200 * 1e6

    print(f"decode: {ROOMS} requests (50 prealloc, 50 transfer), best of {RUNS} runs x {PASSES} passes")
    print(f"unwrapped process_decode_queue:         {bare:8.2f} us")
    print(f"hooked, steady state:                   {steady:8.2f} us  added {steady - bare:6.2f} us "
          f"(target <= {TARGET_US:g} us)")
    print(f"hooked, one request in + one out:       {churn_hooked:8.2f} us  added {churn_hooked - churn_bare:6.2f} us")
    print(f"hooked, re-reading every request:       {every:8.2f} us  added {every - bare:6.2f} us "
          f"(once per {REOBSERVE_INTERVAL_S:g} s)")
    listed = len(monitor.listing()["decode_requests"])
    print(f"GET /debug/inflight JSON (HTTP thread): {listing_us:8.2f} us for {listed} requests")
    monitor.close()
    return steady - bare <= TARGET_US


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
    print()
    decode_ok = decode_main()
    return 0 if steady - bare <= TARGET_US and decode_ok else 1


if __name__ == "__main__":
    sys.exit(main())
