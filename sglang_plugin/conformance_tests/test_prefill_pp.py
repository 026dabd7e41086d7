"""The plugin under SGLang's PP prefill loop (issue 16, point 2), on the release's own PP and prefill code.

PP2 here is two PPPrefillStage benches in one process (conformance/prefill_pp.py), pp_rank 0 and 1 of
pp_size 2, each with its own prefill and decode KV managers (and a bootstrap server of its own), each running
the release's own ``event_loop_pp_disagg_prefill`` on its own thread: per microbatch, each stage's transferred
rids (its own senders polled, intersected with the previous stage's), the last stage's consensus sent round the
ring, and ``process_disagg_prefill_inflight_queue(rids)`` on the consensus that came round, hooked by the
plugin as the release loads it. Each stage is its own listener, as in SGLang (port index
``dp_rank * pp_size + pp_rank``). What stands in: the PP group's pyobj messages (FIFOs, matched by order as
over torch.distributed) and the loop's batch work (no request is scheduled here; requests join the inflight
queue as a finished forward pass leaves them). A request has one rid on both stages (SGLang's consensus is by
rid) and a room of its own on each: each stage's managers are registered with a bootstrap server of their own.

What SGLang's loop does, and these tests assert: a request leaves a stage's inflight queue only once its rid is
in the consensus, that is once every stage's own poll reads Success or Failed; then every stage releases it by
its own poll: Success (``FINISH_LENGTH``, its KV went out) or Failed (``FINISH_ABORT``, the transfer-failed
counter). So a force-fail through one stage releases nothing while another stage's transfer is live, and
releases the request on every stage once the other stages' transfers are terminal: failed by their own
force-fail, or succeeded (that stage answers ``409 transfer_succeeded`` and releases it as sent).
"""

import ast
import inspect
import unittest

from sglang_watchdog_plugin import hook
from sglang_watchdog_plugin.conformance import aftermath, decode_bench, prefill_pp, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

_RT = None
_rooms = iter(range(140000, 180000))
_rids = iter(range(1, 100000))
_WAIT_S = 15  # generous: three releases run side by side on two cores


def setUpModule():
    global _RT
    test_prefill.setUpModule()  # one SGLang runtime per process, shared with the other prefill tests
    _RT = test_prefill._RT


def _no_loop_reason():
    return ("this release has no PP prefill disagg loop (neither SchedulerPPMixin nor "
            "SchedulerDisaggregationPrefillMixin defines event_loop_pp_disagg_prefill): its prefill scheduler "
            "runs event_loop_normal/overlap_disagg_prefill whatever its pp_size, which test_prefill covers")


def _calls_with_args(fn, name):
    """The calls ``self.<name>(...)`` in fn's source, as the number of arguments each passes."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(inspect.unwrap(fn))))
    return [len(node.args) + len(node.keywords) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" and node.func.attr == name]


class PPPrefillLoopShape(unittest.TestCase):
    """What the release's PP prefill loop calls, read from its code, and that the plugin hooks exactly that."""

    def test_the_loop_calls_the_hooked_pass_with_the_consensus(self):
        owner = prefill_pp.loop_owner(_RT)
        if owner is None:
            self.skipTest(_no_loop_reason())
        calls = _calls_with_args(getattr(owner, prefill_pp.LOOP), hook.METHOD)
        self.assertTrue(calls, f"the PP prefill loop does not call {hook.METHOD}")
        self.assertIn(1, calls, "the PP prefill loop does not pass the stages' consensus to the pass")
        method = getattr(_RT.prefill.SchedulerDisaggregationPrefillMixin, hook.METHOD)
        self.assertIsNot(method, inspect.unwrap(method), f"{hook.METHOD} is not hooked")


class _PPPrefill(aftermath.Checked):
    backend = None

    def setUp(self):
        owner = prefill_pp.loop_owner(_RT)
        if owner is None:
            self.skipTest(_no_loop_reason())
        why = prefill_pp.cannot_run(owner)
        if why:
            self.skipTest(why)
        channels = decode_bench.PPChannels(2)
        self.stages = [prefill_pp.PPPrefillStage(_RT, self.backend, rank, channels) for rank in (0, 1)]
        for stage in self.stages:
            stage.start()
            self.addCleanup(stage.stop)
        for stage in self.stages:
            _until(lambda: stage.monitor is not None, 30, f"the plugin's first hooked pass on PP stage {stage.pp_rank}")
        self.levers = self.stages[0].listing()["server"]["levers"]
        self.watch_aftermath(self.stages)
        self.slots = [stage.free_metadata_slots() for stage in self.stages]

    def tearDown(self):
        self.check_aftermath()
        for stage in self.stages:
            self.assertEqual(stage.errors, [], f"SGLang's PP prefill loop raised on stage {stage.pp_rank}")

    def admit(self, behaviours):
        """One request on both stages (one rid, a room each), each stage's transfer behaving as given."""
        rid = f"pp-prefill-{next(_rids)}"
        return [stage.admit(next(_rooms), behaviour, rid=rid) for stage, behaviour in zip(self.stages, behaviours)]

    def poll(self, req):
        return _RT.poll_names[int(req.disagg_kv_sender.poll())]

    def iterations(self, n):
        passes = [stage.passes for stage in self.stages]
        _until(lambda: all(stage.passes > p + n for stage, p in zip(self.stages, passes)), _WAIT_S,
               f"{n} loop iterations on both stages")

    def hold_both(self, reqs, why):
        self.iterations(8)
        for stage, req in zip(self.stages, reqs):
            self.assertTrue(stage.queued(req.rid), f"{why}: stage {stage.pp_rank} let it go")
            self.assertIsNone(stage.released(req.rid))
            self.assertIsNotNone(stage.listed(req.rid), f"{why}: stage {stage.pp_rank} does not list it")

    def released_on_both(self, reqs, reasons):
        """Each stage let the request go with the given finish reason, its pages and metadata slot back."""
        for stage, req, reason in zip(self.stages, reqs, reasons):
            _until(lambda: stage.released(req.rid) is not None, _WAIT_S, f"stage {stage.pp_rank} to release it")
            self.assertEqual(type(stage.released(req.rid)).__name__, reason, f"stage {stage.pp_rank}")
            self.assertFalse(stage.queued(req.rid))
            self.assertIn(req.rid, stage.scheduler.tree_cache.released, f"stage {stage.pp_rank} kept its pages")
            self.assertEqual(req.metadata_buffer_index, -1, f"stage {stage.pp_rank} kept its metadata slot")
        for stage, free in zip(self.stages, self.slots):
            _until(lambda: stage.free_metadata_slots() == free, _WAIT_S,
                   f"stage {stage.pp_rank}'s metadata slots to be all back")
            _until(lambda: stage.listed(reqs[stage.pp_rank].rid) is None, _WAIT_S,
                   f"stage {stage.pp_rank}'s listing to drop it")

    # Scenarios ------------------------------------------------------------

    def test_each_stage_lists_itself_and_the_request(self):
        reqs = self.admit((transports.HANG, transports.HANG))
        self.assertNotEqual(self.stages[0].url, self.stages[1].url)
        for stage, req in zip(self.stages, reqs):
            body = stage.listing()
            self.assertEqual((body["server"]["pp_rank"], body["server"]["pp_size"]), (stage.pp_rank, 2))
            # Each stage its own listener, at port offset dp_rank * pp_size + pp_rank from the base.
            self.assertEqual(stage.monitor.identity.index, stage.pp_rank)
            row = stage.listed(req.rid)
            self.assertEqual(row["bootstrap_room"], req.bootstrap_room)
            self.assertGreater(stage.monitor.iterations, 0)
        self.hold_both(reqs, "both transfers hang")

    def test_healthy_transfer_leaves_both_stages(self):
        reqs = self.admit((transports.COMPLETE, transports.COMPLETE))
        self.released_on_both(reqs, ("FINISH_LENGTH", "FINISH_LENGTH"))
        for stage in self.stages:
            self.assertEqual(stage.scheduler.metrics_collector.transfer_failed_reqs, 0)

    def test_a_hang_on_one_stage_holds_the_request_on_both(self):
        reqs = self.admit((transports.COMPLETE, transports.HANG))
        _until(lambda: self.poll(reqs[0]) == "Success", _WAIT_S, "stage 0's transfer to complete")
        self.hold_both(reqs, "stage 1's transfer hangs")
        self.assertIn(self.poll(reqs[1]), ("WaitingForInput", "Transferring"))

    def test_force_fail_on_one_stage_releases_nothing_until_every_stage_is_force_failed(self):
        reqs = self.admit((transports.HANG, transports.HANG))
        status, body = self.stages[0].force_fail(reqs[0])
        if not self.levers:
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            self.hold_both(reqs, "no lever")
            return
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self.assertEqual(self.poll(reqs[0]), "Failed")
        self.hold_both(reqs, "force-failed on stage 0 only")
        status, body = self.stages[1].force_fail(reqs[1])
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self.released_on_both(reqs, ("FINISH_ABORT", "FINISH_ABORT"))
        for stage in self.stages:
            self.assertEqual(stage.scheduler.metrics_collector.transfer_failed_reqs, 1, f"stage {stage.pp_rank}")

    def test_one_force_fail_releases_it_where_the_other_stage_already_sent(self):
        """Stage 0 sent its share (Success), stage 1's hangs: stage 0 refuses (transfer_succeeded), stage 1's
        force-fail alone completes the consensus, and each stage releases the request by its own poll."""
        reqs = self.admit((transports.COMPLETE, transports.HANG))
        _until(lambda: self.poll(reqs[0]) == "Success", _WAIT_S, "stage 0's transfer to complete")
        if not self.levers:  # 501 is answered first, from the listing
            for stage, req in zip(self.stages, reqs):
                status, body = stage.force_fail(req)
                self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            self.hold_both(reqs, "no lever")
            return
        status, body = self.stages[0].force_fail(reqs[0])
        self.assertEqual((status, body["result"]), (409, "transfer_succeeded"), body)
        status, body = self.stages[1].force_fail(reqs[1])
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self.released_on_both(reqs, ("FINISH_LENGTH", "FINISH_ABORT"))
        self.assertEqual([s.scheduler.metrics_collector.transfer_failed_reqs for s in self.stages], [0, 1])


class Nixl(_PPPrefill, unittest.TestCase):
    backend = "nixl"


class Mooncake(_PPPrefill, unittest.TestCase):
    backend = "mooncake"


if __name__ == "__main__":
    unittest.main()
