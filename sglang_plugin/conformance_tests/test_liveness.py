"""Round 4 on SGLang's own transfer workers: what each worker holds, and wedge orders released by SGLang's pass.

Every room of the bench goes to the same decode manager, so SGLang's own
sharding (the sum of destination ports) puts all their chunks on one
transfer queue: a hung chunk there holds every room behind it, as on a
server whose decode peer stopped answering.
"""

import time
import unittest

from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance import aftermath, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

_rooms = iter(range(200000, 300000))


class _Liveness(aftermath.Checked):
    backend = None

    def setUp(self):
        self.bench = bench_module.Bench(test_prefill._RT, self.backend).start()
        self.addCleanup(self.bench.stop)
        self.watch_aftermath(self.bench)
        listing = self.bench.listing()
        self.server = listing["server"]
        self.progress = self.server["transfer_progress"]
        manager_queues = getattr(self.bench.prefill_mgr, "transfer_queues", None)
        # The plugin's claim, against SGLang's own manager: worker queues exist exactly where it says so.
        self.assertEqual(self.progress, isinstance(manager_queues, list) and len(manager_queues) > 0, self.server)

    def tearDown(self):
        self.check_aftermath()
        self.assertEqual(self.bench.errors, [], "SGLang's pass raised: a real scheduler would have died")

    def room(self):
        return next(_rooms)

    def queue_of(self, req):
        return self.bench.transfer_queue_of(req.bootstrap_room)

    def held(self, queue, room):
        """The worker's in_flight entry once it holds a chunk of this room."""
        found = {}

        def holds():
            found["chunk"] = self.bench.worker(queue)["in_flight"]
            return found["chunk"] is not None and found["chunk"]["bootstrap_room"] == room

        _until(holds, 10, f"the worker of queue {queue} to take a chunk of room {room}")
        return found["chunk"]

    def test_fields_and_a_healthy_transfer(self):
        req = self.bench.admit(self.room(), transports.COMPLETE, chunks=2)
        self.bench.wait_released(req.rid)
        listing = self.bench.listing()
        if not self.progress:
            self.assertIsNone(listing["transfer_workers"])
            slow = self.bench.admit(self.room(), transports.slow(1.0))
            self.assertIsNone(self.bench.listed(slow.rid)["chunks_queued"])
            status, body = self.bench.wedge_order(0, 1)
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            return
        workers = listing["transfer_workers"]
        self.assertEqual([w["transfer_queue"] for w in workers], list(range(len(workers))))
        # SGLang dropped the room's destinations once it succeeded: its worker is the one that took chunks
        # (a bench whose event loop needs a first request has sent that one's chunk there too).
        queue = next(w["transfer_queue"] for w in workers if w["chunks_taken"])
        _until(lambda: self.bench.worker(queue)["in_flight"] is None, 10, "the worker to wait again")
        worker = self.bench.worker(queue)
        self.assertTrue(worker["tracked"], "the watch was installed before SGLang started this worker")
        self.assertEqual(worker["depth"], 0)
        self.assertGreaterEqual(worker["chunks_taken"], 2)
        self.assertEqual([pages for pages, _ in worker["recent"][-2:]], [2, 2])
        self.assertTrue(all(seconds < 1 for _, seconds in worker["recent"]), worker)
        self.assertEqual(listing["wedge_orders"], [])

    def test_slow_link_shows_the_chunk_held_and_timed(self):
        if not self.progress:
            self.skipTest("no transfer worker queues here")
        transports.fabric.link_speed(0.4)  # 4 pages: 1.6 s, a link at a few percent of its speed
        req = self.bench.admit(self.room(), transports.COMPLETE)
        queue = self.queue_of(req)
        first = self.held(queue, req.bootstrap_room)
        self.assertEqual((first["pages"], first["last_chunk"]), (4, True))
        time.sleep(0.5)
        second = self.bench.worker(queue)["in_flight"]
        self.assertEqual(second["chunk"], first["chunk"])
        self.assertGreater(second["seconds"], first["seconds"] + 0.4)
        self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_LENGTH")
        _until(lambda: self.bench.worker(queue)["in_flight"] is None, 10, "the worker to wait again")
        pages, seconds = self.bench.worker(queue)["recent"][-1]
        self.assertEqual(pages, 4)
        self.assertGreaterEqual(seconds, 1.6)

    def test_a_burst_of_long_prompts_on_a_slow_link(self):
        if not self.progress:
            self.skipTest("no transfer worker queues here")
        transports.fabric.link_speed(0.05)  # 0.2 s a request of 4 one-page chunks
        reqs = [self.bench.admit(self.room(), transports.COMPLETE, chunks=4) for _ in range(6)]
        queue = self.queue_of(reqs[-1])
        listing = self.bench.listing()
        worker = listing["transfer_workers"][queue]
        queued = sum(room["chunks_queued"] for room in listing["inflight"])
        # The listing reads the queue twice (depth, then each room's count) while the worker drains it.
        self.assertLessEqual(abs(worker["depth"] - queued), 1, listing)
        for req in reqs:
            self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_LENGTH")
        _until(lambda: self.bench.worker(queue)["in_flight"] is None, 10, "the worker to wait again")
        recent = self.bench.worker(queue)["recent"]
        self.assertEqual([pages for pages, _ in recent[-24:]], [1] * 24)
        self.assertTrue(all(seconds >= 0.05 for _, seconds in recent[-24:]), recent)

    def test_wedge_order_releases_the_rooms_behind_a_hung_chunk(self):
        if not self.progress:
            self.skipTest("no transfer worker queues here")
        stuck = self.bench.admit(self.room(), transports.HANG)
        queue = self.queue_of(stuck)
        chunk = self.held(queue, stuck.bootstrap_room)["chunk"]
        behind = [self.bench.admit(self.room(), transports.COMPLETE, chunks=2) for _ in range(2)]
        self.assertEqual({self.queue_of(r) for r in behind}, {queue}, "SGLang sharded the rooms apart")
        health = self.bench.health_check(self.room())
        listing = self.bench.listing()
        worker = listing["transfer_workers"][queue]
        self.assertEqual(worker["depth"], 4)
        queued = {room["rid"]: room["chunks_queued"] for room in listing["inflight"]}
        self.assertEqual([queued[r.rid] for r in behind], [2, 2])
        self.assertEqual(queued[stuck.rid], 0)

        if not listing["server"]["levers"]:  # read now: the plugin works them out from the first sender it sees
            status, body = self.bench.wedge_order(queue, chunk)
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            return
        status, body = self.bench.wedge_order(queue, chunk, dry_run=True)
        self.assertEqual((status, body["result"]), (200, "would_order"), body)
        self.assertEqual({r["rid"] for r in body["failed"]}, {stuck.rid} | {r.rid for r in behind})
        self.assertTrue(self.bench.queued(stuck.rid), "a dry run changed something")

        young = self.bench.admit(self.room(), transports.COMPLETE)
        failed_before = self.bench.scheduler.metrics_collector.transfer_failed_reqs
        status, body = self.bench.wedge_order(queue, chunk, ttl=30, min_age=3.0)
        self.assertEqual((status, body["result"], body["failed"]), (200, "ordered", []), body)
        # min_age 3 s: the rooms admitted above are younger. They age into the order while it stands.
        for req in [stuck] + behind:
            self.assertEqual(type(self.bench.wait_released(req.rid, timeout=8)).__name__, "FINISH_ABORT")
        self.assertTrue(self.bench.queued(young.rid) or self.bench.released(young.rid) is not None)
        if "increment_transfer_failed_reqs" in test_prefill._pass_source():
            self.assertEqual(self.bench.scheduler.metrics_collector.transfer_failed_reqs - failed_before,
                             len(behind) + 1 + (self.bench.released(young.rid) is not None))
        self.assertIsNone(self.bench.released(health.rid), "a health check was failed")
        status, body = self.bench.wedge_order(queue, chunk, ttl=30, min_age=3.0)
        self.assertEqual((status, body["result"]), (200, "ordered"), body)
        self.assertTrue({stuck.rid} | {r.rid for r in behind} <= {r["rid"] for r in body["failed"]}, body)
        standing = self.bench.listing()["wedge_orders"]
        self.assertEqual([(o["transfer_queue"], o["chunk"]) for o in standing], [(queue, chunk)])
        self.assertGreaterEqual(standing[0]["rooms_failed"], 3)

        transports.fabric.end_hangs([stuck.bootstrap_room], transports.COMPLETE)  # the wedge clears
        _until(lambda: self.bench.worker(queue)["chunks_taken"] > chunk, 10, "the worker to take another chunk")
        late = self.bench.admit(self.room(), transports.slow(1.0))
        status, body = self.bench.wedge_order(queue, chunk, min_age=0)
        self.assertEqual((status, body["result"]), (409, "wedge_cleared"), body)
        self.assertEqual(self.bench.listing()["wedge_orders"], [])
        self.assertEqual(type(self.bench.wait_released(late.rid)).__name__, "FINISH_LENGTH", "a void order failed it")
        self.bench.finish_health_check(health)

    def test_wedge_order_lapses_after_its_ttl(self):
        stuck = self.bench.admit(self.room(), transports.HANG)
        if not self.progress or not self.bench.listing()["server"]["levers"]:
            self.skipTest("no transfer worker queues or no lever here")
        queue = self.queue_of(stuck)
        chunk = self.held(queue, stuck.bootstrap_room)["chunk"]
        status, body = self.bench.wedge_order(queue, chunk, ttl=0.5, min_age=1.5)
        self.assertEqual((status, body["result"]), (200, "ordered"), body)
        self.assertEqual(len(self.bench.listing()["wedge_orders"]), 1)
        time.sleep(2.0)  # past the ttl, then past min_age: a standing order would fail it now
        self.assertEqual(self.bench.listing()["wedge_orders"], [])
        self.assertTrue(self.bench.queued(stuck.rid), "a lapsed order failed a room")

    def test_client_abort_behind_a_slow_chunk(self):
        if not self.progress:
            self.skipTest("no transfer worker queues here")
        slow = self.bench.admit(self.room(), transports.slow(1.5))
        queue = self.queue_of(slow)
        self.held(queue, slow.bootstrap_room)
        behind = self.bench.admit(self.room(), transports.COMPLETE)
        self.assertEqual(self.bench.listed(behind.rid)["chunks_queued"], 1)
        behind.disagg_kv_sender.abort()  # what Scheduler.abort_request does for a client that went away
        self.bench.wait_released(behind.rid)
        self.assertEqual(type(self.bench.wait_released(slow.rid)).__name__, "FINISH_LENGTH")
        # The worker still takes the aborted room's chunk, and SGLang's worker skips it at once.
        _until(lambda: self.bench.worker(queue)["depth"] == 0 and self.bench.worker(queue)["in_flight"] is None,
               10, "the worker to drain its queue")
        self.assertLess(self.bench.worker(queue)["recent"][-1][1], 1.0)

    def test_a_chunk_that_errors_settles(self):
        if not self.progress:
            self.skipTest("no transfer worker queues here")
        req = self.bench.admit(self.room(), [transports.slow(0.3), transports.fail_after(0.3)], chunks=2)
        queue = self.queue_of(req)
        self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_ABORT")
        _until(lambda: self.bench.worker(queue)["in_flight"] is None, 10, "the worker to wait again")
        self.assertEqual([pages for pages, _ in self.bench.worker(queue)["recent"][-2:]], [2, 2])
        if hasattr(self.bench.prefill_mgr, "failed_sessions"):
            self.sglang_breaks_itself(
                "Mooncake takes a transfer error for a dead decode session (MooncakeKVManager.failed_sessions, "
                "disaggregation/mooncake/conn.py) and fails its later rooms until the session registers again or "
                "its probe clears it: SGLang's own handling of the error, no lever pulled")


class Nixl(_Liveness, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Liveness, unittest.TestCase):
    backend = "mooncake"


def setUpModule():
    test_prefill.setUpModule()


if __name__ == "__main__":
    unittest.main()
