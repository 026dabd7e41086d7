"""The real plugin on decode stand-ins: listing, release, refusals, deferred release."""

import os
import threading
import unittest
from unittest import mock

from sglang_watchdog_plugin import decode, decode_observe, hook
from sglang_watchdog_plugin.orders import ForceFailOrder

from . import harness, standins
from .standins import KVPoll

def unhooked_pass(scheduler):
    """One decode pass before the plugin starts (the hooked one would start it outside the test's settings)."""
    standins.DecodeMixin.process_decode_queue.__wrapped__(scheduler)


WAITING_ROOM = 9223372036854775011  # prealloc queue, no transfer yet
LIVE_ROOM = 18446744073709551557  # transfer queue, 2 of 4 chunks in
STALLED_ROOM = 9223372036854775013  # transfer queue, metadata sent, nothing written (ABORT-before-register)
DONE_ROOM = 9223372036854775017  # every chunk and the aux arrived; poll() has not latched it yet


class DecodeTest(unittest.TestCase):
    """Deferred decode KV release on, as later upstream code applies it: the manager's flag and SGLang's setting."""

    backend = "nixl"

    def setUp(self):
        setting = mock.patch.dict(os.environ, {decode.DEFERRED_SETTING: "1"})
        setting.start()
        self.addCleanup(setting.stop)
        self.peer = standins.PrefillPeer()
        self.scheduler = self.make_scheduler()
        s = self.scheduler
        # The prealloc request never gets pages: its handshake is pending.
        self.waiting = s.add_request("waiting-1", WAITING_ROOM, peer=self.peer, handshake=False)
        self.live = s.add_request("live-1", LIVE_ROOM, peer=self.peer)
        self.stalled = s.add_request("stalled-1", STALLED_ROOM, peer=self.peer)
        self.done = s.add_request("done-1", DONE_ROOM, peer=self.peer)
        self.health = s.add_request("HEALTH_CHECK_7.5", 0, host=standins.FAKE_BOOTSTRAP_HOST, port=None,
                                    handshake=False)
        self.warmup = s.add_request("warmup-1", 0, host=standins.FAKE_BOOTSTRAP_HOST, port=None, handshake=False)
        unhooked_pass(s)  # the handshaken requests move to the transfer queue
        mgr = s.kv_manager
        if self.backend == "nixl":
            mgr.receive_chunk(LIVE_ROOM, 0)
            mgr.receive_chunk(LIVE_ROOM, 1)
            for chunk in range(3):
                mgr.receive_chunk(DONE_ROOM, chunk, last_of=3 if chunk == 2 else None)
        self.peer.writing.add(LIVE_ROOM)
        self.loop, self.monitor = harness.start_loop(s)
        self.addCleanup(self.loop.stop)
        self.addCleanup(self.monitor.close)
        self.client = harness.Client(self.monitor.listener.port)

    def make_scheduler(self):
        return standins.DecodeScheduler(backend=self.backend)

    def listing(self):
        status, body = self.client.get_json()
        self.assertEqual(status, 200)
        return body

    def rows(self):
        return {row["rid"]: row for row in self.listing()["decode_requests"]}

    def with_loop_paused(self, fn):
        self.loop.pause()
        try:
            return fn()
        finally:
            self.loop.resume()

    def test_listing_covers_both_queues(self):
        body = self.listing()
        self.assertEqual(body["server"]["disaggregation_mode"], "decode")
        self.assertEqual(body["server"]["levers"], ["abort"])
        self.assertEqual(body["server"]["lever_note"], "")
        self.assertIs(body["server"]["deferred_release"], True)
        self.assertEqual(body["inflight"], [])
        self.assertEqual(body["queues"], {"bootstrap": 0, "waiting": 0, "inflight": 0, "prealloc": 3, "transfer": 3})
        rows = {row["rid"]: row for row in body["decode_requests"]}
        self.assertEqual(list(rows), ["waiting-1", "HEALTH_CHECK_7.5", "warmup-1", "live-1", "stalled-1", "done-1"])
        waiting = rows["waiting-1"]
        self.assertEqual((waiting["queue"], waiting["poll"], waiting["transfer_started"], waiting["progress"]),
                         ("prealloc", "Bootstrapping", False, 0))
        self.assertEqual(waiting["bootstrap_room"], WAITING_ROOM)  # 64-bit rooms survive
        self.assertEqual(waiting["bootstrap_addr"], "10.0.0.7:8998")
        self.assertFalse(waiting["health_check"])
        live = rows["live-1"]
        self.assertEqual((live["queue"], live["poll"], live["progress"], live["chunks_expected"],
                          live["transfer_started"]), ("transfer", "WaitingForInput", 2, None, True))
        self.assertEqual(rows["stalled-1"]["progress"], 0)
        self.assertIs(rows["stalled-1"]["transfer_started"], True)  # metadata sent: prefill may write
        self.assertEqual((rows["done-1"]["poll"], rows["done-1"]["chunks_expected"]), ("WaitingForInput", 3))
        health = rows["HEALTH_CHECK_7.5"]
        self.assertEqual((health["bootstrap_room"], health["bootstrap_addr"], health["health_check"], health["queue"],
                          health["progress"], health["transfer_started"]), (0, "2.2.2.2", True, "prealloc", -1, False))
        self.assertTrue(rows["warmup-1"]["health_check"])  # fake host without the rid prefix
        self.assertGreaterEqual(waiting["age_seconds"], 0)
        # The prefill rank the receiver fetched from the bootstrap server; none before its handshake.
        self.assertEqual(live["prefill_rank_addrs"], [f"10.0.0.7:{standins.PREFILL_RANK_PORT}"])
        self.assertIsNone(waiting["prefill_rank_addrs"])
        self.assertIsNone(health["prefill_rank_addrs"])

    def test_progress_and_completion_show_on_the_next_passes(self):
        mgr = self.scheduler.kv_manager

        def land():
            mgr.receive_chunk(DONE_ROOM, 0)  # a duplicate notification changes nothing
            mgr.receive_aux(DONE_ROOM)

        self.with_loop_paused(land)
        harness.wait_until(lambda: "done-1" not in self.rows(), message="the completed request stayed listed")
        self.assertEqual([r.rid for r in self.scheduler.waiting_queue], ["done-1"])

        self.with_loop_paused(lambda: mgr.receive_chunk(LIVE_ROOM, 2))
        harness.wait_until(lambda: self.rows()["live-1"]["progress"] == 3)

    def test_release_from_the_prealloc_queue_is_a_bootstrap_failure(self):
        receiver = self.waiting.kv_receiver
        status, body = self.client.force_fail({"rid": "waiting-1", "bootstrap_room": WAITING_ROOM, "reason": "stuck"})
        self.assertEqual((status, body["result"], body["levers"], body["lever"], body["bootstrap_room"]),
                         (200, "flipped", ["abort"], "conclude_state", WAITING_ROOM))
        self.assertEqual(receiver.write_threads, [self.loop.thread.ident])  # only the scheduler thread wrote
        harness.wait_until(lambda: self.scheduler.num_bootstrap_failed_reqs == 1)
        self.assertNotIn("waiting-1", self.rows())
        self.assertIn(("waiting-1", 500), self.scheduler.client_answers)
        self.assertEqual(self.scheduler.num_transfer_failed_reqs, 0)
        self.assertEqual(self.peer.aborts, [])  # its handshake never happened: nobody to tell

    def test_live_transfer_is_refused_without_prefill_stopped(self):
        for payload in ({"rid": "live-1"}, {"rid": "live-1", "dry_run": True},
                        {"rid": "stalled-1", "prefill_stopped": False}):
            status, body = self.client.force_fail(payload)
            self.assertEqual((status, body["result"]), (409, "transfer_live"), payload)
            self.assertIn("prefill_stopped", body["error"])
        self.assertEqual(body["bootstrap_room"], STALLED_ROOM)
        for decode_req in (self.live, self.stalled):
            self.assertEqual(decode_req.kv_receiver.write_threads, [])
            self.assertIsNone(decode_req.kv_receiver.conclude_state)
        self.assertEqual(self.peer.aborts, [])

    def test_prefill_stopped_releases_with_the_deferred_abort(self):
        status, body = self.client.force_fail({"rid": "stalled-1", "prefill_stopped": True, "dry_run": True})
        self.assertEqual((status, body["result"], body["levers"]), (200, "would_flip", ["abort", "deferred_abort"]))
        self.assertIsNone(self.stalled.kv_receiver.conclude_state)

        receiver = self.stalled.kv_receiver
        status, body = self.client.force_fail({"rid": "stalled-1", "bootstrap_room": STALLED_ROOM,
                                               "prefill_stopped": True})
        self.assertEqual((status, body["result"], body["levers"]), (200, "flipped", ["abort", "deferred_abort"]))
        self.assertEqual(receiver.write_threads, [self.loop.thread.ident])
        self.assertEqual(self.peer.aborts, [STALLED_ROOM])
        harness.wait_until(lambda: self.scheduler.num_transfer_failed_reqs == 1)
        self.assertNotIn("stalled-1", self.rows())
        self.assertIn(("stalled-1", 500), self.scheduler.client_answers)
        # The peer acknowledged at once (nothing of the room in flight): freed on the next pass.
        harness.wait_until(lambda: "stalled-1" in self.scheduler.released_pages)
        self.assertEqual(self.scheduler.deferred_timeouts, [])
        self.assertIn("force-failed by sglang-watchdog", self.scheduler.kv_manager.failure_records[STALLED_ROOM])

    def test_deferred_release_waits_for_the_ack(self):
        receiver = self.live.kv_receiver
        status, body = self.client.force_fail({"rid": "live-1", "prefill_stopped": True})
        self.assertEqual((status, body["levers"]), (200, ["abort", "deferred_abort"]))
        harness.wait_until(lambda: self.scheduler.num_transfer_failed_reqs == 1)
        self.loop.wait_passes(5)
        # The peer still has a chunk of the room in flight: the pages stay held.
        self.assertNotIn("live-1", self.scheduler.released_pages)
        self.assertTrue(self.scheduler.kv_manager._deferred_abort_ack_tracker)
        self.with_loop_paused(lambda: self.peer.settle(LIVE_ROOM))
        harness.wait_until(lambda: "live-1" in self.scheduler.released_pages)
        self.assertEqual(self.scheduler.deferred_timeouts, [])
        self.assertIsNone(self.live.kv_receiver)
        self.assertEqual(receiver.conclude_state, KVPoll.Failed)

    def test_deferred_release_times_out_without_an_ack(self):
        self.peer.acks = False
        clock = [0.0]
        self.scheduler.disagg_decode_transfer_queue.clock = lambda: clock[0]
        self.client.force_fail({"rid": "stalled-1", "prefill_stopped": True})
        harness.wait_until(lambda: self.scheduler.num_transfer_failed_reqs == 1)
        self.loop.wait_passes(5)
        self.assertNotIn("stalled-1", self.scheduler.released_pages)
        clock[0] = standins.DEFERRED_RELEASE_TIMEOUT_S
        harness.wait_until(lambda: "stalled-1" in self.scheduler.released_pages)
        self.assertEqual(self.scheduler.deferred_timeouts, ["stalled-1"])

    def test_health_checks_and_warmups_are_never_touched(self):
        for rid in ("HEALTH_CHECK_7.5", "warmup-1"):
            for payload in ({"rid": rid}, {"rid": rid, "bootstrap_room": 0, "dry_run": True, "prefill_stopped": True}):
                status, body = self.client.force_fail(payload)
                self.assertEqual((status, body["result"], body["bootstrap_room"]), (409, "health_check", 0))
        for decode_req in (self.health, self.warmup):
            self.assertEqual(decode_req.kv_receiver.write_threads, [])
            self.assertIsNone(decode_req.kv_receiver.conclude_state)
        # Also on the scheduler thread, if the listing has not seen them yet.
        order = ForceFailOrder("HEALTH_CHECK_7.5", None, None, False)
        outcome = self.with_loop_paused(lambda: decode.apply_order(
            order, self.scheduler, self.monitor.capabilities_for, self.monitor._note_deferred))
        self.assertEqual((outcome.status, outcome.body["result"]), (409, "health_check"))

    def test_succeeded_transfer_is_refused(self):
        receiver = self.done.kv_receiver

        def complete_unpolled():
            self.scheduler.kv_manager.receive_aux(DONE_ROOM)
            # Keep the finished request queued: poll() must not latch Success before the order is applied.
            receiver.poll = lambda: KVPoll.WaitingForInput

        self.with_loop_paused(complete_unpolled)
        status, body = self.client.force_fail({"rid": "done-1", "prefill_stopped": True})
        self.assertEqual((status, body["result"], body["bootstrap_room"]), (409, "transfer_succeeded", DONE_ROOM))
        self.assertIsNone(receiver.conclude_state)
        self.assertEqual(receiver.write_threads, [])

    def test_answers_decided_on_the_http_thread(self):
        status, body = self.client.force_fail({"rid": "nope"})
        self.assertEqual((status, body["result"]), (404, "not_found"))
        status, body = self.client.force_fail({"rid": "live-1", "bootstrap_room": 5})
        self.assertEqual((status, body["result"], body["bootstrap_room"]), (409, "room_mismatch", LIVE_ROOM))
        for bad in ("yes", None, 1):
            status, body = self.client.force_fail({"rid": "live-1", "prefill_stopped": bad})
            self.assertEqual((status, body["result"]), (400, "bad_request"))
            self.assertIn("prefill_stopped", body["error"])

    def test_already_failed(self):
        def fail():
            self.live.kv_receiver.abort()

        self.with_loop_paused(lambda: (fail(), setattr(self.live.kv_receiver, "poll", lambda: KVPoll.Transferring)))
        status, body = self.client.force_fail({"rid": "live-1", "dry_run": True})
        self.assertEqual((status, body["result"], body["levers"]), (200, "already_failed", ["abort"]))


class MooncakeDecodeTest(unittest.TestCase):
    """Mooncake: Transferring once prefill started writing, never timed out there; older layout."""

    def setUp(self):
        self.peer = standins.PrefillPeer()
        self.scheduler = standins.OldDecodeScheduler(backend="mooncake", manager=standins.DecodeKVManager(False))
        s = self.scheduler
        self.frozen = s.add_request("frozen-1", 77, peer=self.peer)
        unhooked_pass(s)
        self.frozen.kv_receiver.start_transfer()
        self.loop, self.monitor = harness.start_loop(s)
        self.addCleanup(self.loop.stop)
        self.addCleanup(self.monitor.close)
        self.client = harness.Client(self.monitor.listener.port)

    def test_transferring_room_is_live_then_released_at_once_without_deferral(self):
        _, body = self.client.get_json()
        self.assertIs(body["server"]["deferred_release"], False)
        self.assertEqual(body["server"]["transfer_backend"], "mooncake")
        row = body["decode_requests"][0]
        self.assertEqual((row["poll"], row["progress"], row["chunks_expected"], row["transfer_started"]),
                         ("Transferring", -1, None, True))
        status, body = self.client.force_fail({"rid": "frozen-1"})
        self.assertEqual((status, body["result"]), (409, "transfer_live"))
        status, body = self.client.force_fail({"rid": "frozen-1", "prefill_stopped": True})
        self.assertEqual((status, body["levers"]), (200, ["abort"]))
        harness.wait_until(lambda: "frozen-1" in self.scheduler.released_pages)
        self.assertEqual(self.scheduler.num_transfer_failed_reqs, 1)
        self.assertEqual(self.peer.aborts, [77])


class LeverDetectionTest(unittest.TestCase):
    def run_scheduler(self, scheduler):
        loop, monitor = harness.start_loop(scheduler)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        return harness.Client(monitor.listener.port)

    def test_the_managers_flag_alone_does_not_defer(self):
        """Issue 18: upstream's Mooncake manager forces its flag on while the transfer queue reads SGLang's own
        setting (off by default); reading the manager alone offered deferred_abort for pages freed at once."""
        for env, manager in (({}, standins.DecodeKVManager(deferred=True)),
                             ({decode.DEFERRED_SETTING: "0"}, standins.DecodeKVManager(deferred=True)),
                             ({decode.DEFERRED_SETTING: "1"}, standins.NoAckDecodeKVManager(deferred=True))):
            with self.subTest(env=env, manager=type(manager).__name__), mock.patch.dict(os.environ, env, clear=False):
                if not env:
                    os.environ.pop(decode.DEFERRED_SETTING, None)
                s = standins.DecodeScheduler(backend="mooncake", manager=manager)
                peer = standins.PrefillPeer()
                live = s.add_request("live-9", 99, peer=peer)
                unhooked_pass(s)
                live.kv_receiver.start_transfer()
                peer.writing.add(99)
                client = self.run_scheduler(s)
                _, body = client.get_json()
                self.assertIs(body["server"]["deferred_release"], False)
                status, body = client.force_fail({"rid": "live-9"})
                self.assertEqual((status, body["result"]), (409, "transfer_live"),
                                 "a started transfer released without prefill_stopped: its pages are freed at once")

    def test_no_deferred_release_in_this_release(self):
        s = standins.DecodeScheduler(backend="mooncake", manager=standins.DecodeKVManager(deferred=None))
        s.add_request("r1", 5)
        unhooked_pass(s)
        client = self.run_scheduler(s)
        _, body = client.get_json()
        self.assertIsNone(body["server"]["deferred_release"])
        status, body = client.force_fail({"rid": "r1", "prefill_stopped": True})
        self.assertEqual((status, body["levers"]), (200, ["abort"]))

    def test_register_that_wants_more_than_the_room_is_not_called(self):
        s = standins.DecodeScheduler(backend="nixl", manager=standins.OlderDecodeKVManager())
        s.kv_manager.transfer_statuses = {}
        s.add_request("r1", 5, peer=standins.PrefillPeer())
        unhooked_pass(s)
        client = self.run_scheduler(s)
        status, body = client.force_fail({"rid": "r1", "prefill_stopped": True})
        self.assertEqual((status, body["levers"]), (200, ["abort"]))

    def test_receiver_without_abort_is_unsupported(self):
        class NixlKVReceiver(standins.NixlKVReceiver):
            abort = None

        s = standins.DecodeScheduler(backend="nixl")
        s.add_request("r1", 5, receiver_cls=NixlKVReceiver)
        s.add_request("HEALTH_CHECK_1", 0, host=standins.FAKE_BOOTSTRAP_HOST, port=None, handshake=False)
        unhooked_pass(s)
        client = self.run_scheduler(s)
        _, body = client.get_json()
        self.assertEqual(body["server"]["levers"], [])
        self.assertIn("has no abort()", body["server"]["lever_note"])
        for dry_run in (False, True):
            status, body = client.force_fail({"rid": "r1", "dry_run": dry_run, "prefill_stopped": True})
            self.assertEqual((status, body["result"]), (501, "unsupported"))
        status, body = client.force_fail({"rid": "HEALTH_CHECK_1"})
        self.assertEqual((status, body["result"]), (409, "health_check"))

    def test_transfer_pass_that_raises_on_failed_is_unsupported(self):
        class RaisingTransferQueue(standins.DecodeTransferQueue):
            def pop_transferred(self):
                for decode_req in self.queue:
                    if decode_req.kv_receiver.poll() == KVPoll.Failed:
                        raise Exception("Transfer failed")
                return []

        s = standins.DecodeScheduler(backend="nixl")
        s.disagg_decode_transfer_queue.__class__ = RaisingTransferQueue
        s.add_request("r1", 5)
        client = self.run_scheduler(s)
        _, body = client.get_json()
        self.assertEqual(body["server"]["levers"], [])
        self.assertIn("raises in its KVPoll.Failed branch", body["server"]["lever_note"])

    def test_abort_detection_follows_super_calls(self):
        class Wrapped(standins.NixlKVReceiver):
            def abort(self):
                return super().abort()

        class Silent(standins.NixlKVReceiver):
            def abort(self):
                self.kv_mgr.record_failure(self.bootstrap_room, "noted")

        self.assertEqual(decode.detect(Wrapped, "").levers, ("abort",))
        self.assertIn("does not latch", decode.detect(Silent, "").note)

    def test_only_the_decode_hook_acts_on_a_decode_scheduler(self):
        s = standins.DecodeScheduler(backend="nixl")
        calls = []
        self.assertEqual(hook.around_inflight_pass(lambda sch: calls.append(1) or "x", s), "x")
        self.assertIsNone(hook.monitor_for(s))
        self.assertEqual(calls, [1])


class ThreadingTest(unittest.TestCase):
    def test_plugin_failures_never_reach_the_decode_scheduler(self):
        from sglang_watchdog_plugin.decode_monitor import DecodeMonitor
        from sglang_watchdog_plugin.identity import identify

        class Broken(standins.DecodeScheduler):
            breaking = False

            @property
            def disagg_decode_transfer_queue(self):
                if self.breaking:
                    raise RuntimeError("plugin-visible breakage")
                return self._transfer_queue

            @disagg_decode_transfer_queue.setter
            def disagg_decode_transfer_queue(self, value):
                self._transfer_queue = value

        broken = Broken()
        broken.breaking = True
        monitor = DecodeMonitor(identify(broken))
        with self.assertLogs("sglang_watchdog_plugin", "ERROR") as logs:
            for _ in range(50):
                monitor.before_pass(broken)
                monitor.after_pass(broken)
        self.assertEqual(len(logs.output), 1)  # rate-limited, not once per pass
        self.assertEqual(monitor.iterations, 50)


    def test_listing_never_touches_receivers(self):
        s = standins.DecodeScheduler(backend="nixl")
        s.add_request("r1", 5)
        unhooked_pass(s)
        loop, monitor = harness.start_loop(s)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        receiver = s.disagg_decode_transfer_queue.queue[0].kv_receiver
        seen = []
        original = receiver.poll
        receiver.poll = lambda: (seen.append(threading.get_ident()), original())[1]
        harness.Client(monitor.listener.port).get_json()
        loop.wait_passes(2)
        self.assertEqual(set(seen), {loop.thread.ident})


if __name__ == "__main__":
    unittest.main()


class _OldNixlReceiver:
    """NixlKVReceiver.poll as in SGLang v0.4.10 (disaggregation/nixl/conn.py): never asks the manager."""

    def __init__(self, mgr):
        self.kv_mgr, self.conclude_state, self.started_transfer, self.bootstrap_room = mgr, None, True, 5

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.started_transfer:
            return KVPoll.WaitingForInput
        return KVPoll.WaitingForInput

    def abort(self):
        self.conclude_state = KVPoll.Failed


class _EmptyStatusManager:
    """A manager whose per-room status has no entry for the room, or says Failed where poll() would not."""

    def __init__(self, status=None):
        self.status = status

    def check_status(self, room):
        if self.status is None:
            raise KeyError(room)
        return self.status


class RegressionsFoundOnSGLangTest(unittest.TestCase):
    """Plugin bugs the conformance suite showed on SGLang's own decode code."""

    def test_nixl_poll_without_manager_status_reads_waiting_for_input(self):
        # v0.4.10: the listing said Unknown while SGLang's poll() said WaitingForInput.
        for status in (None, KVPoll.Failed):
            receiver = _OldNixlReceiver(_EmptyStatusManager(status))
            view = decode.observe_receiver(receiver, 5)
            self.assertEqual(view.poll, int(receiver.poll()), status)

    def test_prealloc_abort_is_polled_where_sglang_skips_waiting_requests(self):
        # v0.5.11 and older: _update_handshake_waiters returns without polling while every prealloc request has
        # waiting_for_input set, so an aborted one stayed queued; the order makes SGLang poll it again.
        receiver = _OldNixlReceiver(_EmptyStatusManager(KVPoll.WaitingForInput))
        receiver.started_transfer = False
        req = type("Req", (), {"rid": "r-1", "bootstrap_room": 5, "bootstrap_host": "10.0.0.7"})()
        decode_req = type("DecodeRequest", (), {})()
        decode_req.req, decode_req.kv_receiver, decode_req.waiting_for_input = req, receiver, True
        scheduler = type("S", (), {})()
        scheduler.disagg_decode_prealloc_queue = type("Q", (), {"queue": [decode_req]})()
        caps = decode.Capabilities((decode.ABORT,), "")
        for dry_run, expected in ((True, True), (False, False)):
            outcome = decode.apply_order(ForceFailOrder("r-1", 5, "stuck", dry_run), scheduler, lambda r: caps,
                                         lambda d, registered: False)
            self.assertEqual(outcome.status, 200, outcome)
            self.assertIs(decode_req.waiting_for_input, expected, f"dry_run={dry_run}")
        self.assertEqual(receiver.conclude_state, KVPoll.Failed)


class PrefillRankAddrsTest(unittest.TestCase):
    """prefill_rank_addrs from the bootstrap infos of each release's receivers."""

    def addrs(self, **attrs):
        return decode_observe.prefill_rank_addrs(type("Receiver", (), attrs)())

    def test_bootstrap_infos_in_order_without_repeats(self):
        infos = [{"rank_ip": "10.0.0.2", "rank_port": 40002, "is_dummy": False, "pp_rank": 1},
                 {"rank_ip": "10.0.0.1", "rank_port": 40001}, {"rank_ip": "10.0.0.2", "rank_port": 40002},
                 {"rank_ip": "fd00::7", "rank_port": "40003"}]
        self.assertEqual(self.addrs(bootstrap_infos=infos), ("10.0.0.2:40002", "10.0.0.1:40001", "[fd00::7]:40003"))

    def test_one_bootstrap_info_as_v0_4_6_keeps_it(self):
        self.assertEqual(self.addrs(bootstrap_info={"rank_ip": "10.0.0.3", "rank_port": 5}), ("10.0.0.3:5",))

    def test_unknown_until_fetched_and_malformed_entries_skipped(self):
        self.assertIsNone(self.addrs())
        self.assertIsNone(self.addrs(bootstrap_infos=None))  # a failed fetch (v0.5.18)
        self.assertIsNone(self.addrs(bootstrap_infos=[]))
        self.assertIsNone(self.addrs(bootstrap_infos="10.0.0.1:1"))
        bad = [{"rank_ip": "", "rank_port": 1}, {"rank_ip": "10.0.0.1"}, {"rank_ip": "10.0.0.1", "rank_port": True},
               {"rank_ip": "10.0.0.1", "rank_port": "x"}, None, 7]
        self.assertIsNone(self.addrs(bootstrap_infos=bad))

    def test_bounded(self):
        infos = [{"rank_ip": "10.0.0.1", "rank_port": p} for p in range(1, 1000)]
        self.assertEqual(len(self.addrs(bootstrap_infos=infos)), decode_observe.MAX_PREFILL_RANK_ADDRS)


class PreallocIssue18Test(unittest.TestCase):
    """Issue 18: prealloc requests waiting for memory, and releases SGLang would not survive."""

    def start(self, scheduler):
        loop, monitor = harness.start_loop(scheduler)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        return loop, harness.Client(monitor.listener.port)

    def rows(self, client):
        status, body = client.get_json()
        self.assertEqual(status, 200)
        return {row["rid"]: row for row in body["decode_requests"]}

    def test_waiting_for_memory_is_listed_as_such(self):
        peer = standins.PrefillPeer()
        pages = standins.PagePool(slots=2)
        elsewhere = pages.alloc("running-1")  # a running request holds one page slot
        s = standins.DecodeScheduler(pages=pages)
        s.add_request("first-1", 11, peer=peer)
        s.add_request("memory-1", 12, peer=peer)  # handshaken, but the last free page slot goes to first-1
        s.add_request("booting-1", 13, peer=peer, handshake=False)
        loop, client = self.start(s)
        harness.wait_until(lambda: self.rows(client).get("memory-1", {}).get("poll") == "WaitingForInput")
        rows = self.rows(client)
        self.assertEqual((rows["memory-1"]["queue"], rows["memory-1"]["waiting_for_memory"]), ("prealloc", True))
        self.assertIs(rows["booting-1"]["waiting_for_memory"], False)  # its handshake is not done
        self.assertIs(rows["first-1"]["waiting_for_memory"], False)  # it has its pages
        self.assertEqual(rows["first-1"]["queue"], "transfer")

        loop.pause()
        try:
            pages.free(elsewhere)  # the running request finished
        finally:
            loop.resume()
        harness.wait_until(lambda: self.rows(client)["memory-1"]["queue"] == "transfer")
        self.assertIs(self.rows(client)["memory-1"]["waiting_for_memory"], False)

    def test_release_of_a_pending_request_is_refused_where_sglang_would_die(self):
        # The stand-in's pop_preallocated has SGLang v0.5.14's shape: it sets a failed request's kv_receiver to
        # None and leaves it in pending_reqs, whose next _resolve_pending_reqs then raises AttributeError.
        s = standins.DecodeScheduler()
        pending = s.add_request("pending-1", 21, handshake=False)
        resolved = s.add_request("resolved-1", 22, handshake=False)
        s.disagg_decode_prealloc_queue.pending_reqs.append(pending)
        _, client = self.start(s)
        status, body = client.force_fail({"rid": "pending-1", "bootstrap_room": 21})
        self.assertEqual((status, body["result"]), (501, "unsupported"), body)
        self.assertIn("pending_reqs", body["error"])
        self.assertIsNone(pending.kv_receiver.conclude_state, "a refused order changed the receiver")
        status, body = client.force_fail({"rid": "pending-1", "dry_run": True})
        self.assertEqual((status, body["result"]), (501, "unsupported"), body)
        # A request whose peer is resolved (not in pending_reqs) is released as before.
        status, body = client.force_fail({"rid": "resolved-1"})
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        harness.wait_until(lambda: s.num_bootstrap_failed_reqs == 1)

    def test_pending_release_problem_is_read_from_the_code(self):
        class Keeps:  # v0.5.10, v0.5.11: the failed request keeps its receiver
            def pop_preallocated(self):
                for decode_req in self.queue:
                    decode_req.kv_receiver.clear()

        class ClearsAndDrops:  # v0.5.18: gone from pending_reqs as well
            def pop_preallocated(self, failed_ids):
                for decode_req in self.queue:
                    decode_req.kv_receiver = None
                self.pending_reqs = [r for r in self.pending_reqs if id(r) not in failed_ids]

        class ClearsOnly:  # v0.5.14
            def pop_preallocated(self):
                for decode_req in self.queue:
                    decode_req.kv_receiver = None

        class Unreadable:
            pop_preallocated = staticmethod(len)

        self.assertEqual(decode.pending_release_problem(Keeps), "")
        self.assertEqual(decode.pending_release_problem(ClearsAndDrops), "")
        self.assertIn("leaves it in pending_reqs", decode.pending_release_problem(ClearsOnly))
        self.assertIn("cannot be read", decode.pending_release_problem(Unreadable))
