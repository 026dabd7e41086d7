"""The plugin inside SGLang's real decode queue pass, NIXL and Mooncake, over fake transports.

Run with SGLANG_SRC naming one release's source (or with an installed
sglang): scripts/conformance.sh runs it once per release. The decode
scheduler derives from the release's SchedulerDisaggregationDecodeMixin, its
queues are the release's DecodePreallocQueue and DecodeTransferQueue, and
its loop runs the release's process_decode_queue with the plugin loaded.
Every assertion reads SGLang's own objects: the queues, the finish reason
SGLang's failure branch set, what its release path handed back, its
metadata slot allocator, its failed-transfer counter.
"""

import os
import time
import unittest

from sglang_watchdog_plugin.conformance import decode_bench, runtime, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

_RT = None
_rooms = iter(range(60000, 100000))
_SETUP_PROBLEM = None


def setUpModule():
    global _RT
    if not os.environ.get("SGLANG_SRC"):
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise unittest.SkipTest("no SGLang source (SGLANG_SRC) and no installed sglang: nothing to run on")
    _RT = runtime.Runtime()


def _source(obj):
    import inspect

    return inspect.getsource(inspect.unwrap(obj))


class _Backend:
    backend = None

    def setUp(self):
        try:
            self.bench = decode_bench.DecodeBench(_RT, self.backend)
        except RuntimeError as e:
            if "builds its KV manager inline" in str(e):
                self.skipTest(str(e))
            raise
        except ValueError as e:
            if "max_workers" in str(e) and (os.cpu_count() or 1) < 4:
                self.skipTest(f"this release's {self.backend} KV manager sizes its thread pool as os.cpu_count() // 4, "
                              f"which is 0 on this {os.cpu_count()}-CPU machine: SGLang itself cannot start here ({e})")
            raise
        self.bench.start()
        self.addCleanup(self.bench.stop)
        self.server = self.bench.listing()["server"]
        self.levers = self.server["levers"]

    def tearDown(self):
        self.assertEqual(self.bench.errors, [], "SGLang's decode pass raised: a real scheduler would have died")

    def room(self):
        return next(_rooms)

    def poll_name(self, req):
        receiver = req.decode_request.kv_receiver
        return None if receiver is None else _RT.poll_names[int(receiver.poll())]

    # Scenarios ------------------------------------------------------------

    def test_listing_describes_the_decode_server(self):
        self.assertEqual(self.server["disaggregation_mode"], "decode")
        self.assertEqual(self.server["transfer_backend"], self.backend)
        if not self.levers:
            self.assertTrue(self.server["lever_note"], "no lever, and no note saying why")

    def test_hung_transfer_is_listed_refused_then_released_by_sglang(self):
        req = self.bench.admit(self.room(), transports.HANG)
        time.sleep(0.3)
        self.assertEqual(self.bench.queue_of(req.rid), "transfer", "a hung transfer left the transfer queue")
        row = self.bench.listed(req.rid)
        self.assertEqual(row["queue"], "transfer")
        self.assertEqual(row["poll"], self.poll_name(req), "the listing's poll differs from SGLang's own poll()")
        self.assertIsNot(row["transfer_started"], False, "metadata was sent: prefill may be writing")
        self.assertFalse(row["health_check"])

        status, body = self.bench.force_fail(req)
        if not self.levers:
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            return
        self.assertEqual((status, body["result"]), (409, "transfer_live"), body)
        time.sleep(0.2)
        self.assertEqual(self.bench.queue_of(req.rid), "transfer", "a refused order changed something")
        self.assertIsNone(req.finished_reason)

        status, body = self.bench.force_fail(req, dry_run=True, prefill_stopped=True)
        self.assertEqual((status, body["result"]), (200, "would_flip"), body)
        time.sleep(0.2)
        self.assertEqual(self.bench.queue_of(req.rid), "transfer", "a dry run changed something")

        slot = req.decode_request.metadata_buffer_index
        allocator = self.bench.scheduler.req_to_metadata_buffer_idx_allocator
        free_before = allocator.available_size()
        failed_before = self.bench.scheduler.metrics_collector.transfer_failed_reqs
        status, body = self.bench.force_fail(req, prefill_stopped=True)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        _until(lambda: not self.bench.queued(req.rid), 10, "SGLang's pass to let the request go")
        # SGLang's own failure branch of pop_transferred did the release:
        self.assertEqual(type(req.finished_reason).__name__, "FINISH_ABORT", "released, but not as an abort")
        streamed = self._streamed(req.rid)
        if "stream_output" in _source(_RT.decode.DecodeTransferQueue.pop_transferred):
            self.assertTrue(streamed, "its abort was not streamed to the client")
        if "cache_finished_req" in _source(_RT.decode.DecodeTransferQueue.pop_transferred) or \
                "release_kv_cache" in _source(_RT.decode.DecodeTransferQueue.pop_transferred):
            self.assertIn(req.rid, self.bench.scheduler.tree_cache.released, "its KV pages were not handed back")
        self.assertEqual(allocator.available_size(), free_before + 1, f"metadata slot {slot} was not freed")
        self.assertIn(slot, list(allocator.free_slots))
        if "increment_transfer_failed_reqs" in _source(_RT.decode.DecodeTransferQueue.pop_transferred):
            self.assertEqual(self.bench.scheduler.metrics_collector.transfer_failed_reqs, failed_before + 1)
        self.assertFalse(self.bench.transferred(req.rid), "a failed request went on to decode")
        self.assertIsNone(self.bench.listed(req.rid))
        status, body = self.bench.force_fail(req, prefill_stopped=True)
        self.assertEqual((status, body["result"]), (404, "not_found"), body)

    def test_healthy_transfer_completes_untouched(self):
        req = self.bench.admit(self.room(), transports.COMPLETE)
        _until(lambda: self.bench.transferred(req.rid), 10, "the healthy transfer to complete")
        self.assertIsNone(req.finished_reason)
        self.assertFalse(self._streamed(req.rid))
        self.assertEqual(self.bench.scheduler.tree_cache.released, [])
        status, body = self.bench.force_fail(req, prefill_stopped=True)
        self.assertEqual((status, body["result"]), (404, "not_found"), body)

    def test_slow_transfer_is_listed_and_completes(self):
        req = self.bench.admit(self.room(), transports.slow(1.0))
        row = self.bench.listed(req.rid)
        self.assertIsNotNone(row)
        self.assertNotIn(row["poll"], ("Failed", "Success"))
        _until(lambda: self.bench.transferred(req.rid), 15, "the slow transfer to complete")
        self.assertIsNone(req.finished_reason)

    def test_prealloc_request_is_never_released_without_an_order(self):
        req = self.bench.admit_prealloc(self.room())
        _until(lambda: (self.bench.listed(req.rid) or {}).get("poll") == "WaitingForInput", 10,
               "the handshake with prefill (SGLang's _update_handshake_waiters)")
        time.sleep(0.5)  # many passes: nobody gave an order
        row = self.bench.listed(req.rid)
        self.assertEqual(row["queue"], "prealloc")
        # False, or None where the release's receiver keeps nothing that tells (the earliest Mooncake): the
        # watchdog reads None as unknown and holds the request. Never True: no page was sent to prefill yet.
        self.assertIn(row["transfer_started"], (False, None), "no page was sent to prefill yet")
        self.assertEqual(self.bench.queue_of(req.rid), "prealloc")
        self.assertIsNone(req.finished_reason)
        self.assertFalse(self._streamed(req.rid))
        decode_req = next(d for d in self.bench.scheduler.disagg_decode_prealloc_queue.queue if d.req.rid == req.rid)
        self.assertNotEqual(_RT.poll_names[int(decode_req.kv_receiver.poll())], "Failed")
        if self.levers:
            # No metadata sent: prefill cannot write, so no prefill_stopped is needed; SGLang's prealloc pass frees it.
            status, body = self.bench.force_fail(req)
            self.assertEqual((status, body["result"]), (200, "flipped"), body)
            _until(lambda: not self.bench.queued(req.rid), 10, "SGLang's prealloc pass to let the request go")
            self.assertEqual(type(req.finished_reason).__name__, "FINISH_ABORT")
            if "stream_output" in _source(_RT.decode.DecodePreallocQueue.pop_preallocated):
                self.assertTrue(self._streamed(req.rid), "its abort was not streamed to the client")

    def test_sglang_own_abort(self):
        """What SGLang's Scheduler.abort_request does on decode (kv_receiver.abort(), then its queue passes)."""
        receiver_cls = type(self.bench.decode_mgr).__name__.replace("Manager", "Receiver")
        if not hasattr(getattr(_RT.conns[self.backend], receiver_cls, None), "abort"):
            self.skipTest(f"{receiver_cls} has no abort(): SGLang's own abort_request cannot abort it either")
        hung = self.bench.admit(self.room(), transports.HANG)
        waiting = self.bench.admit_prealloc(self.room())
        _until(lambda: (self.bench.listed(waiting.rid) or {}).get("poll") == "WaitingForInput", 10, "the handshake")
        self.bench.hold()
        try:  # on the scheduler thread's turn, as abort_request runs between passes
            hung.decode_request.kv_receiver.abort()
            next(d for d in self.bench.scheduler.disagg_decode_prealloc_queue.queue
                 if d.req.rid == waiting.rid).kv_receiver.abort()
        finally:
            self.bench.running.set()
        if not self.levers:  # the release's Failed branches raise: its own abort ends the scheduler
            _until(lambda: self.bench.errors, 10, "SGLang's pass to raise on its own aborted receiver")
            self.bench.hold()
            self.assertIn("failed", str(self.bench.errors[0]).lower())
            self.bench.errors.clear()  # expected here: SGLang's own abort, not the plugin's
            return
        # Transfer queue: released at once, pages and all, whether or not prefill may still write into them.
        _until(lambda: not self.bench.queued(hung.rid), 10, "SGLang's transfer pass to release its own abort")
        self.assertEqual(type(hung.finished_reason).__name__, "FINISH_ABORT")
        handshake = _source(_RT.decode.DecodePreallocQueue._update_handshake_waiters)
        if "conclude_state" in handshake:  # "Still poll if any receiver was aborted"
            _until(lambda: not self.bench.queued(waiting.rid), 10, "SGLang's prealloc pass to release its own abort")
            self.assertEqual(type(waiting.finished_reason).__name__, "FINISH_ABORT")
        else:  # every prealloc request waits for input: no receiver is polled, the aborted one stays
            time.sleep(0.5)
            self.assertEqual(self.bench.queue_of(waiting.rid), "prealloc",
                             "SGLang's prealloc pass now reads aborted receivers: the plugin's re-poll is not needed")
            self.assertIsNone(waiting.finished_reason)
            self.assertEqual(self.bench.listed(waiting.rid)["poll"], "Failed")

    def test_deferred_decode_kv_release_is_absent(self):
        """Deferred decode KV release: proven absent by structure; the listing must say "not in this release"."""
        import sglang

        root = os.path.dirname(sglang.__file__)
        marker = "DEFERRED_DECODE_KV_RELEASE"
        hits = []
        for folder, _, files in os.walk(os.path.join(root, "srt")):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                        if marker in f.read():
                            hits.append(os.path.relpath(os.path.join(folder, name), root))
        manager = self.bench.decode_mgr
        if hits or hasattr(manager, "enable_deferred_decode_kv_release"):
            self.skipTest(f"this release has deferred decode KV release ({', '.join(hits)}): its on/off scenarios "
                          "are not written yet")
        self.assertFalse(hasattr(manager, "register_deferred_abort_room"))
        self.assertIsNone(self.server["deferred_release"], "the plugin claims a deferred release SGLang lacks")

    def _streamed(self, rid):
        return [r for r in self.bench.scheduler.streamed if r.rid == rid]


class Nixl(_Backend, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Backend, unittest.TestCase):
    backend = "mooncake"


if __name__ == "__main__":
    unittest.main()
