"""The page ledger (issue 24): which pages a lever frees under a handle still outstanding, on SGLang's own code.

Prefill's Failed branch (``process_disagg_prefill_inflight_queue`` ->
``release_kv_cache``, disaggregation/prefill.py) hands the request's KV
pages back whatever its transfers are doing; decode's failure branch of
``pop_transferred`` (disaggregation/decode.py) does so for the pages prefill
writes. Each scene here sets up a transfer, has the request released by a
lever or by SGLang itself, and reads the ledger (conformance/transports.py)
and the aftermath check (conformance/aftermath.py):

* a lever on a hung handle frees its pages under it: the remedy, counted, no problem;
* a lever on a handle that still moves is the harm the check exists for: the plugin has no refusal for a live
  room on prefill (orders.py reads the poll, not the transfer's progress), so ordering the force-fail directly on
  a slow room is the broken plugin, and the check must name it; on decode the caller's ``prefill_stopped`` says
  prefill stopped writing, and saying so of a slow transfer is the same harm;
* SGLang's own abort of a request whose transfer moves is stock behaviour: counted apart, no problem.

At the end the module prints the ledger's totals per backend over every scene this process ran
(``conformance: ledger: <release> <backend>: ...``); run alone, that is this module's scenes, the deliberately
harmful ones included. Every checked scene of the suite prints its own line when it freed pages under a handle.
"""

import os
import time
import unittest

from sglang_watchdog_plugin.conformance import aftermath, bench as bench_module, decode_bench, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

_rooms = iter(range(800000, 900000))
_PAGES = 4  # scheduler.Link's default: each request's KV pages on each side
_SLOW = 1.5  # seconds: a transfer still moving when the pass releases the request (tenths of a second on)


def setUpModule():
    test_prefill.setUpModule()


def tearDownModule():
    rt = test_prefill._RT
    if rt is None:
        return
    # A source tree's version file may say nothing (loader._version): its folder names the release then.
    release = rt.version or os.path.basename(os.environ.get("SGLANG_SRC", "").rstrip("/")) or "the installed sglang"
    frees, reused = transports.ledger.since((0, 0))
    for backend in sorted({f.backend for f in frees if f.backend}):
        counts = transports.ledger_counts([f for f in frees if f.backend == backend])
        print(f"\nconformance: ledger: {release} {backend}: {transports.describe_counts(counts)}", flush=True)
    if reused:
        print(f"conformance: ledger: {release}: {len(reused)} requests given decode pages a handle still wrote",
              flush=True)


class _Backend:
    backend = None

    def use(self, bench):
        """The scene's bench, started, with the aftermath's record of how it began."""
        self.bench = bench.start()
        self.addCleanup(self.bench.stop)
        self.before = aftermath.Before(self.bench)
        self.levers = self.bench.listing()["server"]["levers"]

    def tearDown(self):
        bench = getattr(self, "bench", None)
        self.assertEqual(bench.errors if bench else [], [], "SGLang's pass raised: a real scheduler would have died")

    def frees_of(self, req):
        frees, _ = transports.ledger.since(self.before.ledger_mark)
        return [f for f in frees if f.room == req.bootstrap_room]

    def flip(self, behaviour, **order):
        """A request whose transfer behaves so, force-failed by the plugin: its free in the ledger, or a skip."""
        if not self.levers:
            self.skipTest(f"no lever on {self.backend} here: nothing the plugin does frees pages")
        req = self.bench.admit(next(_rooms), behaviour)
        time.sleep(0.2)
        self.assertTrue(transports.fabric.in_flight(req.bootstrap_room), "the transfer is not outstanding")
        status, body = self.bench.force_fail(req, **order)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        _until(lambda: not self.bench.queued(req.rid), 10, "SGLang's pass to let the request go")
        self.assertEqual(type(req.finished_reason).__name__, "FINISH_ABORT")
        frees = self.frees_of(req)
        if not frees and order:
            self.skipTest("this release's decode failure branch hands no pages to the tree cache")
        self.assertEqual(len(frees), 1, "SGLang's release path did not hand the request's pages back once")
        (free,) = frees
        self.assertTrue(free.by_lever, "the plugin's order released the request, yet the ledger says SGLang did")
        return free

    def assert_caught(self, free, what, serve=True):
        problems = aftermath.check(self.before, serve=serve, what=what)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("a lever freed pages under an outstanding handle that was still progressing", problems[0])
        self.assertIn(f"room {free.room}", problems[0])

    # Prefill: the handles read the pages ---------------------------------

    def test_the_remedy_under_a_hung_read_is_counted_not_failed(self):
        self.use(bench_module.Bench(test_prefill._RT, self.backend))
        free = self.flip(transports.HANG)
        self.assertEqual((free.side, len(free.stuck), len(free.live)), ("prefill", _PAGES, 0), free.describe())
        self.assertEqual(aftermath.check(self.before, what="the prefill remedy"), [])

    def test_a_lever_under_a_live_read_is_caught(self):
        self.use(bench_module.Bench(test_prefill._RT, self.backend))
        free = self.flip(transports.slow(_SLOW))
        self.assertEqual((free.side, len(free.live), len(free.stuck)), ("prefill", _PAGES, 0), free.describe())
        self.assert_caught(free, "a prefill lever under a live read")

    def test_sglangs_own_abort_under_a_live_read_is_stock(self):
        self.use(bench_module.Bench(test_prefill._RT, self.backend))
        req = self.bench.admit(next(_rooms), transports.slow(_SLOW))
        time.sleep(0.2)
        self.bench.abort(req.rid)
        deadline = time.monotonic() + 1.0
        while self.bench.released(req.rid) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.bench.released(req.rid) is None:
            self.skipTest("SGLang's own abort does not release an inflight request on this release and backend")
        (free,) = self.frees_of(req)
        self.assertFalse(free.by_lever, "SGLang's own abort counted as a lever's")
        self.assertEqual(len(free.live), _PAGES, free.describe())
        self.assertEqual(aftermath.check(self.before, what="SGLang's own abort"), [])

    # Decode: the handles write the pages; the order says prefill stopped -------

    def test_the_remedy_under_a_hung_write_is_counted_not_failed(self):
        self.use(decode_bench.DecodeBench(test_prefill._RT, self.backend))
        free = self.flip(transports.HANG, prefill_stopped=True)
        self.assertEqual((free.side, len(free.stuck), len(free.live)), ("decode", _PAGES, 0), free.describe())
        self.assertEqual(aftermath.check(self.before, what="the decode remedy"), [])

    def test_a_lever_under_a_live_write_is_caught(self):
        self.use(decode_bench.DecodeBench(test_prefill._RT, self.backend))
        free = self.flip(transports.slow(_SLOW), prefill_stopped=True)
        self.assertEqual((free.side, len(free.live), len(free.stuck)), ("decode", _PAGES, 0), free.describe())
        self.assert_caught(free, "a decode lever under a live write")

    def test_pages_given_again_under_a_live_write_are_seen(self):
        """One metadata slot: the next request gets the decode pages the flipped one's prefill still writes."""
        self.use(decode_bench.DecodeBench(test_prefill._RT, self.backend, metadata_slots=1))
        free = self.flip(transports.slow(_SLOW), prefill_stopped=True)
        mark = transports.ledger.mark()
        nxt = self.bench.admit(next(_rooms), transports.COMPLETE)
        self.assertEqual(transports.ledger.since(mark)[1], [(nxt.bootstrap_room, free.room, False)])
        # Its one metadata slot is taken: no new request can be served here, whatever the scene did.
        self.assert_caught(free, "decode pages given again under a live write", serve=False)


class Nixl(_Backend, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Backend, unittest.TestCase):
    backend = "mooncake"


if __name__ == "__main__":
    unittest.main()
