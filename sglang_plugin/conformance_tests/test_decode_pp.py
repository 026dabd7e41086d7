"""The plugin under SGLang's PP decode loop (issue 18), on the release's own PP and decode code.

``event_loop_pp_disagg_decode`` (``managers/scheduler_pp_mixin.py``) never
calls ``process_decode_queue``. PP2 here is two PPDecodeStage benches in one
process (decode_bench.py), each with its own KV managers and receivers, whose
loops run the release's own stage consensus and the two PP decode passes the
plugin hooks there, passing SGLang's messages between stages through FIFOs
instead of torch.distributed. A request has one rid on both stages (SGLang's
consensus is by rid) and a room of its own on each: one prefill manager
sends to both stages' receivers, and its per-room state is keyed by room.
"""

import ast
import inspect
import os
import time
import unittest

from sglang_watchdog_plugin import hook
from sglang_watchdog_plugin.conformance import aftermath, decode_bench, runtime, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

_RT = None
_rooms = iter(range(100000, 140000))
_rids = iter(range(1, 100000))


def setUpModule():
    global _RT
    if not os.environ.get("SGLANG_SRC"):
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise unittest.SkipTest("no SGLang source (SGLANG_SRC) and no installed sglang: nothing to run on")
    _RT = runtime.Runtime()


def _pp_mixin():
    try:
        module = runtime.loader.load("sglang.srt.managers.scheduler_pp_mixin")[0]
    except ImportError:
        return None
    return getattr(module, "SchedulerPPMixin", None)


def _pp_decode_loop():
    """The release's PP decode event loop, or None with the reason."""
    mixin = _pp_mixin()
    loop = getattr(mixin, "event_loop_pp_disagg_decode", None)
    if loop is None:
        return None, ("this release has no PP decode loop (no SchedulerPPMixin.event_loop_pp_disagg_decode): "
                      "its decode scheduler runs process_decode_queue whatever its pp_size")
    return loop, ""


def _self_calls(fn):
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(inspect.unwrap(fn))))
    return {node.func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"}


class PPDecodeLoopShape(unittest.TestCase):
    """What the release's PP decode loop calls, read from its code, and that the plugin hooks exactly that."""

    def test_the_loop_calls_the_hooked_passes_and_not_process_decode_queue(self):
        loop, why = _pp_decode_loop()
        if loop is None:
            self.skipTest(why)
        calls = _self_calls(loop)
        self.assertNotIn("process_decode_queue", calls)
        for name in (hook.PP_PREALLOC_METHOD, hook.PP_TRANSFER_METHOD):
            self.assertIn(name, calls)
            method = getattr(_pp_mixin(), name)
            self.assertIsNot(method, inspect.unwrap(method), f"SchedulerPPMixin.{name} is not hooked")


class _PPBackend(aftermath.Checked):
    backend = None

    def setUp(self):
        loop, why = _pp_decode_loop()
        if loop is None:
            self.skipTest(why)
        channels = decode_bench.PPChannels(2)
        first = decode_bench.PPDecodeStage(_RT, self.backend, 0, channels)
        # One prefill server sends to both stages' receivers.
        self.stages = [first, decode_bench.PPDecodeStage(_RT, self.backend, 1, channels, prefill_mgr=first.prefill_mgr)]
        for stage in self.stages:
            stage.start()
            self.addCleanup(stage.stop)
        for stage in self.stages:
            _until(lambda: stage.monitor is not None, 30, f"the plugin's first hooked pass on PP stage {stage.pp_rank}")
        self.levers = self.stages[0].listing()["server"]["levers"]
        # Mooncake here: both stages' decode managers share one Mooncake engine and session in this one process
        # (real PP stages are processes of their own), and a second request never reaches Success on either stage,
        # with no action taken (the healthy scene's second request too); only threads and exceptions are checked.
        self.watch_aftermath(self.stages, unserved="a second request is never served by this bench's shared Mooncake "
                                                   "session" if self.backend == "mooncake" else None)

    def tearDown(self):
        self.check_aftermath()
        for stage in self.stages:
            self.assertEqual(stage.errors, [], f"SGLang's PP decode work raised on stage {stage.pp_rank}")

    def admit(self, behaviours):
        """One request on both stages, with each stage's transfer behaving as given."""
        rid = f"pp-{next(_rids)}"
        reqs = [stage.admit(next(_rooms), behaviour, rid=rid) for stage, behaviour in zip(self.stages, behaviours)]
        # Before anything is done to the request: stage 0 may release it, and count it, as soon as it is failed.
        self.failed_before = self.stages[0].scheduler.metrics_collector.transfer_failed_reqs
        return reqs

    def test_each_stage_lists_itself_and_the_request(self):
        reqs = self.admit((transports.HANG, transports.HANG))
        for stage, req in zip(self.stages, reqs):
            body = stage.listing()
            self.assertEqual((body["server"]["pp_rank"], body["server"]["pp_size"]), (stage.pp_rank, 2))
            row = stage.listed(req.rid)
            self.assertEqual((row["queue"], row["bootstrap_room"]), ("transfer", req.bootstrap_room))
            self.assertGreater(stage.monitor.iterations, 0)

    def test_healthy_transfer_leaves_both_stages_for_decoding(self):
        reqs = self.admit((transports.COMPLETE, transports.COMPLETE))
        for stage, req in zip(self.stages, reqs):
            _until(lambda: stage.transferred(req.rid), 10, f"stage {stage.pp_rank} to let the request go")
            self.assertIsNone(req.finished_reason)

    def test_release_on_one_stage_holds_until_every_stage_released_it(self):
        reqs = self.admit((transports.HANG, transports.HANG))
        if not self.levers:
            status, body = self.stages[0].force_fail(reqs[0], prefill_stopped=True)
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            return
        status, body = self.stages[0].force_fail(reqs[0], prefill_stopped=True)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self._hold_both(reqs, "released on stage 0 only")
        status, body = self.stages[1].force_fail(reqs[1], prefill_stopped=True)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self._as_sglang_releases_a_failed_request(reqs)

    def test_sglang_own_abort_releases_it_the_same_way(self):
        """What Scheduler.abort_request does on every stage (the abort reaches each stage with the inputs):
        ``kv_receiver.abort()`` on the transfer-queue request, on the scheduler thread."""
        reqs = self.admit((transports.HANG, transports.HANG))
        if not hasattr(reqs[0].decode_request.kv_receiver, "abort"):
            self.skipTest("this release's receiver has no abort(): SGLang's abort_request skips it")
        for stage, req in zip(self.stages, reqs):
            stage.call(req.decode_request.kv_receiver.abort)
        self._as_sglang_releases_a_failed_request(reqs)

    def test_a_stage_at_success_is_released_with_the_others(self):
        reqs = self.admit((transports.COMPLETE, transports.HANG))
        if not self.levers:
            self.skipTest("no decode lever on this release and backend")
        stage0 = self.stages[0]
        _until(lambda: self._poll(reqs[0]) == "Success", 10, "stage 0's transfer to complete")
        self._hold_both(reqs, "stage 1's transfer hangs")
        # Released on stage 1 alone, stage 0 would decode it: a Success stage is not "transfer_succeeded" here.
        status, body = stage0.force_fail(reqs[0])
        self.assertEqual((status, body["result"]), (409, "transfer_live"), body)
        for stage, req in zip(self.stages, reqs):
            status, body = stage.force_fail(req, prefill_stopped=True)
            self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self._as_sglang_releases_a_failed_request(reqs)

    def _poll(self, req):
        receiver = req.decode_request.kv_receiver
        return None if receiver is None else _RT.poll_names[int(receiver.poll())]

    def _iterations(self, n):
        passes = [stage.passes for stage in self.stages]
        _until(lambda: all(stage.passes > p + n for stage, p in zip(self.stages, passes)), 10, f"{n} loop iterations")

    def _hold_both(self, reqs, why):
        self._iterations(5)
        for stage, req in zip(self.stages, reqs):
            self.assertEqual(stage.queue_of(req.rid), "transfer", f"{why}: stage {stage.pp_rank} let it go")
            self.assertIsNone(req.finished_reason)

    def _as_sglang_releases_a_failed_request(self, reqs):
        """Once every stage's poll is Failed, the consensus comes round to stage 0, whose Failed branch of
        pop_transferred releases it (abort, pages, slot, counter). process_decode_transfer_queue passes on only
        the rids pop_transferred returned, which are the transferred ones: a failed rid never reaches the later
        stages, which keep the request queued, Failed, for good (SGLang v0.5.10 to v0.5.18)."""
        first, later = self.stages[0], self.stages[1]
        _until(lambda: not first.queued(reqs[0].rid), 10, "stage 0 to let the request go")
        self.assertEqual(type(reqs[0].finished_reason).__name__, "FINISH_ABORT")
        self.assertFalse(first.transferred(reqs[0].rid), "stage 0 went on to decode a failed request")
        self.assertIsNone(first.listed(reqs[0].rid))
        self.assertEqual(first.scheduler.metrics_collector.transfer_failed_reqs, self.failed_before + 1)
        self._iterations(20)
        self.assertEqual(later.queue_of(reqs[1].rid), "transfer", "a later stage let a failed request go")
        self.assertFalse(later.transferred(reqs[1].rid), "a later stage went on to decode a failed request")
        self.assertEqual(later.listed(reqs[1].rid)["poll"], "Failed")


class Nixl(_PPBackend, unittest.TestCase):
    backend = "nixl"


class Mooncake(_PPBackend, unittest.TestCase):
    backend = "mooncake"


if __name__ == "__main__":
    unittest.main()
