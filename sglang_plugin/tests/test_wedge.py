"""Round 4: transfer workers' liveness (transfer_watch.py) and standing wedge orders (wedge.py, /admin/wedge_order).

The transfer workers here are serial as SGLang's ``transfer_worker`` is:
take a chunk from a FastQueue (a copy of ``common/utils.py``'s), hold it
until the test lets it go, take the next.
"""

import collections
import threading
import time
import types
import unittest

from sglang_watchdog_plugin import capabilities, monitor, transfer_watch, wedge

from . import harness, standins
from .standins import KVPoll


class _Queue:
    """SGLang's FastQueue (disaggregation/common/utils.py, v0.4.10 to v0.5.18)."""

    def __init__(self):
        self._buf = collections.deque()
        self._cond = threading.Condition()

    def put(self, item):
        with self._cond:
            self._buf.append(item)
            self._cond.notify()

    def get(self):
        with self._cond:
            while not self._buf:
                self._cond.wait()
            return self._buf.popleft()


class FastQueue(_Queue):
    """Watched from this module's import on, as the hook's install watches SGLang's."""


class LateQueue(_Queue):
    """Watched only once its worker already waits in the original get()."""


class Chunk:
    """TransferKVChunk, as far as the watch reads it."""

    def __init__(self, room, pages, last=True):
        self.room = room
        self.prefill_kv_indices = list(range(pages))
        self.is_last_chunk = last


class Worker:
    """A serial transfer worker: holds each chunk until release() is called once for it."""

    def __init__(self, queue):
        self.queue = queue
        self._go = threading.Semaphore(0)
        self.done = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            chunk = self.queue.get()
            if chunk is None:
                return
            self._go.acquire()
            self.done.append(getattr(chunk, "room", None))

    def release(self, chunks=1):
        for _ in range(chunks):
            self._go.release()

    def stop(self):
        self.queue.put(None)
        self.release()


class WorkerManager(standins.NewestNixlKVManager):
    """The newest NIXL manager with real worker queues: two of them, keyed by the sum of destination ports."""

    def __init__(self, queue_class=FastQueue):
        super().__init__(queues=2)
        self.transfer_queues = [queue_class() for _ in range(2)]


transfer_watch.install(FastQueue)


class WatchTest(unittest.TestCase):
    def test_worker_state_machine(self):
        queue = FastQueue()
        self.assertIsNone(transfer_watch.state_of(queue))
        worker = Worker(queue)
        self.addCleanup(worker.stop)
        harness.wait_until(lambda: transfer_watch.state_of(queue) is not None, message="the worker to wait in get()")
        self.assertEqual(transfer_watch.worker_json(0, queue, time.monotonic()), {
            "transfer_queue": 0, "tracked": True, "depth": 0, "chunks_taken": 0, "in_flight": None, "recent": [],
            "finished": []})
        queue.put(Chunk(11, 8, last=False))
        queue.put(Chunk(12, 0))  # aux-only last chunk: not in recent
        queue.put(Chunk(12, 3))
        harness.wait_until(lambda: transfer_watch.held_chunk(queue) == 1, message="the first take")
        time.sleep(0.05)
        row = transfer_watch.worker_json(0, queue, time.monotonic())
        self.assertEqual(row["depth"], 2)
        self.assertEqual(row["in_flight"]["bootstrap_room"], 11)
        self.assertEqual((row["in_flight"]["pages"], row["in_flight"]["last_chunk"]), (8, False))
        self.assertGreaterEqual(row["in_flight"]["seconds"], 0.05)
        self.assertEqual(transfer_watch.queued_by_room([queue]), {12: 2})
        worker.release(3)
        harness.wait_until(lambda: worker.done == [11, 12, 12] and transfer_watch.held_chunk(queue) is None,
                           message="the three chunks to finish")
        row = transfer_watch.worker_json(0, queue, time.monotonic())
        self.assertEqual(row["chunks_taken"], 3)
        self.assertEqual([pages for pages, _ in row["recent"]], [8, 3])
        self.assertGreaterEqual(row["recent"][0][1], 0.05)
        # The same chunks with their numbers (the aux-only chunk 2 is left out) and links (none bound here).
        self.assertEqual([(f["chunk"], f["pages"], f["link"]) for f in row["finished"]], [(1, 8, ""), (3, 3, "")])
        self.assertEqual([f["seconds"] for f in row["finished"]], [s for _, s in row["recent"]])

    def test_each_chunk_names_the_destinations_of_its_room(self):
        """The link is read from the manager's transfer_infos when the worker takes the chunk: SGLang pops a
        room's entry once it is sent, so a finished chunk keeps the link it was taken with."""

        class Info:
            def __init__(self, dummy=False):
                self.dummy = dummy

            def is_dummy(self):
                return self.dummy

        manager = types.SimpleNamespace(transfer_infos={
            21: {"agent-b": Info(), "agent-a": Info()},  # NIXL: decode agent names, in no order
            22: {"10.0.0.7:17001": Info(), "cp-peer": Info(dummy=True)},  # Mooncake sessions; a CP dummy takes no KV
            23: {f"decode-agent-{i:03d}-" + "x" * 40: Info() for i in range(8)},  # longer than a link may be
        })
        queue = FastQueue()
        transfer_watch.bind_links(queue, manager)
        worker = Worker(queue)
        self.addCleanup(worker.stop)
        for room in (21, 22, 23, 24):
            queue.put(Chunk(room, 4))
        harness.wait_until(lambda: transfer_watch.held_chunk(queue) == 1, message="the first take")
        self.assertEqual(transfer_watch.worker_json(0, queue, time.monotonic())["in_flight"]["link"], "agent-a,agent-b")
        manager.transfer_infos.pop(21)  # sent: SGLang forgets the room
        worker.release(4)
        harness.wait_until(lambda: len(worker.done) == 4, message="four chunks")
        harness.wait_until(lambda: transfer_watch.held_chunk(queue) is None, message="the worker to wait")
        links = [f["link"] for f in transfer_watch.worker_json(0, queue, time.monotonic())["finished"]]
        self.assertEqual(links[:2], ["agent-a,agent-b", "10.0.0.7:17001"])
        self.assertTrue(links[2].startswith("sha256:") and len(links[2]) <= transfer_watch.MAX_LINK, links[2])
        self.assertEqual(links[3], "")  # a room SGLang no longer knows: the queue stands for its link

    def test_recent_keeps_the_last_32(self):
        queue = FastQueue()
        worker = Worker(queue)
        self.addCleanup(worker.stop)
        for pages in range(1, 41):
            queue.put(Chunk(1, pages))
        worker.release(40)
        harness.wait_until(lambda: len(worker.done) == 40, message="40 chunks")
        harness.wait_until(lambda: transfer_watch.held_chunk(queue) is None, message="the worker to wait")
        self.assertEqual([pages for pages, *_ in transfer_watch.state_of(queue).recent], list(range(9, 41)))

    def test_odd_items_never_raise_into_the_worker(self):
        queue = FastQueue()
        worker = Worker(queue)
        self.addCleanup(worker.stop)
        queue.put(object())  # no room, no indices, no flag
        harness.wait_until(lambda: transfer_watch.held_chunk(queue) == 1, message="the take")
        chunk = transfer_watch.state_of(queue).chunk
        self.assertEqual((chunk.room, chunk.pages, chunk.last_chunk), (-1, 0, False))
        # No room to list: the worker proves nothing, and the listing stays one the watchdog decodes.
        row = transfer_watch.worker_json(0, queue, time.monotonic())
        self.assertEqual((row["tracked"], row["in_flight"]), (False, None))

    def test_worker_waiting_before_the_watch_is_untracked_until_its_next_get(self):
        queue = LateQueue()
        worker = Worker(queue)
        self.addCleanup(worker.stop)
        time.sleep(0.05)  # the worker now waits inside the unwatched get
        self.assertTrue(transfer_watch.install(LateQueue))
        self.assertTrue(transfer_watch.install(LateQueue), "a second install must leave the watch as it is")
        queue.put(Chunk(5, 4))
        time.sleep(0.05)
        self.assertIsNone(transfer_watch.state_of(queue), "a take inside the unwatched get was seen")
        self.assertFalse(transfer_watch.worker_json(0, queue, time.monotonic())["tracked"])
        worker.release()
        harness.wait_until(lambda: transfer_watch.state_of(queue) is not None, message="the next get")
        queue.put(Chunk(6, 4))
        harness.wait_until(lambda: transfer_watch.held_chunk(queue) == 1, message="the first watched take")


class WedgeStateTest(unittest.TestCase):
    """wedge.WedgeOrders without threads: a worker state set by hand, the scheduler's apply() called directly."""

    def setUp(self):
        self.queue = FastQueue()
        self.workers = (self.queue,)
        self.hold(1)
        self.orders = wedge.WedgeOrders()
        self.mgr = standins.KVManager()

    def hold(self, number):
        chunk = transfer_watch.Chunk(number, 7, 4, True, time.monotonic())
        self.queue.__dict__[transfer_watch._STATE] = transfer_watch.WorkerState(number, chunk, ())

    def order(self, chunk=1, ttl=5.0, dry_run=False):
        return self.orders.order(self.workers, 0, chunk, ttl, 0.0, "test", dry_run, lambda: [])

    def apply(self, reqs, capabilities_for):
        facts = {id(r): monitor.RequestFacts(r.rid, r.bootstrap_room, "", 1, 0.0, False, 0) for r in reqs}
        return self.orders.apply(self.workers, reqs, lambda req, now: facts[id(req)], capabilities_for)

    def test_ineffective_levers_stop_the_order_and_its_next_call_says_so(self):
        sender = standins.MooncakeKVSender(self.mgr, 3, status=KVPoll.Transferring)
        sender.abort = lambda: None  # pulled, yet the sender does not read Failed
        self.assertEqual(self.order().status, 200)
        self.assertFalse(self.apply([standins.Req("c", 3, sender)],
                                    lambda s: capabilities.Capabilities((capabilities.ABORT,), "")))
        self.assertEqual(self.orders.listing(self.workers), [])
        outcome = self.order()
        self.assertEqual((outcome.status, outcome.body["result"], outcome.body["failed"]),
                         (500, "lever_ineffective", []))
        self.assertEqual(self.order().body["result"], "ordered", "no order stood after the 500")

    def test_renewal_keeps_the_count_and_a_moved_worker_voids_the_order(self):
        sender = standins.MooncakeKVSender(self.mgr, 4, status=KVPoll.Transferring)
        self.order()
        self.assertTrue(self.apply([standins.Req("d", 4, sender)], lambda s: capabilities.detect(
            type(s), type(s.kv_mgr), "")))
        outcome = self.order()
        self.assertEqual([room["rid"] for room in outcome.body["failed"]], ["d"])
        self.assertEqual(self.orders.listing(self.workers)[0]["rooms_failed"], 1)
        self.hold(2)
        self.assertEqual(self.orders.listing(self.workers), [], "a void order is listed")
        outcome = self.order()
        self.assertEqual((outcome.status, outcome.body["result"]), (409, "wedge_cleared"))
        self.assertEqual(self.orders.orders, {})

    def test_dry_run_leaves_a_standing_order_alone(self):
        self.order(ttl=5.0)
        outcome = self.order(ttl=0.01, dry_run=True)
        self.assertEqual(outcome.body["result"], "would_order")
        self.assertGreater(self.orders.listing(self.workers)[0]["expires_in_seconds"], 4)


class WedgeOrderTest(unittest.TestCase):
    def setUp(self):
        self.mgr = WorkerManager()
        self.workers = [Worker(queue) for queue in self.mgr.transfer_queues]
        for worker in self.workers:
            self.addCleanup(worker.stop)
        self.s = standins.NewScheduler(backend="nixl", tp_rank=0, dp_rank=0, pp_rank=0)
        self.s.disagg_prefill_bootstrap_queue.kv_manager = self.mgr
        self.rooms = iter(range(1000, 2000))

    def start(self):
        loop, monitor = harness.start_loop(self.s)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        self.monitor = monitor
        self.client = harness.Client(monitor.listener.port)

    def admit(self, queue, pages=4, rid=None, age=60.0, health=False):
        """A request on transfer queue ``queue`` (destination port = queue), its chunk put in that queue."""
        room = 0 if health else next(self.rooms)
        sender = standins.NixlKVSender(self.mgr, room, dst_ports=(queue,))
        req = standins.Req(rid or f"req-{room}", room, sender, entered=time.perf_counter() - age,
                           host=standins.FAKE_BOOTSTRAP_HOST if health else "10.0.0.7")
        self.mgr.transfer_queues[queue].put(Chunk(room, pages))
        self.s.disagg_prefill_inflight_queue.append(req)
        return req

    def listing(self):
        status, listing = self.client.get_json()
        self.assertEqual(status, 200)
        return listing

    def order(self, **fields):
        body = {"transfer_queue": 0, "chunk": 1, "ttl_seconds": 5, "min_age_seconds": 30, "reason": "test"}
        body.update(fields)
        return self.client.post_json("/admin/wedge_order", body)

    def test_validation_names_the_field(self):
        self.start()
        cases = [
            ({"transfer_queue": None}, "transfer_queue must be an integer >= 0"),
            ({"transfer_queue": -1}, "transfer_queue must be an integer >= 0"),
            ({"transfer_queue": True}, "transfer_queue must be an integer >= 0"),
            ({"chunk": 1.5}, "chunk must be an integer >= 0"),
            ({"chunk": "1"}, "chunk must be an integer >= 0"),
            ({"ttl_seconds": 0}, "ttl_seconds must be a number in (0, 300]"),
            ({"ttl_seconds": 301}, "ttl_seconds must be a number in (0, 300]"),
            ({"ttl_seconds": "5"}, "ttl_seconds must be a number in (0, 300]"),
            ({"min_age_seconds": -1}, "min_age_seconds must be a number >= 0"),
            ({"min_age_seconds": None}, "min_age_seconds must be a number >= 0"),
            ({"dry_run": "yes"}, "dry_run must be a boolean"),
            ({"reason": 7}, "reason must be a string"),
        ]
        for fields, error in cases:
            status, body = self.order(**fields)
            self.assertEqual((status, body["result"], body["failed"]), (400, "bad_request", []), fields)
            self.assertIn(error, body["error"], fields)
        for missing in ("transfer_queue", "chunk", "ttl_seconds"):
            body = {"transfer_queue": 0, "chunk": 1, "ttl_seconds": 5}
            del body[missing]
            status, answer = self.client.post_json("/admin/wedge_order", body)
            self.assertEqual((status, answer["error"].split(" ")[0]), (400, missing))
        status, body = self.client.post_json("/admin/wedge_order", None, raw=b'{"transfer_queue": 0, "chunk": 1, '
                                                                            b'"ttl_seconds": Infinity}')
        self.assertEqual(status, 400, body)
        status, body = self.order(transfer_queue=2)
        self.assertEqual((status, body["result"]), (404, "not_found"), body)

    def test_order_fails_the_wedged_queue_and_spares_the_rest(self):
        self.start()
        stuck = self.admit(0, pages=16)
        behind = self.admit(0)
        other = self.admit(1)
        health = self.admit(0, rid="HEALTH_CHECK_1", health=True)
        young = self.admit(0, age=0.0)
        harness.wait_until(lambda: transfer_watch.held_chunk(self.mgr.transfer_queues[0]) == 1, message="the take")
        harness.wait_until(lambda: len(self.listing()["inflight"]) == 5, message="the listing")

        listing = self.listing()
        self.assertIs(listing["server"]["transfer_progress"], True)
        q0, q1 = listing["transfer_workers"]
        self.assertEqual((q0["transfer_queue"], q0["tracked"], q0["depth"], q0["chunks_taken"]), (0, True, 3, 1))
        self.assertEqual((q0["in_flight"]["chunk"], q0["in_flight"]["bootstrap_room"], q0["in_flight"]["pages"]),
                         (1, stuck.bootstrap_room, 16))
        self.assertEqual(q1["in_flight"]["bootstrap_room"], other.bootstrap_room)
        queued = {room["rid"]: room["chunks_queued"] for room in listing["inflight"]}
        self.assertEqual(queued[stuck.rid], 0)
        self.assertEqual(queued[behind.rid], 1)
        self.assertEqual(listing["wedge_orders"], [])

        status, body = self.order(chunk=1, dry_run=True)
        self.assertEqual((status, body["result"]), (200, "would_order"), body)
        self.assertEqual({room["rid"] for room in body["failed"]}, {stuck.rid, behind.rid})
        time.sleep(0.05)
        self.assertIn(stuck, self.s.disagg_prefill_inflight_queue, "a dry run failed a room")

        status, body = self.order(chunk=1)
        self.assertEqual((status, body["result"], body["failed"]), (200, "ordered", []), body)
        self.assertGreater(body["expires_in_seconds"], 4)
        harness.wait_until(lambda: stuck not in self.s.disagg_prefill_inflight_queue
                           and behind not in self.s.disagg_prefill_inflight_queue, message="the release")
        self.assertEqual(self.listing()["wedge_orders"][0]["rooms_failed"], 2)
        status, body = self.order(chunk=1)
        self.assertEqual((status, body["result"]), (200, "ordered"), body)
        self.assertEqual({(r["rid"], tuple(r["levers"])) for r in body["failed"]},
                         {(stuck.rid, ("abort", "_send_failed")), (behind.rid, ("abort", "_send_failed"))})
        for spared in (other, health, young):
            self.assertIn(spared, self.s.disagg_prefill_inflight_queue)
        self.assertEqual(self.order(chunk=1)[1]["failed"], [], "a room was reported twice")

        self.workers[0].release()  # the wedge clears: the worker takes the next chunk
        harness.wait_until(lambda: transfer_watch.held_chunk(self.mgr.transfer_queues[0]) == 2, message="next take")
        late = self.admit(0)
        time.sleep(0.1)
        self.assertIn(late, self.s.disagg_prefill_inflight_queue, "a void order failed a room")
        self.assertEqual(self.listing()["wedge_orders"], [])
        status, body = self.order(chunk=1)
        self.assertEqual((status, body["result"], body["failed"]), (409, "wedge_cleared", []), body)
        self.assertIn("holds chunk 2, not chunk 1", body["error"])

    def test_order_lapses_after_its_ttl(self):
        self.start()
        self.admit(0)
        harness.wait_until(lambda: transfer_watch.held_chunk(self.mgr.transfer_queues[0]) == 1, message="the take")
        status, body = self.order(chunk=1, ttl_seconds=0.3, min_age_seconds=0)
        self.assertEqual(status, 200, body)
        harness.wait_until(lambda: not self.s.disagg_prefill_inflight_queue, message="the first release")
        time.sleep(0.4)
        self.assertEqual(self.listing()["wedge_orders"], [])
        late = self.admit(0)
        time.sleep(0.2)
        self.assertIn(late, self.s.disagg_prefill_inflight_queue, "an expired order failed a room")

    def test_unsupported_without_worker_queues(self):
        self.s.disagg_prefill_bootstrap_queue.kv_manager = standins.NewestNixlKVManager()
        self.start()
        listing = self.listing()
        self.assertIs(listing["server"]["transfer_progress"], False)
        self.assertIsNone(listing["transfer_workers"])
        status, body = self.order()
        self.assertEqual((status, body["result"], body["failed"]), (501, "unsupported", []), body)
        self.assertIn("transfer_progress is false", body["error"])


if __name__ == "__main__":
    unittest.main()
