import os
import time
import unittest

from . import harness, standins
from .standins import KVPoll


class ListingTest(unittest.TestCase):
    def start(self, scheduler):
        loop, monitor = harness.start_loop(scheduler)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        return loop, monitor, harness.Client(monitor.listener.port)

    def test_lists_rooms_with_ages_and_server_block(self):
        s = standins.NewScheduler(backend="nixl", tp_rank=0, dp_rank=0, pp_rank=0)
        mgr = standins.NewestNixlKVManager()
        now = time.perf_counter()
        s.disagg_prefill_inflight_queue = [
            standins.Req("stuck", 2**64 - 59, standins.NixlKVSender(mgr, 2**64 - 59, chunk_id=3),
                         prompt_tokens=4096, entered=now - 120),
            standins.Req("HEALTH_CHECK_1.0", 0, standins.FakeKVSender(standins.FakeKVManager()),
                         host=standins.FAKE_BOOTSTRAP_HOST, port=None, prompt_tokens=1, entered=now - 7),
        ]
        s.disagg_prefill_bootstrap_queue.queue = [object(), object()]
        s.waiting_queue = [object()]
        _, _, client = self.start(s)

        status, listing = client.get_json()
        self.assertEqual(status, 200)
        self.assertEqual(listing["api_version"], 1)
        self.assertEqual(listing["server"], {
            "pid": os.getpid(), "dp_rank": 0, "pp_rank": 0, "tp_rank": 0,
            "disaggregation_mode": "prefill", "transfer_backend": "nixl", "sglang_version": "unknown",
            "levers": ["abort", "_send_failed"], "lever_note": "", "pp_size": 1, "transfer_queues": 4,
            "transfer_tracking": True, "transfer_progress": False, "transfer_ranks": 1, "transfer_ranks_watched": 1,
        })
        self.assertEqual(listing["orphaned_transfers"], [])
        self.assertAlmostEqual(listing["now_unix"], time.time(), delta=5)
        self.assertGreater(listing["loop"]["iterations"], 0)
        self.assertAlmostEqual(listing["loop"]["last_iteration_unix"], time.time(), delta=5)
        self.assertEqual(listing["queues"], {"bootstrap": 2, "waiting": 1, "inflight": 2})

        stuck, health = listing["inflight"]
        self.assertEqual(stuck["rid"], "stuck")
        self.assertEqual(stuck["bootstrap_room"], 2**64 - 59)  # exact beyond 2^63
        self.assertEqual(stuck["bootstrap_addr"], "10.0.0.7:8998")
        self.assertEqual(stuck["poll"], "Transferring")
        self.assertEqual(stuck["prompt_tokens"], 4096)
        self.assertEqual(stuck["progress"], 3)
        self.assertIs(stuck["send_failed"], False)
        self.assertIs(stuck["health_check"], False)
        self.assertGreaterEqual(stuck["age_seconds"], 120)
        self.assertLess(stuck["age_seconds"], 130)

        self.assertEqual(health["poll"], "WaitingForInput")
        self.assertEqual(health["progress"], -1)
        self.assertEqual(health["bootstrap_addr"], standins.FAKE_BOOTSTRAP_HOST)
        self.assertIs(health["health_check"], True)
        self.assertGreaterEqual(health["age_seconds"], 7)

    def test_ages_grow_and_iterations_advance(self):
        s = standins.NewScheduler()
        mgr = standins.KVManager()
        s.disagg_prefill_inflight_queue = [standins.Req("r", 7, standins.NixlKVSender(mgr, 7))]
        loop, _, client = self.start(s)
        _, first = client.get_json()
        loop.wait_passes(20)
        time.sleep(0.2)
        _, second = client.get_json()
        self.assertGreater(second["loop"]["iterations"], first["loop"]["iterations"])
        self.assertGreater(second["inflight"][0]["age_seconds"], first["inflight"][0]["age_seconds"] + 0.15)

    def test_first_sight_when_entry_time_is_missing(self):
        s = standins.NewScheduler()
        req = standins.Req("r", 7, standins.NixlKVSender(standins.KVManager(), 7))
        req.time_stats = None
        s.disagg_prefill_inflight_queue = [req]
        _, _, client = self.start(s)
        _, listing = client.get_json()
        self.assertLess(listing["inflight"][0]["age_seconds"], 5)

    def test_poll_and_progress_per_backend(self):
        s = standins.OldScheduler(backend="mooncake")
        mgr = standins.KVManager()
        moving = standins.MooncakeKVSender(mgr, 11, status=KVPoll.Transferring, curr_idx=64)
        bootstrapping = standins.MooncakeKVSender(mgr, 12, status=KVPoll.Bootstrapping)
        cleared = standins.MooncakeKVSender(mgr, 13)
        del mgr.request_status[13]  # check_status raises KeyError now
        s.disagg_prefill_inflight_queue = [
            standins.Req("moving", 11, moving),
            standins.Req("bootstrapping", 12, bootstrapping),
            standins.Req("cleared", 13, cleared),
        ]
        loop, _, client = self.start(s)
        _, listing = client.get_json()
        by_rid = {room["rid"]: room for room in listing["inflight"]}
        self.assertEqual(by_rid["moving"]["poll"], "Transferring")
        self.assertEqual(by_rid["moving"]["progress"], 64)
        self.assertEqual(by_rid["bootstrapping"]["poll"], "Bootstrapping")
        self.assertEqual(by_rid["cleared"]["poll"], "Unknown")
        self.assertEqual(listing["server"]["transfer_backend"], "mooncake")

        moving.curr_idx = 96
        loop.wait_passes(5)
        time.sleep(0.15)  # past the re-observation interval
        loop.wait_passes(3)
        _, listing = client.get_json()
        self.assertEqual(listing["inflight"][0]["progress"], 96)

    def test_released_room_leaves_the_listing(self):
        s = standins.NewScheduler()
        mgr = standins.KVManager()
        s.disagg_prefill_inflight_queue = [
            standins.Req("done-soon", 21, standins.NixlKVSender(mgr, 21)),
            standins.Req("stays", 22, standins.NixlKVSender(mgr, 22)),
        ]
        loop, monitor, client = self.start(s)
        mgr.update_status(21, KVPoll.Success)
        harness.wait_until(lambda: len(s.disagg_prefill_inflight_queue) == 1)
        # The refresh after the releasing pass already dropped it.
        self.assertEqual([room["rid"] for room in client.get_json()[1]["inflight"]], ["stays"])
        self.assertEqual(client.get_json()[1]["queues"]["inflight"], 1)

    def test_malformed_requests_do_not_break_the_loop_or_the_listing(self):
        s = standins.NewScheduler()
        mgr = standins.KVManager()
        no_rid = standins.Req("x", 31, standins.NixlKVSender(mgr, 31))
        del no_rid.rid
        no_sender = standins.Req("no-sender", 32, None)
        broken_stats = standins.Req("broken-stats", 33, standins.NixlKVSender(mgr, 33))
        broken_stats.time_stats = "garbage"
        bare = standins.Req("bare", 34, standins.NixlKVSender(mgr, 34))
        for name in ("bootstrap_host", "bootstrap_port", "origin_input_ids"):
            delattr(bare, name)
        s.disagg_prefill_inflight_queue = [object(), None, no_rid, no_sender, broken_stats, bare,
                                           standins.Req("fine", 35, standins.NixlKVSender(mgr, 35))]
        loop, monitor, client = self.start(s)
        before = monitor.iterations
        loop.wait_passes(10)
        self.assertGreater(monitor.iterations, before)
        status, listing = client.get_json()
        self.assertEqual(status, 200)
        by_rid = {room["rid"]: room for room in listing["inflight"]}
        self.assertEqual(sorted(by_rid), ["bare", "broken-stats", "fine", "no-sender"])
        self.assertEqual(by_rid["no-sender"]["poll"], "Unknown")
        self.assertEqual(by_rid["no-sender"]["progress"], -1)
        self.assertEqual(by_rid["bare"]["bootstrap_addr"], "")
        self.assertEqual(by_rid["bare"]["prompt_tokens"], 0)
        self.assertEqual(by_rid["fine"]["poll"], "Transferring")
        self.assertEqual(listing["queues"]["inflight"], 7)

    def test_sender_that_raises_is_listed_as_unknown(self):
        class Exploding(standins.NixlKVSender):
            @property
            def chunk_id(self):
                raise RuntimeError("boom")

            @chunk_id.setter
            def chunk_id(self, value):
                pass

        s = standins.NewScheduler()
        s.disagg_prefill_inflight_queue = [standins.Req("boom", 41, Exploding(standins.KVManager(), 41))]
        loop, monitor, client = self.start(s)
        loop.wait_passes(3)
        room = client.get_json()[1]["inflight"][0]
        self.assertEqual((room["rid"], room["poll"], room["progress"]), ("boom", "Unknown", -1))


if __name__ == "__main__":
    unittest.main()
