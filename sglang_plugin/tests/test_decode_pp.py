"""The plugin under SGLang's PP decode loop, which never calls process_decode_queue (issue 18)."""

import os
import threading
import time
import unittest
from unittest import mock

from sglang_watchdog_plugin import hook

from . import harness, standins
from .standins import KVPoll

LIVE_ROOM = 18446744073709551557
DONE_ROOM = 9223372036854775017


class PPDecodeMixin:
    """SchedulerPPMixin's two decode passes as event_loop_pp_disagg_decode calls them, once per microbatch,
    with the stages' consensus (None before the first one came round the ring)."""

    def process_prealloc_queue(self, prealloc_rids):
        if prealloc_rids is None:
            return None
        good, failed = self.disagg_decode_prealloc_queue.pop_preallocated()
        self.disagg_decode_transfer_queue.extend(good)
        return [[d.req.rid for d in good], [d.req.rid for d in failed]]

    def process_decode_transfer_queue(self, release_rids):
        if release_rids is None:
            return None
        queue = self.disagg_decode_transfer_queue
        # pop_transferred(release_rids): only the requests every stage agreed on are polled and may leave.
        held = [d for d in queue.queue if d.req.rid not in release_rids]
        queue.queue = [d for d in queue.queue if d.req.rid in release_rids]
        released = queue.pop_transferred()
        queue.queue += held
        self.waiting_queue.extend(released)
        return [r.rid for r in released]


hook.install(PPDecodeMixin, hook.PP_PREALLOC_METHOD)
hook.install(PPDecodeMixin, hook.PP_TRANSFER_METHOD)


class PPDecodeScheduler(PPDecodeMixin, standins.DecodeScheduler):
    pass


class PPLoop:
    """The PP decode loop's queue work: per microbatch the prealloc pass then the transfer pass, never
    process_decode_queue. ``other_stage_terminal``: the rids the other stage's poll has at Success or Failed;
    only those can be in the consensus."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.other_stage_terminal = set()
        self.microbatches = 0
        self.results = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held during a microbatch: with_loop_paused takes it
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def step(self):
        s = self.scheduler
        with self._lock:
            release = [rid for rid in self.other_stage_terminal
                       if any(d.req.rid == rid for d in s.disagg_decode_transfer_queue.queue)]
            self.results.append((s.process_prealloc_queue([[], []]), s.process_decode_transfer_queue(release)))
            self.microbatches += 1

    def _loop(self):
        while not self._stop.is_set():
            self.step()
            time.sleep(0.002)

    def start(self):
        with mock.patch.dict(os.environ, harness.plugin_env()):
            self.step()
        self.thread.start()
        return self

    def stop(self):
        self._stop.set()
        self.thread.join(5)


class PPDecodeTest(unittest.TestCase):
    def setUp(self):
        self.peer = standins.PrefillPeer()
        s = self.scheduler = PPDecodeScheduler(backend="nixl", pp_rank=1, pp_size=2)
        self.live = s.add_request("live-1", LIVE_ROOM, peer=self.peer)
        self.done = s.add_request("done-1", DONE_ROOM, peer=self.peer)
        standins.DecodeMixin.process_decode_queue.__wrapped__(s)  # both move to the transfer queue
        s.kv_manager.receive_chunk(LIVE_ROOM, 0)
        self.peer.writing.add(LIVE_ROOM)
        self.loop = PPLoop(s).start()
        self.addCleanup(self.loop.stop)
        self.monitor = hook.monitor_for(s)
        self.assertIsNotNone(self.monitor, "the PP passes did not start the decode monitor")
        self.addCleanup(self.monitor.close)
        self.client = harness.Client(self.monitor.listener.port)

    def rows(self):
        status, body = self.client.get_json()
        self.assertEqual(status, 200)
        return {row["rid"]: row for row in body["decode_requests"]}

    def test_lists_the_stuck_request_without_process_decode_queue(self):
        rows = self.rows()
        self.assertEqual(rows["live-1"]["queue"], "transfer")
        self.assertTrue(rows["live-1"]["transfer_started"])
        _, body = self.client.get_json()
        self.assertEqual((body["server"]["pp_rank"], body["server"]["pp_size"]), (1, 2))

    def test_one_pass_per_microbatch(self):
        with self.loop._lock:
            before = (self.loop.microbatches, self.monitor.iterations)
        time.sleep(0.05)
        with self.loop._lock:
            after = (self.loop.microbatches, self.monitor.iterations)
        self.assertGreater(after[0], before[0])
        self.assertEqual(after[1] - before[1], after[0] - before[0])

    def test_arguments_and_results_pass_through(self):
        with self.loop._lock:
            s = self.scheduler
            self.assertIsNone(s.process_prealloc_queue(None))
            self.assertIsNone(s.process_decode_transfer_queue(None))
            self.assertEqual(s.process_prealloc_queue([["x"], []]), [[], []])
        self.assertTrue(all(r == ([[], []], []) for r in self.loop.results[1:]))

    def test_release_is_applied_on_the_scheduler_thread_and_leaves_the_queue(self):
        receiver = self.live.kv_receiver
        status, body = self.client.force_fail({"rid": "live-1", "prefill_stopped": True})
        self.assertEqual((status, body["result"]), (200, "flipped"))
        self.assertEqual(receiver.conclude_state, KVPoll.Failed)
        time.sleep(0.05)
        self.assertIn("live-1", self.rows())  # the other stage has not failed it yet: SGLang keeps it
        self.loop.other_stage_terminal.add("live-1")
        harness_until(lambda: "live-1" not in self.rows())
        self.assertEqual(self.scheduler.num_transfer_failed_reqs, 1)

    def test_a_stage_at_success_is_aborted_like_the_others(self):
        receiver = self.done.kv_receiver

        def complete_unpolled():
            self.scheduler.kv_manager.receive_chunk(DONE_ROOM, 0, last_of=1)
            self.scheduler.kv_manager.receive_aux(DONE_ROOM)
            # Another stage is not terminal yet: SGLang's consensus keeps the request here.
            receiver.poll = lambda: KVPoll.Success

        with self.loop._lock:
            complete_unpolled()
        status, body = self.client.force_fail({"rid": "done-1"})
        self.assertEqual((status, body["result"]), (409, "transfer_live"))
        self.assertIsNone(receiver.conclude_state)
        status, body = self.client.force_fail({"rid": "done-1", "prefill_stopped": True})
        self.assertEqual((status, body["result"]), (200, "flipped"))
        self.assertEqual(receiver.conclude_state, KVPoll.Failed)


def harness_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


class PassPairingTest(unittest.TestCase):
    """Calls of the passes in the orders a loop may make them, counted on the monitor."""

    def scheduler_with_monitor(self):
        s = PPDecodeScheduler(backend="nixl", pp_size=2)
        with mock.patch.dict(os.environ, harness.plugin_env()):
            s.process_decode_transfer_queue(None)
        monitor = hook.monitor_for(s)
        self.addCleanup(monitor.close)
        return s, monitor

    def test_a_loop_calling_both_hooks_counts_one_pass(self):
        s, monitor = self.scheduler_with_monitor()
        base = monitor.iterations

        def queue_pass(self_):
            self_.process_prealloc_queue([[], []])
            self_.process_decode_transfer_queue([])

        with mock.patch.object(standins.DecodeMixin.process_decode_queue, "__wrapped__", queue_pass):
            hook.around_decode_pass(queue_pass, s)
        self.assertEqual(monitor.iterations - base, 1)

    def test_a_transfer_pass_alone_and_an_unclosed_prealloc_pass_each_count_once(self):
        s, monitor = self.scheduler_with_monitor()
        base = monitor.iterations
        s.process_decode_transfer_queue([])  # 1
        s.process_prealloc_queue([[], []])  # 2, never closed by its transfer pass
        s.process_prealloc_queue([[], []])  # closes 2, opens 3
        s.process_decode_transfer_queue([])  # closes 3
        self.assertEqual(monitor.iterations - base, 3)
        self.assertIsNone(monitor.pass_owner)

    def test_sglang_exceptions_go_up_and_the_next_pass_runs(self):
        s, monitor = self.scheduler_with_monitor()

        def broken(self_, rids):
            raise RuntimeError("SGLang's own")

        with self.assertRaisesRegex(RuntimeError, "SGLang's own"):
            hook.around_pp_transfer_pass(broken, s, [])
        self.assertIsNone(monitor.pass_owner)
        base = monitor.iterations
        s.process_prealloc_queue([[], []])
        s.process_decode_transfer_queue([])
        self.assertEqual(monitor.iterations - base, 1)

    def test_a_prefill_scheduler_runs_them_unhooked(self):
        s = standins.NewScheduler(mode="prefill")
        calls = []
        self.assertEqual(hook.around_pp_prealloc_pass(lambda sch, r: calls.append(r) or "p", s, ["a"]), "p")
        self.assertEqual(hook.around_pp_transfer_pass(lambda sch, r: calls.append(r) or "t", s, ["b"]), "t")
        self.assertEqual(calls, [["a"], ["b"]])
        self.assertIsNone(hook.monitor_for(s))


class SinglePPStageTest(unittest.TestCase):
    def test_without_pp_a_succeeded_transfer_is_still_refused(self):
        from sglang_watchdog_plugin import decode
        from sglang_watchdog_plugin.orders import ForceFailOrder

        s = standins.DecodeScheduler(backend="nixl")
        done = s.add_request("done-1", DONE_ROOM, peer=standins.PrefillPeer())
        standins.DecodeMixin.process_decode_queue.__wrapped__(s)
        done.kv_receiver.poll = lambda: KVPoll.Success
        s.kv_manager.receive_chunk(DONE_ROOM, 0, last_of=1)
        s.kv_manager.receive_aux(DONE_ROOM)
        order = ForceFailOrder("done-1", None, None, False, prefill_stopped=True)
        caps = lambda receiver: decode.detect(type(receiver), "")  # noqa: E731
        outcome = decode.apply_order(order, s, caps, lambda d, r: False)
        self.assertEqual((outcome.status, outcome.body["result"]), (409, "transfer_succeeded"))
        outcome = decode.apply_order(order, s, caps, lambda d, r: False, pp_stages=2)
        self.assertEqual((outcome.status, outcome.body["result"]), (200, "flipped"))


if __name__ == "__main__":
    unittest.main()
