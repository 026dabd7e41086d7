import threading
import unittest

from sglang_watchdog_plugin import capabilities, observe, orders

from . import standins
from .standins import KVPoll


def order(rid, room=None, dry_run=False):
    return orders.ForceFailOrder(rid, room, "test", dry_run)


def levers_of(sender):
    return capabilities.detect(type(sender), type(sender.kv_mgr), "")


def apply(o, queue):
    return orders.apply_order(o, queue, levers_of)


class ApplyOrderTest(unittest.TestCase):
    def setUp(self):
        self.mgr = standins.KVManager()

    def test_already_failed_when_the_lever_is_set(self):
        sender = standins.NixlKVSender(self.mgr, 1)
        sender._send_failed = True
        outcome = apply(order("a"), [standins.Req("a", 1, sender)])
        self.assertEqual((outcome.status, outcome.body["result"], outcome.body["lever"], outcome.body["levers"]),
                         (200, "already_failed", "_send_failed", ["_send_failed"]))

    def test_already_failed_when_the_last_poll_failed(self):
        sender = standins.MooncakeKVSender(self.mgr, 2, status=KVPoll.Failed)
        outcome = apply(order("b", 2, dry_run=True), [standins.Req("b", 2, sender)])
        self.assertEqual((outcome.body["result"], outcome.body["lever"], outcome.body["levers"]),
                         ("already_failed", "conclude_state", ["abort"]))
        self.assertEqual(sender.write_threads, [])

    def test_a_lever_that_does_not_take_is_never_flipped(self):
        """The code read said abort() works; the sender says otherwise after the pull: 500, not flipped."""
        sender = standins.MooncakeKVSender(self.mgr, 3, status=KVPoll.Transferring)
        sender.abort = lambda: None  # what a release whose abort() changed under the code read would do
        outcome = orders.apply_order(order("c", 3), [standins.Req("c", 3, sender)],
                                     lambda s: capabilities.Capabilities((capabilities.ABORT,), ""))
        self.assertEqual((outcome.status, outcome.body["result"], outcome.body["levers"]),
                         (500, "lever_ineffective", ["abort"]))

    def test_nixl_pulls_abort_then_the_flip(self):
        # abort() alone sets conclude_state, which NIXL's poll() never reads:
        # the flip is what releases a room whose status entry is gone.
        sender = standins.NixlKVSender(self.mgr, 6)
        sender.conclude_state = KVPoll.Failed
        self.assertEqual(observe.observe(sender, 6), (KVPoll.Transferring, 0, False))
        outcome = apply(order("f"), [standins.Req("f", 6, sender)])
        self.assertEqual((outcome.body["result"], outcome.body["lever"], outcome.body["levers"]),
                         ("flipped", "_send_failed", ["abort", "_send_failed"]))
        self.assertEqual(sender.poll(), KVPoll.Failed)
        self.assertEqual(self.mgr.request_status[6], KVPoll.Failed)  # what abort() adds: the workers skip it

    def test_flip_works_on_a_room_cleared_from_the_status_table(self):
        mgr = standins.NewestNixlKVManager()
        sender = standins.NixlKVSender(mgr, 8)
        del mgr.request_status[8]  # ABORT before register: update_status(Failed) is a no-op here
        outcome = apply(order("h"), [standins.Req("h", 8, sender)])
        self.assertEqual(outcome.body["result"], "flipped")
        self.assertNotIn(8, mgr.request_status)
        self.assertEqual(sender.poll(), KVPoll.Failed)

    def test_success_is_never_touched(self):
        for sender in (standins.NixlKVSender(self.mgr, 9, status=KVPoll.Success),
                       standins.MooncakeKVSender(self.mgr, 10, status=KVPoll.Success)):
            for dry_run in (False, True):
                room = sender.bootstrap_room
                outcome = apply(order("s", room, dry_run=dry_run), [standins.Req("s", room, sender)])
                self.assertEqual((outcome.status, outcome.body["result"], outcome.body["bootstrap_room"]),
                                 (409, "transfer_succeeded", room))
                self.assertEqual(set(outcome.body), {"result", "rid", "bootstrap_room", "error"})
            self.assertEqual(sender.write_threads, [])
            self.assertEqual(self.mgr.request_status[sender.bootstrap_room], KVPoll.Success)
            self.assertNotIn(sender.bootstrap_room, self.mgr.failure_records)

    def test_success_here_is_failed_while_another_rank_still_sends(self):
        """TP/CP group: this rank's Success is not the group's (SGLang MIN-reduces the polls), so a room another
        rank still sends is failed as SGLang's abort() fails it; a room no other rank sends is still refused."""
        sender = standins.MooncakeKVSender(self.mgr, 11, status=KVPoll.Success)
        req = [standins.Req("t", 11, sender)]
        refused = orders.apply_order(order("t", 11), req, levers_of, lambda room: (False, []))
        self.assertEqual((refused.status, refused.body["result"]), (409, "transfer_succeeded"))
        asked = []
        outcome = orders.apply_order(order("t", 11), req, levers_of,
                                     lambda room: asked.append(room) or (True, ["tp3-cp0"]))
        self.assertEqual((outcome.status, outcome.body["result"]), (200, "flipped"), outcome.body)
        self.assertEqual(asked, [11])
        self.assertEqual(sender.poll(), KVPoll.Failed)

    def test_success_here_with_a_rank_unwatched_is_refused_without_a_promise(self):
        """A rank whose file is missing or stale may still send the room, or be done: the plugin neither flips a
        room that may have succeeded on the group nor says the Success branch will release it."""
        sender = standins.NixlKVSender(self.mgr, 12, status=KVPoll.Success)
        refused = orders.apply_order(order("u", 12), [standins.Req("u", 12, sender)], levers_of,
                                     lambda room: (False, ["tp1-cp0"]))
        self.assertEqual((refused.status, refused.body["result"], refused.body["ranks"]),
                         (409, "group_unwatched", ["tp1-cp0"]))
        self.assertIn("tp1-cp0", refused.body["error"])
        self.assertEqual(sender.poll(), KVPoll.Success)
        self.assertEqual(self.mgr.request_status[12], KVPoll.Success)

    def test_health_checks_and_warm_ups_are_refused(self):
        fake = standins.FakeKVSender(standins.FakeKVManager())
        for req in (standins.Req("HEALTH_CHECK_1.0", 0, fake, host=standins.FAKE_BOOTSTRAP_HOST, port=None),
                    standins.Req("warmup-1", 0, fake, host=standins.FAKE_BOOTSTRAP_HOST, port=None),
                    standins.Req("fake-host", 77, fake, host=standins.FAKE_BOOTSTRAP_HOST, port=None),
                    standins.Req("room-zero", 0, standins.NixlKVSender(self.mgr, 0))):
            for dry_run in (False, True):
                outcome = apply(order(req.rid, dry_run=dry_run), [req])
                self.assertEqual((outcome.status, outcome.body["result"]), (409, "health_check"), req.rid)
                self.assertEqual(outcome.body["bootstrap_room"], req.bootstrap_room)
            self.assertEqual(req.disagg_kv_sender.write_threads, [])

    def test_unsupported_changes_nothing(self):
        mgr = standins.Mid2025NixlKVManager()
        sender = standins.Mid2025NixlKVSender(mgr, 12)
        outcome = apply(order("u"), [standins.Req("u", 12, sender)])
        self.assertEqual((outcome.status, outcome.body["result"]), (501, "unsupported"))
        self.assertIn("update_status", outcome.body["error"])
        self.assertEqual(sender.write_threads, [])
        self.assertEqual(mgr.request_status[12], KVPoll.Transferring)

    def test_request_without_sender_is_an_internal_error(self):
        outcome = apply(order("c"), [standins.Req("c", 3, None)])
        self.assertEqual((outcome.status, outcome.body["result"]), (500, "internal_error"))

    def test_reason_reaches_the_failure_records(self):
        sender = standins.MooncakeKVSender(self.mgr, 4)
        outcome = apply(orders.ForceFailOrder("d", 4, "pinned 900s", False), [standins.Req("d", 4, sender)])
        self.assertEqual((outcome.body["result"], outcome.body["levers"]), ("flipped", ["abort"]))
        self.assertEqual(self.mgr.failure_records[4], "force-failed by sglang-watchdog: pinned 900s")
        self.assertEqual(sender.poll(), KVPoll.Failed)

    def test_failing_record_failure_still_flips(self):
        class Manager(standins.KVManager):
            def record_failure(self, room, reason):
                raise RuntimeError("records are full")

        sender = standins.NixlKVSender(Manager(), 5)
        with self.assertLogs("sglang_watchdog_plugin", "ERROR"):
            outcome = apply(order("e"), [standins.Req("e", 5, sender)])
        # abort() raised inside (its own record_failure): the flip alone still releases the request.
        self.assertEqual((outcome.body["result"], outcome.body["levers"]), ("flipped", ["_send_failed"]))
        self.assertTrue(sender._send_failed)


class OrderHandOverTest(unittest.TestCase):
    def test_withdrawn_order_cannot_be_claimed(self):
        o = order("a")
        self.assertIsNone(o.wait(0.01))
        self.assertFalse(o.claim())

    def test_claimed_order_is_waited_for_past_the_timeout(self):
        o = order("a")
        self.assertTrue(o.claim())
        done = orders.Outcome(200, {"result": "flipped"})
        threading.Timer(0.2, o.finish, args=(done,)).start()
        self.assertIs(o.wait(0.01), done)

    def test_claim_and_withdraw_never_both_win(self):
        for _ in range(300):
            o = order("a")
            claimed = []
            barrier = threading.Barrier(2)

            def scheduler_side():
                barrier.wait()
                if o.claim():
                    claimed.append(True)
                    o.finish(orders.Outcome(200, {}))

            t = threading.Thread(target=scheduler_side)
            t.start()
            barrier.wait()
            answer = o.wait(0)
            t.join()
            self.assertEqual(answer is None, not claimed)


class ObserveTest(unittest.TestCase):
    def test_poll_names(self):
        self.assertEqual([observe.poll_name(c) for c in (0, 1, 2, 3, 4, -1, 9)],
                         ["Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success", "Unknown",
                          "Unknown"])
        self.assertEqual(observe.as_poll_code(True), observe.UNKNOWN)
        self.assertEqual(observe.as_poll_code("3"), observe.UNKNOWN)

    def test_newest_nixl_reads_unknown_rooms_as_waiting(self):
        mgr = standins.NewestNixlKVManager()
        sender = standins.NixlKVSender(mgr, 1, chunk_id=2)
        mgr.request_status.clear()
        self.assertEqual(observe.observe(sender, 1), (KVPoll.WaitingForInput, 2, False))

    def test_fake_sender_follows_has_sent(self):
        sender = standins.FakeKVSender(standins.FakeKVManager(), has_sent=True)
        self.assertEqual(observe.observe(sender, 0), (KVPoll.Success, -1, False))

    def test_mooncake_abort_shows_as_send_failed(self):
        sender = standins.MooncakeKVSender(standins.KVManager(), 1, curr_idx=8)
        sender.abort()
        self.assertEqual(observe.observe(sender, 1), (KVPoll.Failed, 8, True))

    def test_observing_never_polls(self):
        class NoPoll(standins.MooncakeKVSender):
            def poll(self):
                raise AssertionError("poll() called")

        mgr = standins.KVManager()
        sender = NoPoll(mgr, 1, status=KVPoll.Success)
        self.assertEqual(observe.observe(sender, 1)[0], KVPoll.Success)
        self.assertIsNone(sender.conclude_state)


if __name__ == "__main__":
    unittest.main()
