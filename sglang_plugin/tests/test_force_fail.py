import threading
import time
import unittest

from . import harness, standins
from .standins import KVPoll

NIXL_ROOM = 9223372036854775001
MOONCAKE_ROOM = 18446744073709551557


class ForceFailTest(unittest.TestCase):
    def setUp(self):
        self.mgr = standins.KVManager()
        self.nixl = standins.NixlKVSender(self.mgr, NIXL_ROOM, chunk_id=3)
        self.mooncake = standins.MooncakeKVSender(self.mgr, MOONCAKE_ROOM)
        self.fake = standins.FakeKVSender(standins.FakeKVManager())
        self.scheduler = standins.NewScheduler()
        self.scheduler.disagg_prefill_inflight_queue = [
            standins.Req("nixl-1", NIXL_ROOM, self.nixl),
            standins.Req("mooncake-1", MOONCAKE_ROOM, self.mooncake),
            standins.Req("HEALTH_CHECK_1.0", 0, self.fake, host=standins.FAKE_BOOTSTRAP_HOST, port=None),
        ]
        self.loop, self.monitor = harness.start_loop(self.scheduler)
        self.addCleanup(self.loop.stop)
        self.addCleanup(self.monitor.close)
        self.client = harness.Client(self.monitor.listener.port)

    def rids(self):
        return [room["rid"] for room in self.client.get_json()[1]["inflight"]]

    def test_flip_nixl_releases_through_the_failed_branch(self):
        status, body = self.client.force_fail(
            {"rid": "nixl-1", "bootstrap_room": NIXL_ROOM, "reason": "stuck 812s", "extra": [1, 2]})
        self.assertEqual(status, 200)
        self.assertEqual(body["result"], "flipped")
        self.assertEqual(body["rid"], "nixl-1")
        self.assertEqual(body["bootstrap_room"], NIXL_ROOM)
        self.assertEqual(body["lever"], "_send_failed")
        self.assertEqual(body["levers"], ["abort", "_send_failed"])
        self.assertAlmostEqual(body["applied_unix"], time.time(), delta=5)
        self.assertIn("stuck 812s", self.mgr.failure_records[NIXL_ROOM])

        harness.wait_until(lambda: self.scheduler.num_transfer_failed_reqs == 1)
        self.assertNotIn("nixl-1", self.rids())
        self.assertEqual(self.scheduler.released[0].rid, "nixl-1")

    def test_flip_mooncake_pulls_abort(self):
        status, body = self.client.force_fail({"rid": "mooncake-1"})
        self.assertEqual((status, body["result"], body["lever"], body["levers"]),
                         (200, "flipped", "conclude_state", ["abort"]))
        self.assertEqual(body["bootstrap_room"], MOONCAKE_ROOM)
        self.assertEqual(self.mooncake.conclude_state, KVPoll.Failed)
        harness.wait_until(lambda: self.scheduler.num_transfer_failed_reqs == 1)
        self.assertEqual(self.rids(), ["nixl-1", "HEALTH_CHECK_1.0"])

    def test_health_check_is_refused_at_once_and_untouched(self):
        for dry_run in (False, True):
            status, body = self.client.force_fail({"rid": "HEALTH_CHECK_1.0", "bootstrap_room": 0, "dry_run": dry_run})
            self.assertEqual((status, body["result"], body["rid"], body["bootstrap_room"]),
                             (409, "health_check", "HEALTH_CHECK_1.0", 0))
            self.assertIn("error", body)
        self.loop.wait_passes(3)
        self.assertEqual(self.fake.write_threads, [])
        self.assertIn("HEALTH_CHECK_1.0", self.rids())

    def test_levers_are_set_only_on_the_scheduler_thread(self):
        for rid in ("nixl-1", "mooncake-1"):
            self.assertEqual(self.client.force_fail({"rid": rid})[0], 200)
        loop_thread = self.loop.thread.ident
        # NIXL: abort() sets conclude_state, then the flip; Mooncake: abort() sets conclude_state.
        self.assertEqual(self.nixl.write_threads, [loop_thread, loop_thread])
        self.assertEqual(self.mooncake.write_threads, [loop_thread])
        self.assertNotEqual(loop_thread, threading.get_ident())

    def test_dry_run_changes_nothing(self):
        status, body = self.client.force_fail({"rid": "nixl-1", "bootstrap_room": NIXL_ROOM, "dry_run": True})
        self.assertEqual(status, 200)
        self.assertEqual(body["result"], "would_flip")
        self.assertEqual(body["lever"], "_send_failed")
        self.assertEqual(body["levers"], ["abort", "_send_failed"])
        self.assertIn("applied_unix", body)
        self.loop.wait_passes(5)
        self.assertFalse(self.nixl._send_failed)
        self.assertEqual(self.nixl.write_threads, [])
        self.assertIn("nixl-1", self.rids())

    def test_not_found_and_room_mismatch_from_the_snapshot(self):
        status, body = self.client.force_fail({"rid": "nope", "bootstrap_room": 5})
        self.assertEqual(status, 404)
        self.assertEqual(body["result"], "not_found")
        self.assertEqual(body["rid"], "nope")
        self.assertIn("error", body)

        status, body = self.client.force_fail({"rid": "nixl-1", "bootstrap_room": MOONCAKE_ROOM})
        self.assertEqual(status, 409)
        self.assertEqual(body["result"], "room_mismatch")
        self.assertEqual(body["rid"], "nixl-1")
        self.assertEqual(body["bootstrap_room"], NIXL_ROOM)
        self.assertIn("error", body)
        self.assertEqual(self.nixl.write_threads, [])

    def test_scheduler_rechecks_membership_against_the_live_queue(self):
        self.loop.pause()
        # The published snapshot still lists nixl-1 and mooncake-1 with their
        # rooms, but the live queue lost nixl-1 and holds mooncake-1 with another room.
        replacement = standins.Req("mooncake-1", 77, standins.MooncakeKVSender(self.mgr, 77))
        self.scheduler.disagg_prefill_inflight_queue = [replacement]
        results = {}

        def ask(rid, room):
            results[rid] = self.client.force_fail({"rid": rid, "bootstrap_room": room})

        threads = [threading.Thread(target=ask, args=("nixl-1", NIXL_ROOM)),
                   threading.Thread(target=ask, args=("mooncake-1", MOONCAKE_ROOM))]
        for t in threads:
            t.start()
        harness.wait_until(lambda: len(self.monitor._orders) == 2)
        self.loop.resume()
        for t in threads:
            t.join(10)
        self.assertEqual((results["nixl-1"][0], results["nixl-1"][1]["result"]), (404, "not_found"))
        self.assertEqual(results["mooncake-1"][0], 409)
        self.assertEqual(results["mooncake-1"][1]["bootstrap_room"], 77)
        self.assertEqual(replacement.disagg_kv_sender.write_threads, [])

    def test_scheduler_unresponsive_withdraws_the_order_for_good(self):
        self.monitor.order_timeout = 0.3
        self.loop.pause()
        started = time.monotonic()
        status, body = self.client.force_fail({"rid": "nixl-1", "bootstrap_room": NIXL_ROOM})
        self.assertEqual(status, 503)
        self.assertEqual(body["result"], "scheduler_unresponsive")
        self.assertEqual(body["rid"], "nixl-1")
        self.assertIn("error", body)
        self.assertGreaterEqual(time.monotonic() - started, 0.3)

        self.loop.resume()
        self.loop.wait_passes(20)
        self.assertFalse(self.nixl._send_failed)
        self.assertEqual(self.nixl.write_threads, [])
        self.assertNotIn(NIXL_ROOM, self.mgr.failure_records)
        self.assertEqual(self.scheduler.num_transfer_failed_reqs, 0)
        self.assertIn("nixl-1", self.rids())
        self.assertEqual(len(self.monitor._orders), 0)

    def test_withdrawn_orders_leave_the_queue_at_once(self):
        # While the loop is stuck, no pass would ever clear them.
        self.monitor.order_timeout = 0.05
        self.loop.pause()
        for _ in range(5):
            status, body = self.client.force_fail({"rid": "nixl-1", "bootstrap_room": NIXL_ROOM})
            self.assertEqual((status, body["result"]), (503, "scheduler_unresponsive"))
            self.assertEqual(len(self.monitor._orders), 0)
        self.loop.resume()
        self.loop.wait_passes(5)
        self.assertEqual(self.nixl.write_threads, [])
        self.assertIn("nixl-1", self.rids())

    def test_pending_orders_are_bounded(self):
        self.monitor.max_pending_orders = 2
        self.loop.pause()
        results = {}

        def ask(rid):
            results[rid] = self.client.force_fail({"rid": rid, "dry_run": True})

        threads = [threading.Thread(target=ask, args=(rid,)) for rid in ("nixl-1", "mooncake-1")]
        for t in threads:
            t.start()
        harness.wait_until(lambda: len(self.monitor._orders) == 2)

        started = time.monotonic()
        status, body = self.client.force_fail({"rid": "nixl-1", "bootstrap_room": NIXL_ROOM})
        self.assertLess(time.monotonic() - started, 1.0)  # not queued, so not waited for
        self.assertEqual(status, 503)
        self.assertEqual(set(body), {"result", "rid", "error"})
        self.assertEqual((body["result"], body["rid"]), ("scheduler_unresponsive", "nixl-1"))
        self.assertEqual(len(self.monitor._orders), 2)

        self.loop.resume()
        for t in threads:
            t.join(10)
        self.assertEqual({rid: (status, body["result"]) for rid, (status, body) in results.items()},
                         {"nixl-1": (200, "would_flip"), "mooncake-1": (200, "would_flip")})
        self.loop.wait_passes(5)
        self.assertFalse(self.nixl._send_failed)
        self.assertEqual(self.nixl.write_threads, [])


if __name__ == "__main__":
    unittest.main()
