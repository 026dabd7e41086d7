"""A TP2 prefill on SGLang's own code: a wedge on the non-leader rank, seen and released by the leader.

Two real prefill KV managers (engine ranks 0 and 1, registered with SGLang's
bootstrap server as SGLang's ranks register) each send their share of a
room to their decode peer (a TP2 decode, which SGLang's handshake maps rank
to rank); the plugin's leader runs on rank 0's scheduler, rank 1's hook
publishes its manager's ``_staging_outstanding`` (attn_tp_rank=1,
attn_tp_size=2), and the fabric hangs the room's transfer on rank 1 only.

Both ranks live in this process (conformance/tp2.py): everything is SGLang's
own code but torch.distributed's all_reduce over the attention TP group,
which cannot join two ranks of one process (torch.distributed holds one
rank per process); an in-process two-party MIN stands in for it, so SGLang's
pass sees the group's poll as it would: a room done on rank 0 stays in both
inflight queues while rank 1 sends.

What is asserted reads SGLang's objects (the managers' counts, the senders'
polls, the inflight queues, the finish reasons) and the leader's listing.
"""

import json
import time
import unittest

from sglang_watchdog_plugin import peers
from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance import aftermath, tp2, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

_rooms = iter(range(700000, 800000))

# Generous: the suite runs three releases side by side on two cores, and the plugin's peer files are
# written every 0.25 s by a thread of their own.
_WAIT_S = 20


def setUpModule():
    test_prefill.setUpModule()


class _Tp2(aftermath.Checked):
    backend = None

    def setUp(self):
        self.group = tp2.Tp2Group(test_prefill._RT, self.backend).start()
        self.addCleanup(self.group.stop)
        self.watch_aftermath(self.group)
        self.tracking = hasattr(self.group.prefill_mgrs[0], "_staging_outstanding")

    def tearDown(self):
        self.check_aftermath()
        self.assertEqual(self.group.errors, [], "SGLang's pass raised: a real scheduler would have died")

    # The leader's API -----------------------------------------------------

    def listing(self):
        return bench_module.get_json(self.group.url + "/debug/inflight")

    def force_fail(self, req):
        return bench_module.post_json(self.group.url + "/admin/force_fail",
                                      {"rid": req.rid, "bootstrap_room": req.bootstrap_room, "reason": "conformance tp2"})

    def eventually(self, predicate, what):
        """The latest listing once ``predicate(listing)`` holds (a listing is a moment; the files age)."""
        seen = {}

        def check():
            seen["listing"] = self.listing()
            return predicate(seen["listing"])

        try:
            _until(check, _WAIT_S, what)
        except TimeoutError:
            self.fail(f"{what}; last listing: {json.dumps(seen.get('listing'))[:2000]}")
        return seen["listing"]

    # SGLang's objects -----------------------------------------------------

    def outstanding(self, rank, room):
        return self.group.prefill_mgrs[rank]._staging_outstanding.get(room, 0)

    def poll_name(self, req):
        return test_prefill._RT.poll_names[int(req.disagg_kv_sender.poll())]

    def wedge_on_rank_1(self):
        """A room rank 0 sent in full while rank 1's share hangs, as SGLang's objects tell it."""
        room = next(_rooms)
        reqs = self.group.admit(room, transports.COMPLETE, per_rank={1: transports.HANG})
        _until(lambda: self.poll_name(reqs[0]) == "Success", _WAIT_S, "rank 0's share to be sent")
        hung = lambda: [t.rank for t in transports.fabric.in_flight(room)]
        _until(lambda: hung() == [1], _WAIT_S, "rank 1's share to hang in the fabric")
        if self.tracking:
            _until(lambda: self.outstanding(1, room) > 0, _WAIT_S, "rank 1's manager to count its hung chunk")
            self.assertEqual(self.outstanding(0, room), 0, "rank 0 sent everything, yet its manager counts a chunk")
            # The leader knows of rank 1's chunk once rank 1 published it (every 0.25 s): an order that comes
            # before meets a room whose chunks look all sent, as a watchdog's first try may (it tries again).
            # The listing alone does not prove the file: until its next re-read, the leader's own snapshot
            # may still count rank 0's chunk in flight. So the file itself, then the listing.
            def published_in_flight():
                with open(self.group.publisher.path) as f:
                    return json.load(f).get("in_flight", {}).get(str(room), 0) > 0

            _until(published_in_flight, _WAIT_S, "rank 1 to publish its hung chunk")
            self.eventually(lambda l: any(r["bootstrap_room"] == room and r["transfer_in_flight"]
                                          for r in l["inflight"]),
                            "the leader to list the room in flight")
        return room, reqs

    # Scenarios ------------------------------------------------------------

    def test_non_leader_wedge_is_seen_released_then_unwatched(self):
        if not self.tracking:
            self.skipTest("this release's KV managers keep no per-room count (_staging_outstanding): "
                          "see test_without_counts_no_rank_is_watched")
        room, reqs = self.wedge_on_rank_1()
        rid = reqs[0].rid

        # SGLang's MIN over the group holds the room in both queues: rank 0's own Success is not the group's.
        time.sleep(0.3)
        self.assertTrue(self.group.queued(0, rid) and self.group.queued(1, rid),
                        "the room left an inflight queue while rank 1 still sends")
        listing = self.eventually(
            lambda l: l["server"]["transfer_ranks_watched"] == 2
            and any(r["bootstrap_room"] == room and r["transfer_in_flight"] for r in l["inflight"]),
            "the leader to list the room in flight with both ranks watched")
        self.assertEqual(listing["server"]["transfer_ranks"], 2)
        self.assertTrue(listing["server"]["transfer_tracking"])
        # Rank 1's worker, as rank 1 published it: the watchdog judges the hung chunk by rank 1's worker and link.
        listing = self.eventually(lambda l: any(
            w["in_flight"] and w["in_flight"]["bootstrap_room"] == room
            for p in l.get("peer_transfer_workers") or [] for w in p["transfer_workers"]),
            "the leader to list rank 1's worker holding the room's chunk")
        self.assertEqual([p["rank"] for p in listing["peer_transfer_workers"]], ["tp1-cp0"])
        self.assertTrue(all(w["tracked"] for w in listing["peer_transfer_workers"][0]["transfer_workers"]))
        if listing["server"]["transfer_progress"]:
            self.assertFalse(any(w["in_flight"] and w["in_flight"]["bootstrap_room"] == room
                                 for w in listing["transfer_workers"]), "the leader's own worker holds rank 1's chunk")

        # The watchdog's order, through the leader: SGLang's abort() lever flips rank 0 (whose own poll reads
        # Success), and the group's MIN fails the room on both ranks.
        status, body = self.force_fail(reqs[0])
        self.assertEqual((status, body.get("result")), (200, "flipped"), body)
        for rank in (0, 1):
            _until(lambda: self.group.released(rank, rid) is not None, _WAIT_S, f"rank {rank} to release {rid}")
            self.assertEqual(type(self.group.released(rank, rid)).__name__, "FINISH_ABORT")
            self.assertIn(rid, self.group.schedulers[rank].tree_cache.released,
                          f"rank {rank} did not hand its KV pages back")

        # Released on the group, yet rank 1's worker still holds the chunk: decode must keep its pages.
        self.assertGreater(self.outstanding(1, room), 0, "rank 1's hung chunk was forgotten by its manager")
        self.assertEqual([t.rank for t in transports.fabric.in_flight(room)], [1])
        listing = self.eventually(
            lambda l: any(o["bootstrap_room"] == room and o["outstanding_chunks"] > 0
                          for o in l["orphaned_transfers"]),
            "the released room to show as an orphaned transfer of the group")
        self.assertFalse(any(r["bootstrap_room"] == room for r in listing["inflight"]))
        self.assertEqual(listing["server"]["transfer_ranks_watched"], 2, listing["server"])

        # Rank 1 stops publishing (its process wedged or gone): its file goes stale and the leader stops
        # counting it as watched, which makes the watchdog's verdict fail closed.
        self.group.publisher.stop()
        listing = self.eventually(lambda l: l["server"]["transfer_ranks_watched"] == 1,
                                  f"rank 1 to drop out of the watched ranks {peers.FRESH_S:g} s after its last file")
        self.assertEqual(listing["server"]["transfer_ranks"], 2)

    def test_both_ranks_quiet_after_a_release(self):
        """The case the watchdog may answer "stopped" for: every rank watched, no chunk of the room anywhere."""
        if not self.tracking:
            self.skipTest("this release's KV managers keep no per-room count (_staging_outstanding)")
        room, reqs = self.wedge_on_rank_1()
        status, body = self.force_fail(reqs[0])
        self.assertEqual((status, body.get("result")), (200, "flipped"), body)
        # The wedge clears: the late write lands and rank 1's worker settles its chunk. (Cleared as an error
        # instead, v0.5.18's NIXL worker raises out of its loop before decrementing the count, so the room
        # stays outstanding on rank 1 for good: that fails closed, and is not this test's case.)
        transports.fabric.end_hangs([room], transports.COMPLETE)
        _until(lambda: self.outstanding(1, room) == 0, _WAIT_S, "rank 1's worker to settle its chunk")
        self.assertEqual(transports.fabric.in_flight(room), [])
        self.eventually(
            lambda l: l["server"]["transfer_ranks_watched"] == 2
            and not any(o["bootstrap_room"] == room for o in l["orphaned_transfers"])
            and not any(r["bootstrap_room"] == room for r in l["inflight"]),
            "the room to be quiet on both watched ranks")

    def test_a_room_queued_behind_wedges_is_never_written_after_its_release(self):
        """The "stopped" case the watchdog meets in practice: a room whose chunks wait behind a hung one on every
        rank (one transfer queue per rank here), so none is in flight anywhere. Released, SGLang's pass clears its
        status and transfer info on both ranks, and when the wedges clear its chunks are dropped unsent: decode
        may free its pages."""
        if not self.tracking:
            self.skipTest("this release's KV managers keep no per-room count (_staging_outstanding)")
        pinned, queued = next(_rooms), next(_rooms)
        self.group.admit(pinned, transports.HANG)
        _until(lambda: sorted(t.rank for t in transports.fabric.in_flight(pinned)) == [0, 1], _WAIT_S,
               "the pinned room to hang on both ranks")
        reqs = self.group.admit(queued, transports.COMPLETE)
        rid = reqs[0].rid
        self.eventually(
            lambda l: l["server"]["transfer_ranks_watched"] == 2 and any(
                r["bootstrap_room"] == queued and not r["transfer_in_flight"] and r["chunks_queued"]
                for r in l["inflight"]),
            "the leader to list the queued room with its chunk queued and none in flight")
        self.assertEqual(transports.fabric.of_room(queued), [], "a chunk of the queued room reached the fabric")
        self.assertEqual((self.outstanding(0, queued), self.outstanding(1, queued)), (0, 0))

        status, body = self.force_fail(reqs[0])
        self.assertEqual((status, body.get("result")), (200, "flipped"), body)
        for rank in (0, 1):
            _until(lambda: self.group.released(rank, rid) is not None, _WAIT_S, f"rank {rank} to release {rid}")
            self.assertEqual(type(self.group.released(rank, rid)).__name__, "FINISH_ABORT")

        # The wedges clear: both workers move on to the released room's chunks, which must never be sent.
        transports.fabric.end_hangs([pinned], transports.COMPLETE)
        _until(lambda: transports.fabric.in_flight(pinned) == [] and all(
            not queue._buf for r in (0, 1) for queue in self.group.prefill_mgrs[r].transfer_queues), _WAIT_S,
            "both ranks' workers to drain their queues")
        time.sleep(0.3)  # a worker that dequeued the chunk last has had time to post it
        self.assertEqual(transports.fabric.of_room(queued), [], "a rank wrote the released room's KV")
        for rank in (0, 1):
            left = self.outstanding(rank, queued)
            if not left:
                continue
            # Upstream main (after v0.5.18) counts a chunk when its worker dequeues it, before the status
            # check; a released room whose transfer info is gone then raises before anything is posted,
            # and the worker's except path keeps the count on purpose (nixl/conn.py transfer_worker: "No
            # ack here on purpose"). SGLang's own bookkeeping: nothing was written (above), and the room's
            # exception is recorded where SGLang's sender reads it.
            exceptions = getattr(self.group.prefill_mgrs[rank], "exceptions", None) or {}
            self.assertIn(queued, exceptions,
                          f"rank {rank} counts {left} outstanding chunk(s) of the released room with no exception "
                          "recorded for it")

    def test_a_room_done_on_the_leader_and_queued_on_rank_1_is_released(self):
        """Rank 0 sent its share; rank 1's waits in its worker queue behind a hung chunk, so no rank has it in
        flight, yet SGLang's MIN holds it on both ranks until rank 1's worker gets to it. The leader must not
        answer "transfer_succeeded" (nothing would ever release it); released, rank 1 drops the chunk unsent."""
        if not self.tracking:
            self.skipTest("this release's KV managers keep no per-room count (_staging_outstanding)")
        _, wedge = self.wedge_on_rank_1()
        queued = next(_rooms)
        reqs = self.group.admit(queued, transports.COMPLETE)
        rid = reqs[0].rid
        _until(lambda: self.poll_name(reqs[0]) == "Success", _WAIT_S, "rank 0's share to be sent")

        def published_queued():
            with open(self.group.publisher.path) as f:
                return json.load(f).get("queued", {}).get(str(queued), 0) > 0

        _until(published_queued, _WAIT_S, "rank 1 to publish the room's chunk as waiting in its queue")
        self.assertEqual({t.rank for t in transports.fabric.of_room(queued)}, {0}, "rank 1 sent its share")
        time.sleep(0.3)
        self.assertTrue(self.group.queued(0, rid) and self.group.queued(1, rid), "SGLang let the room go")
        listing = self.listing()
        row = next(r for r in listing["inflight"] if r["bootstrap_room"] == queued)
        self.assertFalse(row["transfer_in_flight"], "a chunk waiting in a queue was reported in flight")
        # The watchdog reads it as waiting on another rank (not a silent pin), behind the worker that holds the
        # wedged chunk: it is released once that chunk is overdue at rank 1's link speed.
        self.assertGreaterEqual(row["peer_chunks_queued"], 1, row)
        behind = [room for p in listing["peer_transfer_workers"] for w in p["transfer_workers"]
                  if w["in_flight"] and w["in_flight"]["bootstrap_room"] == wedge[0].bootstrap_room
                  for room in w["queued_rooms"]]
        self.assertIn(queued, behind, listing["peer_transfer_workers"])

        status, body = self.force_fail(reqs[0])
        self.assertEqual((status, body.get("result")), (200, "flipped"), body)
        for rank in (0, 1):
            _until(lambda: self.group.released(rank, rid) is not None, _WAIT_S, f"rank {rank} to release {rid}")
            self.assertEqual(type(self.group.released(rank, rid)).__name__, "FINISH_ABORT")
        transports.fabric.end_hangs([wedge[0].bootstrap_room], transports.COMPLETE)
        _until(lambda: not any(queue._buf for queue in self.group.prefill_mgrs[1].transfer_queues), _WAIT_S,
               "rank 1's worker to drain its queue")
        time.sleep(0.3)  # a worker that dequeued the chunk last has had time to post it
        self.assertEqual({t.rank for t in transports.fabric.of_room(queued)}, {0},
                         "rank 1 wrote the released room's KV")

    def test_without_counts_no_rank_is_watched(self):
        """Releases whose managers keep no per-room count: the group is never fully watched (fail closed)."""
        if self.tracking:
            self.skipTest("this release keeps _staging_outstanding: the other tests cover it")
        room, reqs = self.wedge_on_rank_1()
        time.sleep(0.3)
        self.assertTrue(self.group.queued(0, reqs[0].rid) and self.group.queued(1, reqs[0].rid),
                        "the room left an inflight queue while rank 1 still sends")
        listing = self.eventually(lambda l: any(r["bootstrap_room"] == room for r in l["inflight"]),
                                  "the leader to list the room")
        server = listing["server"]
        self.assertEqual((server["transfer_tracking"], server["transfer_ranks"], server["transfer_ranks_watched"]),
                         (False, 2, 0), server)
        # Rank 1 does publish, and says it cannot count: its file is there, fresh, and not believed.
        with open(self.group.publisher.path) as f:
            self.assertIs(json.load(f)["tracking"], False)
        # So the leader, whose share is sent, can neither fail the room (the group may have sent it in full) nor
        # promise that SGLang's Success branch releases it (rank 1 still sends).
        status, body = self.force_fail(reqs[0])
        if body.get("result") == "unsupported":  # no lever on this release's sender: refused before anything else
            self.assertEqual(status, 501, body)
        else:
            self.assertEqual((status, body.get("result"), body.get("ranks")), (409, "group_unwatched", ["tp1-cp0"]),
                             body)
        self.assertEqual(self.poll_name(reqs[0]), "Success", "the leader's Success was overwritten")
        time.sleep(0.3)
        self.assertTrue(self.group.queued(0, reqs[0].rid) and self.group.queued(1, reqs[0].rid))


class Nixl(_Tp2, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Tp2, unittest.TestCase):
    backend = "mooncake"


if __name__ == "__main__":
    unittest.main()
