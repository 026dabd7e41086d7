"""Round 2: levers per SGLang era, transfer fields, orphaned transfers, PP consensus."""

import threading
import types
import unittest

from sglang_watchdog_plugin import capabilities

from . import harness, standins
from .standins import KVPoll

ROOM = 6619432765110349211


class Serving:
    def start(self, scheduler, env=None):
        loop, monitor = harness.start_loop(scheduler, env)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        return loop, monitor, harness.Client(monitor.listener.port)


class LeversPerEraTest(Serving, unittest.TestCase):
    def listing_and_answers(self, scheduler, rid):
        loop, _, client = self.start(scheduler)
        _, listing = client.get_json()
        answers = [client.force_fail({"rid": rid, "dry_run": dry_run}) for dry_run in (True, False)]
        loop.wait_passes(3)
        return listing, answers

    def test_newest_nixl(self):
        s = standins.NewScheduler(backend="nixl")
        mgr = standins.NewestNixlKVManager()
        s.disagg_prefill_inflight_queue = [standins.Req("r", ROOM, standins.NixlKVSender(mgr, ROOM))]
        listing, answers = self.listing_and_answers(s, "r")
        self.assertEqual((listing["server"]["levers"], listing["server"]["lever_note"]),
                         (["abort", "_send_failed"], ""))
        self.assertEqual([(status, body["result"], body["levers"]) for status, body in answers],
                         [(200, "would_flip", ["abort", "_send_failed"]),
                          (200, "flipped", ["abort", "_send_failed"])])
        harness.wait_until(lambda: s.num_transfer_failed_reqs == 1)

    def test_mooncake_and_fake_backends(self):
        for backend, sender in (("mooncake", standins.MooncakeKVSender(standins.KVManager(), ROOM)),
                                ("fake", standins.FakeKVSender(standins.FakeKVManager()))):
            s = standins.OldScheduler(backend=backend)
            s.disagg_prefill_inflight_queue = [standins.Req("r", ROOM, sender)]
            listing, answers = self.listing_and_answers(s, "r")
            self.assertEqual(listing["server"]["levers"], ["abort"], backend)
            self.assertEqual([body["result"] for _, body in answers], ["would_flip", "flipped"], backend)
            harness.wait_until(lambda: s.num_transfer_failed_reqs == 1)

    def test_mid_2025_nixl_answers_unsupported_and_changes_nothing(self):
        s = standins.OldScheduler(backend="nixl")
        mgr = standins.Mid2025NixlKVManager()
        sender = standins.Mid2025NixlKVSender(mgr, ROOM)
        s.disagg_prefill_inflight_queue = [standins.Req("r", ROOM, sender)]
        listing, answers = self.listing_and_answers(s, "r")
        self.assertEqual(listing["server"]["levers"], [])
        self.assertIn("update_status", listing["server"]["lever_note"])
        self.assertIn("conclude_state", listing["server"]["lever_note"])
        for status, body in answers:
            self.assertEqual((status, body["result"], body["rid"]), (501, "unsupported", "r"))
            self.assertEqual(set(body), {"result", "rid", "error"})
        self.assertEqual(sender.write_threads, [])
        self.assertEqual(mgr.request_status[ROOM], KVPoll.Transferring)
        self.assertEqual(len(s.disagg_prefill_inflight_queue), 1)

    def test_early_era_never_pulls_a_lever_into_a_raising_failed_branch(self):
        # Its senders would honour abort(), but its Failed branch raises in the scheduler.
        s = standins.EarlyScheduler(backend="mooncake")
        sender = standins.MooncakeKVSender(standins.KVManager(), ROOM)
        s.disagg_prefill_inflight_queue = [standins.Req("r", ROOM, sender)]
        listing, answers = self.listing_and_answers(s, "r")
        self.assertEqual(listing["server"]["levers"], [])
        self.assertIn("raises", listing["server"]["lever_note"])
        self.assertEqual([(status, body["result"]) for status, body in answers],
                         [(501, "unsupported"), (501, "unsupported")])
        self.assertEqual(sender.write_threads, [])
        self.assertIsNone(sender.conclude_state)

    def test_levers_wait_for_the_first_backend_sender(self):
        s = standins.NewScheduler(backend="nixl")
        loop, monitor, client = self.start(s)
        server = client.get_json()[1]["server"]
        self.assertEqual(server["levers"], [])
        self.assertIn("no KV sender", server["lever_note"])
        mgr = standins.NewestNixlKVManager()
        s.disagg_prefill_inflight_queue.append(standins.Req("late", ROOM, standins.NixlKVSender(mgr, ROOM)))
        loop.wait_passes(3)
        self.assertEqual(client.get_json()[1]["server"]["levers"], ["abort", "_send_failed"])

    def test_tracking_waits_for_the_first_backend_manager(self):
        # No manager on the bootstrap queue at load: false until a sender's manager is seen.
        for backend, manager, sender in (
                ("mooncake", standins.KVManager(), standins.MooncakeKVSender),
                ("nixl", standins.NewestNixlKVManager(), standins.NixlKVSender)):
            s = standins.NewScheduler(backend=backend)
            loop, monitor, client = self.start(s)
            self.assertIs(client.get_json()[1]["server"]["transfer_tracking"], False, backend)
            s.disagg_prefill_inflight_queue.append(standins.Req("late", ROOM, sender(manager, ROOM)))
            loop.wait_passes(3)
            self.assertIs(client.get_json()[1]["server"]["transfer_tracking"], True, backend)


class DetectionTest(unittest.TestCase):
    def test_failed_branch_per_era(self):
        self.assertEqual(capabilities.failed_branch_problem(
            standins.PrefillMixin.process_disagg_prefill_inflight_queue), "")
        self.assertEqual(capabilities.failed_branch_problem(
            standins.OldPrefillMixin.process_disagg_prefill_inflight_queue), "")
        self.assertIn("raises", capabilities.failed_branch_problem(
            standins.EarlyPrefillMixin.process_disagg_prefill_inflight_queue))

    def test_unreadable_code_is_no_lever(self):
        namespace = {}
        exec("def process_disagg_prefill_inflight_queue(self):\n    pass\n", namespace)  # no source file
        problem = capabilities.failed_branch_problem(namespace["process_disagg_prefill_inflight_queue"])
        self.assertIn("cannot be read", problem)
        caps = capabilities.detect(standins.NixlKVSender, standins.NewestNixlKVManager, problem)
        self.assertEqual(caps, capabilities.Capabilities((), problem))

    def test_probes_decide_where_the_source_is_missing(self):
        namespace = {"KVPoll": KVPoll}
        exec(
            "class Manager:\n"
            "    def update_status(self, room, status):\n"
            "        self.request_status[room] = max(self.request_status[room], status)\n"
            "class Sender:\n"
            "    def poll(self):\n"
            "        return KVPoll.Failed if self._send_failed else self.kv_mgr.check_status(self.bootstrap_room)\n"
            "    def abort(self):\n"
            "        self.conclude_state = KVPoll.Failed\n",
            namespace,
        )
        caps = capabilities.detect(namespace["Sender"], namespace["Manager"], "")
        # poll() is probed on a blank instance: it reads _send_failed; abort() cannot be read.
        self.assertEqual(caps.levers, ("_send_failed",))
        self.assertFalse(capabilities._failed_sticks(namespace["Manager"]))
        self.assertTrue(capabilities._failed_sticks(standins.KVManager))

    def test_partial_levers_say_why(self):
        caps = capabilities.detect(standins.NixlKVSender, standins.Mid2025NixlKVManager, "")
        self.assertEqual(caps.levers, ("_send_failed",))
        self.assertIn("update_status does not let Failed override", caps.note)

        class Silent(standins.MooncakeKVSender):
            def abort(self):
                pass  # BaseKVSender.abort

        caps = capabilities.detect(Silent, standins.KVManager, "")
        self.assertEqual(caps, capabilities.Capabilities((), "Silent.abort() does nothing"))

    def test_abort_through_super_and_self_calls(self):
        """v0.5.18's MooncakeKVSender.abort is super().abort() plus tracing; the work is in the parent's."""
        KVPoll = standins.KVPoll

        class Parent:
            def abort(self):
                self._conclude()

            def _conclude(self):
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed

        class Child(Parent):
            def abort(self):
                super().abort()
                self.trace_ctx.abort(abort_info={"reason": "Aborted"})

            def poll(self):
                return self.conclude_state if self.conclude_state is not None else KVPoll.Transferring

        class TracingOnly(Parent):
            def abort(self):
                self.trace_ctx.abort(abort_info={"reason": "Aborted"})

            poll = Child.poll

        self.assertEqual(capabilities.detect(Child, standins.KVManager, ""), capabilities.Capabilities(("abort",), ""))
        self.assertEqual(capabilities.detect(TracingOnly, standins.KVManager, "").levers, ())

    def test_queue_keys(self):
        newest = standins.NewestNixlKVManager()
        newest.register_destinations(1, (17001, 17002))
        self.assertEqual(capabilities.queue_key(newest), capabilities.QueueKey(4, "dst_port_sum"))
        self.assertEqual(capabilities.queue_of(capabilities.queue_key(newest), newest, 1), (17001 + 17002) % 4)
        mooncake = standins.KVManager(queues=3)
        mooncake.register_destinations(1, (17001,))
        self.assertEqual(capabilities.queue_key(mooncake), capabilities.QueueKey(3, "session_port_sum"))
        self.assertEqual(capabilities.queue_of(capabilities.queue_key(mooncake), mooncake, 1), 17001 % 3)
        self.assertIsNone(capabilities.queue_of(capabilities.queue_key(mooncake), mooncake, 2))  # no destinations
        mori = types.SimpleNamespace(_transfer_queues=[[]] * 8, _num_shards=8)
        self.assertEqual(capabilities.queue_of(capabilities.queue_key(mori), mori, 21), 5)
        self.assertEqual(capabilities.queue_key(standins.Mid2025NixlKVManager()), capabilities.QueueKey(None, None))

    def test_transfer_tracking(self):
        self.assertTrue(capabilities.transfer_tracking(standins.NewestNixlKVManager()))
        self.assertTrue(capabilities.transfer_tracking(standins.KVManager()))  # Mooncake
        self.assertTrue(capabilities.transfer_tracking(types.SimpleNamespace(_staging_outstanding={})))  # Mori
        self.assertFalse(capabilities.transfer_tracking(standins.Mid2025NixlKVManager()))
        self.assertFalse(capabilities.transfer_tracking(standins.FakeKVManager()))
        self.assertFalse(capabilities.transfer_tracking(None))
        # Something else under that name is no count the plugin can read.
        self.assertFalse(capabilities.transfer_tracking(types.SimpleNamespace(_staging_outstanding=3)))


class TransferFieldsTest(Serving, unittest.TestCase):
    def test_in_flight_queue_and_orphans(self):
        s = standins.NewScheduler(backend="nixl")
        mgr = standins.NewestNixlKVManager()
        s.disagg_prefill_bootstrap_queue.kv_manager = mgr
        wedged = standins.NixlKVSender(mgr, ROOM, dst_ports=(17001, 17002))
        idle = standins.NixlKVSender(mgr, ROOM + 1, dst_ports=(17000,))
        s.disagg_prefill_inflight_queue = [standins.Req("wedged", ROOM, wedged), standins.Req("idle", ROOM + 1, idle)]
        self.assertEqual(mgr.add_transfer_request(ROOM, is_last=True), 3)  # a handle that never completes
        loop, monitor, client = self.start(s)

        _, listing = client.get_json()
        self.assertEqual(listing["server"]["transfer_queues"], 4)
        self.assertIs(listing["server"]["transfer_tracking"], True)
        rooms = {room["rid"]: room for room in listing["inflight"]}
        self.assertEqual((rooms["wedged"]["transfer_in_flight"], rooms["wedged"]["transfer_queue"]), (True, 3))
        self.assertEqual((rooms["idle"]["transfer_in_flight"], rooms["idle"]["transfer_queue"]), (False, 0))
        self.assertEqual(listing["orphaned_transfers"], [])

        # The flip releases the request; the chunk stays outstanding in its worker.
        self.assertEqual(client.force_fail({"rid": "wedged", "bootstrap_room": ROOM})[1]["result"], "flipped")
        mgr.transfer_infos.pop(ROOM)  # the Failed branch's clear() is gone with the request
        harness.wait_until(lambda: client.get_json()[1]["orphaned_transfers"] != [], timeout=5)
        listing = client.get_json()[1]
        self.assertEqual([room["rid"] for room in listing["inflight"]], ["idle"])
        self.assertEqual(listing["orphaned_transfers"],
                         [{"bootstrap_room": ROOM, "transfer_queue": 3, "outstanding_chunks": 1}])

        mgr.settle(ROOM)  # the handle finally settles
        harness.wait_until(lambda: client.get_json()[1]["orphaned_transfers"] == [], timeout=5)

    def test_backends_without_counts_report_false_and_null(self):
        s = standins.OldScheduler(backend="nixl")
        mgr = standins.Mid2025NixlKVManager()
        s.disagg_prefill_inflight_queue = [standins.Req("r", ROOM, standins.Mid2025NixlKVSender(mgr, ROOM))]
        _, _, client = self.start(s)
        listing = client.get_json()[1]
        self.assertIsNone(listing["server"]["transfer_queues"])
        self.assertIs(listing["server"]["transfer_tracking"], False)  # its false transfer_in_flight proves nothing
        room = listing["inflight"][0]
        self.assertEqual((room["transfer_in_flight"], room["transfer_queue"]), (False, None))


class WarmUpTest(Serving, unittest.TestCase):
    def test_warm_up_without_the_prefix_is_a_health_check(self):
        s = standins.NewScheduler(backend="nixl")
        fake = standins.FakeKVSender(standins.FakeKVManager())
        mgr = standins.NewestNixlKVManager()
        s.disagg_prefill_inflight_queue = [
            standins.Req("3f2a9c", 0, fake, host=standins.FAKE_BOOTSTRAP_HOST, port=None),
            standins.Req("r", ROOM, standins.NixlKVSender(mgr, ROOM)),
        ]
        loop, _, client = self.start(s)
        warm_up = client.get_json()[1]["inflight"][0]
        self.assertEqual((warm_up["rid"], warm_up["health_check"]), ("3f2a9c", True))
        for dry_run in (True, False):
            status, body = client.force_fail({"rid": "3f2a9c", "dry_run": dry_run})
            self.assertEqual((status, body["result"], body["bootstrap_room"]), (409, "health_check", 0))
        loop.wait_passes(3)
        self.assertEqual(fake.write_threads, [])


class SuccessRoomTest(Serving, unittest.TestCase):
    def test_a_room_that_succeeded_is_not_touched(self):
        s = standins.NewScheduler(backend="nixl")
        mgr = standins.NewestNixlKVManager()
        sender = standins.NixlKVSender(mgr, ROOM)
        s.disagg_prefill_inflight_queue = [standins.Req("r", ROOM, sender)]
        loop, monitor, client = self.start(s)
        loop.pause()  # the transfer succeeds between two passes: the listing still shows Transferring
        mgr.update_status(ROOM, KVPoll.Success)
        results = []
        asker = threading.Thread(target=lambda: results.append(client.force_fail({"rid": "r"})))
        asker.start()
        harness.wait_until(lambda: len(monitor._orders) == 1)
        loop.resume()
        asker.join(10)
        status, body = results[0]
        self.assertEqual((status, body["result"], body["bootstrap_room"]), (409, "transfer_succeeded", ROOM))
        harness.wait_until(lambda: s.released and s.released[0].rid == "r")
        self.assertEqual(s.num_transfer_failed_reqs, 0)  # released by the Success branch
        self.assertEqual(sender.write_threads, [])


class PipelineParallelTest(unittest.TestCase):
    def test_a_request_leaves_only_when_every_stage_reports_it_terminal(self):
        group = standins.PPGroup(2)
        stages, senders = [], []
        for pp_rank in (0, 1):
            s = standins.PPStageScheduler(group, pp_rank)
            mgr = standins.NewestNixlKVManager()
            sender = standins.NixlKVSender(mgr, ROOM)
            s.disagg_prefill_inflight_queue = [standins.Req("r", ROOM, sender)]
            loop, monitor = harness.start_loop(s)
            self.addCleanup(loop.stop)
            self.addCleanup(monitor.close)
            stages.append((s, loop, harness.Client(monitor.listener.port)))
            senders.append(sender)

        listings = [client.get_json()[1]["server"] for _, _, client in stages]
        self.assertEqual([(srv["pp_rank"], srv["pp_size"]) for srv in listings], [(0, 2), (1, 2)])

        s0, loop0, client0 = stages[0]
        s1, loop1, client1 = stages[1]
        self.assertEqual(client0.force_fail({"rid": "r", "bootstrap_room": ROOM})[1]["result"], "flipped")
        loop0.wait_passes(10)
        loop1.wait_passes(10)
        self.assertEqual([len(s.disagg_prefill_inflight_queue) for s, _, _ in stages], [1, 1])
        self.assertEqual([r["rid"] for r in client0.get_json()[1]["inflight"]], ["r"])

        self.assertEqual(client1.force_fail({"rid": "r", "bootstrap_room": ROOM})[1]["result"], "flipped")
        harness.wait_until(lambda: not s0.disagg_prefill_inflight_queue and not s1.disagg_prefill_inflight_queue)
        self.assertEqual([s.num_transfer_failed_reqs for s, _, _ in stages], [1, 1])


if __name__ == "__main__":
    unittest.main()
