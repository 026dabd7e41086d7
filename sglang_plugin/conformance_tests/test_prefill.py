"""The plugin inside SGLang's real prefill inflight pass, NIXL and Mooncake, over fake transports.

Run with SGLANG_SRC naming one release's source (or with an installed
sglang): scripts/conformance.sh runs it once per release. Every assertion
reads SGLang's own objects: the inflight queue, the finish reason the pass
set, what its release path handed back, its failed-transfer counter.
"""

import os
import threading
import time
import unittest

from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance import aftermath, check, runtime, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

_RT = None
_rooms = iter(range(5000, 100000))


def setUpModule():
    global _RT
    if _RT is not None:
        return  # test_liveness.py shares this runtime: one SGLang per process
    if not os.environ.get("SGLANG_SRC"):
        try:
            import importlib.util

            if importlib.util.find_spec("sglang") is None:
                raise unittest.SkipTest("no SGLang source (SGLANG_SRC) and no installed sglang: nothing to run on")
        except ImportError:
            raise unittest.SkipTest("no SGLang to run on")
    _RT = runtime.Runtime()


class _Backend(aftermath.Checked):
    backend = None

    def setUp(self):
        # A bench per test: a hung handle wedges its transfer worker's queue for every later room,
        # as in SGLang, and must not leak into the next scenario.
        self.bench = bench_module.Bench(_RT, self.backend).start()
        self.addCleanup(self.bench.stop)
        self.watch_aftermath(self.bench)
        self.server = self.bench.listing()["server"]
        self.levers = self.server["levers"]

    def tearDown(self):
        self.check_aftermath()
        self.assertEqual(self.bench.errors, [], "SGLang's pass raised: a real scheduler would have died")

    def room(self):
        return next(_rooms)

    def poll_name(self, sender):
        return _RT.poll_names[int(sender.poll())]

    def assert_released_as_failed(self, req):
        reason = self.bench.wait_released(req.rid)
        self.assertEqual(type(reason).__name__, "FINISH_ABORT", "released, but not as an abort")
        self.assertFalse(self.bench.queued(req.rid))
        self.assertIn(req.rid, self.bench.scheduler.tree_cache.released, "its KV pages were not handed back")
        self.assertEqual(req.metadata_buffer_index, -1, "its metadata buffer was not handed back")
        self.assertIsNone(self.bench.listed(req.rid))

    # Scenarios ------------------------------------------------------------

    def test_stuck_handle_is_released_or_refused_honestly(self):
        req = self.bench.admit(self.room(), transports.HANG)
        time.sleep(0.3)
        self.assertTrue(self.bench.queued(req.rid), "a hung transfer left the queue on its own")
        room = self.bench.listed(req.rid)
        self.assertEqual(room["poll"], self.poll_name(req.disagg_kv_sender),
                         "the listing's poll differs from SGLang's own poll()")
        failed_before = self.bench.scheduler.metrics_collector.transfer_failed_reqs
        status, body = self.bench.force_fail(req)
        if self.levers:
            self.assertEqual((status, body["result"]), (200, "flipped"), body)
            self.assert_released_as_failed(req)
            if "increment_transfer_failed_reqs" in _pass_source():
                self.assertEqual(self.bench.scheduler.metrics_collector.transfer_failed_reqs, failed_before + 1)
        else:
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            time.sleep(0.3)
            self.assertTrue(self.bench.queued(req.rid), "501 said nothing changed, yet the request left")
            # The honesty check: what SGLang's own Scheduler.abort_request would do does not release it either
            # (where its abort_request reaches the inflight queue at all).
            sender = req.disagg_kv_sender
            if hasattr(sender, "abort") and check.abort_reaches_inflight_queue(runtime.loader.loaded.source) is not False:
                sender.abort()
            time.sleep(0.3)
            self.assertTrue(self.bench.queued(req.rid), "SGLang's own abort released it: the plugin should have a lever")

    def test_healthy_transfer_is_released_by_sglang(self):
        req = self.bench.admit(self.room(), transports.COMPLETE)
        reason = self.bench.wait_released(req.rid)
        self.assertEqual(type(reason).__name__, "FINISH_LENGTH")
        status, body = self.bench.force_fail(req)
        self.assertEqual((status, body["result"]), (404, "not_found"), body)

    def test_slow_transfer_completes_and_dry_run_changes_nothing(self):
        req = self.bench.admit(self.room(), transports.slow(1.5))
        room = self.bench.listed(req.rid)
        self.assertIsNotNone(room)
        self.assertNotIn(room["poll"], ("Failed", "Success"))
        if self.levers:
            status, body = self.bench.force_fail(req, dry_run=True)
            self.assertEqual((status, body["result"]), (200, "would_flip"), body)
        reason = self.bench.wait_released(req.rid, timeout=15)
        self.assertEqual(type(reason).__name__, "FINISH_LENGTH", "a slow transfer was not let finish")

    def test_success_room_is_never_failed(self):
        """An order that meets a room whose transfer succeeded is refused; SGLang's Success branch releases it."""
        if not self.levers:
            self.skipTest(f"no lever on {self.backend} here: every order is refused before the transfer is read")
        req = self.bench.admit(self.room(), transports.slow(1.0))
        self.bench.hold()
        try:
            _until(lambda: self.poll_name(req.disagg_kv_sender) == "Success", 10, "the transfer to succeed")
            answer = {}
            poster = threading.Thread(target=lambda: answer.update(zip(("status", "body"), self.bench.force_fail(req))))
            poster.start()
            _until(lambda: self.bench.pending_orders() > 0, 10, "the order to be queued")
        finally:
            self.bench.running.set()
        poster.join(15)
        self.assertEqual((answer["status"], answer["body"]["result"]), (409, "transfer_succeeded"), answer)
        self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_LENGTH")

    def test_health_check_and_warm_up_are_never_failed(self):
        # Without SGLang's fake backend (v0.4.6) the warm-up is skipped in PD mode (entrypoints/http_server.py),
        # so only the health check exists there, marked by its rid.
        rids = ("HEALTH_CHECK_conformance", "warmup-conformance") if self.bench.has_fake_backend else (
            "HEALTH_CHECK_conformance",)
        for rid in rids:
            req = self.bench.health_check(self.room(), rid=rid)
            _until(lambda: self.bench.listed(req.rid) is not None, 10, f"{rid} to be listed")
            self.assertTrue(self.bench.listed(req.rid)["health_check"])
            status, body = self.bench.force_fail(req)
            self.assertEqual((status, body["result"]), (409, "health_check"), body)
            self.bench.finish_health_check(req)
            self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_LENGTH")

    def test_listing_describes_the_server(self):
        self.assertEqual(self.server["disaggregation_mode"], "prefill")
        self.assertEqual(self.server["transfer_backend"], self.backend)
        if not self.levers:
            self.assertTrue(self.server["lever_note"], "no lever, and no note saying why")


def _takes_args(fn):
    import inspect

    return any(p.default is inspect.Parameter.empty for p in inspect.signature(fn).parameters.values())


def _pass_source():
    import inspect

    fn = _RT.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue
    return inspect.getsource(inspect.unwrap(fn))


class Nixl(_Backend, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Backend, unittest.TestCase):
    backend = "mooncake"


class Ascend(_Backend, unittest.TestCase):
    """SGLang's Ascend backend: Mooncake's manager, sender and receiver over the Ascend transfer engine, which
    the harness fakes as it fakes Mooncake's (conformance/transports.py)."""

    backend = "ascend"

    def setUp(self):
        if self.backend in _RT.missing:
            self.skipTest(_RT.missing[self.backend])
        super().setUp()


if __name__ == "__main__":
    unittest.main()
