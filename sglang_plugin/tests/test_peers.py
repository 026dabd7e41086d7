"""Issue 18: the leader's listing covers every rank of its attention TP/CP group (peers.py).

Each prefill rank of the group sends its own share of a room's KV from its
own transfer workers; a room is in flight while any rank has a chunk of it
outstanding, and the listing may say "not in flight" only for ranks it read.
"""

import json
import tempfile
import time
import types
import unittest
from unittest import mock

from sglang_watchdog_plugin import hook, peers, transfer_watch
from sglang_watchdog_plugin.identity import identify

from . import harness, standins, test_wedge


def _group_scheduler(attn_tp_rank, attn_tp_size=2):
    return standins.NewScheduler(backend="nixl", tp_rank=attn_tp_rank, dp_rank=0, attn_tp_rank=attn_tp_rank,
                                 attn_tp_size=attn_tp_size)


def _counts(view):
    return view.watched, view.in_flight


class PeerFilesTest(unittest.TestCase):
    def setUp(self):
        self.folder = tempfile.mkdtemp()
        self.leader = identify(_group_scheduler(0, attn_tp_size=3))

    def publish(self, attn_tp_rank, counts):
        manager = standins.NewestNixlKVManager()
        manager._staging_outstanding.update(counts)
        ident = identify(_group_scheduler(attn_tp_rank, attn_tp_size=3))
        peers.Publisher(self.folder, ident, manager).publish()
        return peers._file(self.folder, attn_tp_rank, 0)

    def test_counts_of_every_fresh_rank_are_summed(self):
        self.publish(1, {7: 1, 8: 0})
        self.publish(2, {7: 2, 9: 1})
        self.assertEqual(_counts(peers.Group(self.folder, self.leader).read()), (2, {7: 3, 9: 1}))

    def test_a_room_waiting_in_a_worker_queue_is_sent_but_not_in_flight(self):
        """Queued chunks hold the room on that rank (sending) but are not in flight: a released room's are
        dropped unsent, so they must not keep decode from freeing its pages."""
        manager = standins.NewestNixlKVManager()
        manager.transfer_queues = [types.SimpleNamespace(_buf=[types.SimpleNamespace(room=11)])]
        ident = identify(_group_scheduler(1, attn_tp_size=3))
        peers.Publisher(self.folder, ident, manager).publish()
        group = peers.Group(self.folder, self.leader)
        self.assertEqual(_counts(group.read()), (1, {}))
        self.assertEqual(group.sending(11), (True, []))
        self.assertEqual(group.sending(12), (False, ["tp2-cp0"]), "rank 2 never published: it may be sending 12")

    def test_each_ranks_workers_and_queued_chunks_are_merged(self):
        """Rank 1's worker holds a chunk of room 21 with room 22 queued behind it: the leader lists that worker as
        rank 1's (the watchdog judges the chunk by rank 1's own worker and link) and room 22's chunk as queued."""
        manager = test_wedge.WorkerManager()
        workers = [test_wedge.Worker(queue) for queue in manager.transfer_queues]
        for worker in workers:
            self.addCleanup(worker.stop)
        harness.wait_until(lambda: all(transfer_watch.state_of(q) is not None for q in manager.transfer_queues),
                           message="the workers to wait in get()")
        manager.transfer_queues[1].put(test_wedge.Chunk(21, 8))
        manager.transfer_queues[1].put(test_wedge.Chunk(22, 4))
        harness.wait_until(lambda: transfer_watch.held_chunk(manager.transfer_queues[1]) == 1, message="the take")
        manager._staging_outstanding[21] += 1
        peers.Publisher(self.folder, identify(_group_scheduler(1, attn_tp_size=3)), manager).publish()

        view = peers.Group(self.folder, self.leader).read()
        self.assertEqual((view.watched, view.in_flight, view.queued), (1, {21: 1}, {22: 1}))
        self.assertEqual([entry["rank"] for entry in view.workers], ["tp1-cp0"])
        held = view.workers[0]["transfer_workers"][1]
        self.assertEqual((held["transfer_queue"], held["depth"], held["in_flight"]["bootstrap_room"],
                          held["in_flight"]["pages"], held["queued_rooms"]), (1, 1, 21, 8, [22]))
        self.assertIsNone(view.workers[0]["transfer_workers"][0]["in_flight"])

    def test_a_file_replaced_while_it_is_read_is_fresh(self):
        """A rank rewrites its file every 0.25 s; a leader whose thread lost the CPU between reading the clock
        and reading the file met a file written after that clock and took it for stale (seen in CI, where the
        leader then answered transfer_succeeded for a room rank 1 still sent)."""
        self.publish(1, {7: 1})
        self.publish(2, {})
        group = peers.Group(self.folder, self.leader)
        read = peers._read

        def republished_then_read(folder, name):
            time.sleep(0.01)
            self.publish(int(name.rsplit("rank-tp", 1)[1].split("-")[0]), {7: 1})
            return read(folder, name)

        with mock.patch.object(peers, "_read", republished_then_read):
            self.assertEqual(_counts(group.read()), (2, {7: 2}))
            self.assertEqual(group.sending(7), (True, []))
            self.assertEqual(group.sending(8), (False, []))

    def test_missing_stale_untracked_or_corrupt_ranks_are_not_watched(self):
        group = peers.Group(self.folder, self.leader)
        self.publish(1, {7: 1})
        self.assertEqual(_counts(group.read()), (1, {7: 1}), "rank 2 never published")
        self.assertEqual(_counts(group.read(time.time() + peers.FRESH_S + 1)), (0, {}), "rank 1's file went stale")

        path = self.publish(2, {})
        with open(path) as f:
            body = json.load(f)
        body["tracking"] = False  # a manager without _staging_outstanding: its empty count proves nothing
        with open(path, "w") as f:
            json.dump(body, f)
        self.assertEqual(_counts(group.read()), (1, {7: 1}))
        with open(path, "w") as f:
            f.write('{"tracking": true, "written_unix": ')  # cut short
        self.assertEqual(_counts(group.read()), (1, {7: 1}))
        body.update(tracking=True, in_flight={"7": "many"})
        with open(path, "w") as f:
            json.dump(body, f)
        self.assertEqual(_counts(group.read()), (1, {7: 1}), "a rank with an unreadable count must not pass for quiet")

    def test_a_count_without_items_is_untracked(self):
        class Manager:
            _staging_outstanding = None

        self.assertIsNone(peers.outstanding(Manager()))
        self.assertIsNone(peers.outstanding(object()))


class GroupListingTest(unittest.TestCase):
    """A TP2 group through the hook, as SGLang's two scheduler processes would run it."""

    def setUp(self):
        self.folder = tempfile.mkdtemp()
        self.env = harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_PEER_DIR=self.folder)

    def start(self, scheduler):
        loop, monitor = harness.start_loop(scheduler, env=self.env)
        self.addCleanup(loop.stop)
        if monitor is not None:
            self.addCleanup(monitor.close)
        return monitor

    def test_a_chunk_in_flight_on_the_other_rank_is_in_flight(self):
        room = 4242
        leader = _group_scheduler(0)
        leader_mgr = standins.NewestNixlKVManager()
        leader.disagg_prefill_inflight_queue = [standins.Req("r", room, standins.NixlKVSender(leader_mgr, room))]
        other = _group_scheduler(1)
        other_mgr = standins.NewestNixlKVManager()
        other.disagg_prefill_bootstrap_queue.kv_manager = other_mgr
        other.disagg_prefill_inflight_queue = [standins.Req("r", room, standins.NixlKVSender(other_mgr, room))]

        monitor = self.start(leader)
        client = harness.Client(monitor.listener.port)
        _, listing = client.get_json()
        self.assertEqual((listing["server"]["transfer_ranks"], listing["server"]["transfer_ranks_watched"]), (2, 1),
                         "rank 1 has not published yet: only the leader is watched")

        self.assertIsNone(self.start(other), "a non-leader serves no listing")
        publisher = hook._publishers[other]
        self.addCleanup(publisher.stop)
        other_mgr._staging_outstanding[room] += 1  # rank 1's worker took a chunk of the room; the leader's did not
        harness.wait_until(lambda: client.get_json()[1]["server"]["transfer_ranks_watched"] == 2
                           and client.get_json()[1]["inflight"][0]["transfer_in_flight"] is True,
                           message="the leader never saw rank 1's chunk in flight")

        leader.disagg_prefill_inflight_queue = []  # released on the leader; rank 1 still sends
        harness.wait_until(lambda: [o["bootstrap_room"] for o in client.get_json()[1]["orphaned_transfers"]] == [room],
                           message="rank 1's chunk of a released room is not listed as an orphan")

        other_mgr._staging_outstanding.pop(room)
        harness.wait_until(lambda: client.get_json()[1]["orphaned_transfers"] == [], message="the orphan stayed")
        publisher.stop()
        with mock.patch.object(peers, "FRESH_S", 0.5):
            harness.wait_until(lambda: client.get_json()[1]["server"]["transfer_ranks_watched"] == 1,
                               message="a rank that stopped publishing still counts as watched")


if __name__ == "__main__":
    unittest.main()
