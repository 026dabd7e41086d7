"""The silent pin's seed mechanisms on SGLang's own code, release by release (issue 16, point 2).

Each test plays one seed's real event with SGLang's own objects (see
conformance/pins.py): decode's ABORT frame, the client's abort racing the
worker's status writes (a Failed resurrected by max()), the worker's
conclusion racing add_transfer_request's own status write after put(), the
client's abort before decode registered, decode's ABORT before prefill made
the room's sender. Where
SGLang's code pins the request (still in the inflight queue with a
non-terminal poll, nothing of its own in flight, no log line of SGLang's),
the test asserts the pin and then its release through the plugin's
force-fail, read from SGLang's own objects, or the plugin's honest 501. Where
SGLang's own code concludes the request itself, the test skips and says which
code does it, from what the scene showed; a release whose code lacks the
event at all (no ABORT handler, no sender abort) skips by that structure. A
stuck transfer handle, the fourth seed, is test_prefill.py's
test_stuck_handle_is_released_or_refused_honestly.
"""

import inspect
import itertools
import os
import time
import unittest

from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance import aftermath, check, pins, runtime
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

# Rooms of their own: SGLang's managers keep state per room across the benches of a process.
_rooms = itertools.count(400000)


def setUpModule():
    test_prefill.setUpModule()


def _where(fn):
    """"ClassName.method (srt/.../file.py)" of a bound SGLang method, for skip reasons."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    try:
        path = inspect.getsourcefile(fn) or "?"
    except TypeError:
        path = "?"
    marker = os.sep + "sglang" + os.sep
    path = path.split(marker, 1)[1] if marker in path else os.path.basename(path)
    return f"{fn.__qualname__} ({path})"


def _source(fn):
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""


def _file(cls):
    try:
        path = inspect.getsourcefile(cls) or "?"
    except TypeError:
        return "?"
    marker = os.sep + "sglang" + os.sep
    return path.split(marker, 1)[1] if marker in path else os.path.basename(path)


class _Pins(aftermath.Checked):
    backend = None

    def setUp(self):
        self.rt = test_prefill._RT
        self.bench = bench_module.Bench(self.rt, self.backend).start()
        self.addCleanup(self.bench.stop)
        self.watch_aftermath(self.bench)
        self.levers = self.bench.listing()["server"]["levers"]
        self.started = time.monotonic()

    def tearDown(self):
        self.check_aftermath()
        self.assertEqual(self.bench.errors, [], "SGLang's pass raised: a real scheduler would have died")

    @property
    def manager(self):
        return self.bench.prefill_mgr

    def sender_class(self):
        return runtime._class_named(self.rt.conns[self.backend], f"{self.backend}kvsender")

    # The pin, asserted and released ------------------------------------------

    def assert_pin_released(self, outcome, seed):
        req = outcome.req
        self.assertTrue(self.bench.queued(req.rid), f"{seed}: the pinned request left the queue")
        poll = self.rt.poll_names[int(req.disagg_kv_sender.poll())]
        self.assertNotIn(poll, ("Failed", "Success"), f"{seed}: pinned with a terminal poll")
        self.assertEqual(outcome.logs, [], f"{seed}: SGLang logged about the room, so the pin is not silent")
        listed = self.bench.listed(req.rid)
        self.assertIsNotNone(listed, f"{seed}: the plugin does not list the pinned request")
        self.assertEqual(listed["poll"], poll, "the listing's poll differs from SGLang's own poll()")
        status, body = self.bench.force_fail(req)
        print(f"conformance: pins: {self.backend} {seed}: pinned; force-fail answered {status} {body.get('result')}"
              f"{'' if self.levers else ' (no lever: ' + str(self.bench.listing()['server'].get('lever_note')) + ')'}",
              flush=True)
        if self.levers:
            self.assertEqual((status, body["result"]), (200, "flipped"), body)
            finish = self.bench.wait_released(req.rid)
            self.assertEqual(type(finish).__name__, "FINISH_ABORT", "released, but not as an abort")
            self.assertIn(req.rid, self.bench.scheduler.tree_cache.released, "its KV pages were not handed back")
            self.assertEqual(req.metadata_buffer_index, -1, "its metadata buffer was not handed back")
        else:
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            time.sleep(0.3)
            self.assertTrue(self.bench.queued(req.rid), "501 said nothing changed, yet the request left")
            # Honest only if SGLang's own abort, where it reaches the inflight queue, cannot release it either.
            if hasattr(req.disagg_kv_sender, "abort") and check.abort_reaches(
                    runtime.loader.loaded.source, "disagg_prefill_inflight_queue") is not False:
                self.bench.abort(req.rid)
                time.sleep(0.5)
                self.assertTrue(self.bench.queued(req.rid), "SGLang's own abort released it: the plugin has a lever")

    def conclude(self, outcome, seed, why_not_pinned, expect_pin=False):
        """The pin's assertions where SGLang pinned the request; else a skip saying what SGLang's code did.

        ``expect_pin``: the release's structure has the mechanism and the scene forces its interleaving, so a
        scene that does not pin is a broken scene, not a release without the mechanism.
        """
        print(f"\nconformance: pins: {self.backend} {seed}: {outcome!r} "
              f"({time.monotonic() - self.started:.1f} s)", flush=True)
        if outcome.pinned:
            self.assert_pin_released(outcome, seed)
            return
        self.assertFalse(expect_pin, f"{seed}: the release has the mechanism, yet the scene did not pin: "
                                     f"{why_not_pinned(outcome)}")
        # Not pinned: SGLang's own code let it go, or kept it out of the inflight queue; say which and why.
        self.assertFalse(self.bench.queued(outcome.req.rid))
        self.skipTest(f"{self.backend}: {seed} does not pin on this release: {why_not_pinned(outcome)}")

    # Seeds --------------------------------------------------------------------

    def test_seed_decode_abort_frame(self):
        """Decode's ABORT reaches prefill while the room's chunk waits in SGLang's transfer queue."""
        if not pins.handles_decode_abort(self.manager):
            self.skipTest(f"{self.backend}: no decode ABORT frame on this release: prefill's "
                          f"{type(self.manager).__name__} ({_file(type(self.manager))}) and its SGLang bases never "
                          "compare a received frame with \"ABORT\", so decode's abort cannot touch a prefill room")

        def why(out):
            f = out.facts
            return (f"SGLang's ABORT handler left the room {f.get('status_after_abort')} with its transfer info "
                    f"{'kept' if f.get('transfer_info_after_abort') else 'dropped'}, and its pass released the "
                    f"request as {out.finish_name} {out.seconds} s after the worker was free (the handler marks "
                    "Failed a room it knows that has not succeeded, and drops no transfer info)")

        self.conclude(pins.decode_abort(self.bench, _rooms), "decode ABORT", why)

    def skip_without_abort(self, queue_attr, when):
        """Skips, naming the code, where no client abort reaches a sender of that queue on this release."""
        Sender = self.sender_class()
        if not hasattr(Sender, "abort"):
            self.skipTest(f"{self.backend}: {Sender.__name__} ({_file(Sender)}) and its bases have no abort(): "
                          f"nothing sets Failed on a room {when} from outside the transfer path")
        if check.abort_reaches(runtime.loader.loaded.source, queue_attr) is False:
            self.skipTest(f"{self.backend}: Scheduler.abort_request (managers/scheduler.py) never calls abort() on "
                          f"the senders of {queue_attr}: a client abort does not reach a room {when}")

    def test_seed_failed_resurrected_by_max(self):
        """A client abort sets Failed while the room's chunk is still to be posted; the worker writes after it."""
        self.skip_without_abort("disagg_prefill_inflight_queue", "in the inflight queue")
        survives = pins.failed_survives_later_write(self.rt, self.manager, next(_rooms))

        def why(out):
            f, where = out.facts, _where(self.manager.update_status)
            if survives is True:
                status = f"{where} keeps Failed against a later write (tried on a scratch room)"
            elif survives is None:
                status = f"{where} never lets Failed replace a status (max only)"
            else:
                status = f"{where} does resurrect Failed through max() (tried on a scratch room)"
            if f.get("status_after_abort") == "Failed":
                did = "the sender's abort() wrote Failed to the manager"
            else:
                did = (f"the sender's abort() writes no Failed to the manager (its status stayed "
                       f"{f.get('status_after_abort')}), only conclude_state={f.get('conclude_state')} on the sender")
            if out.finish_name == "FINISH_ABORT":
                latch = ""
                if f.get("conclude_state") == "Failed" and "conclude_state" in _source(self.sender_class().poll):
                    latch = " (the conclude_state latch abort() set, which poll() returns before the manager's status)"
                end = (f"{self.sender_class().__name__}.poll() read Failed{latch} and SGLang released the request as "
                       f"FINISH_ABORT {out.seconds} s after the worker was free")
            else:
                end = (f"{self.sender_class().__name__}.poll() reads the transfer, not the abort: SGLang released the "
                       f"request as {out.finish_name} when the transfer completed (the client's abort was lost, "
                       "not pinned)")
            return f"{status}; {did}; {end}"

        self.conclude(pins.resurrection(self.bench, _rooms), "Failed resurrected by max()", why)

    def test_seed_conclusion_overwritten_after_put(self):
        """The worker concludes the last chunk before add_transfer_request's own status write lands after it."""
        if not pins.status_write_after_put(self.manager):
            where = _where(type(self.manager).add_transfer_request)
            if not pins.hands_to_worker(self.manager):
                self.skipTest(f"{self.backend}: {where} posts the transfers itself (no worker queue) and "
                              f"{self.sender_class().__name__}.poll() reads them once the last chunk is handed over: "
                              "no later status write can undo their conclusion")
            self.skipTest(f"{self.backend}: {where} writes no status after it hands the chunk to the worker "
                          "(put()), so the worker's Success/Failed is the room's last write")

        def why(out):
            return (f"the worker wrote {out.facts.get('worker_wrote')}, the status after the send was "
                    f"{out.facts.get('status_after_send')}, and SGLang released the request as {out.finish_name}")

        self.conclude(pins.conclusion_overwritten(self.bench, _rooms), "conclusion overwritten after put()", why,
                      expect_pin=True)

    def test_seed_abort_before_register(self):
        """A client abort reaches the prefill sender while it waits for decode, which registers afterwards."""
        self.skip_without_abort("disagg_prefill_bootstrap_queue", "waiting for decode's registration")

        def why(out):
            f = out.facts
            text = (f"abort() left the status {f.get('status_after_abort')}, decode's registration then "
                    f"{f.get('status_after_register')}, and {self.sender_class().__name__}.poll() read "
                    f"{f.get('poll_after_register')}")
            if out.finish is None:
                return text + ("; SGLang's bootstrap queue (pop_bootstrapped, disaggregation/prefill.py) concludes "
                               "that poll itself, so the request never reaches the inflight queue")
            text += f"; in the inflight queue SGLang released it as {out.finish_name} in {out.seconds} s"
            if out.finish_name == "FINISH_LENGTH":
                text += " (the registration undid the abort and the transfer completed: the abort was lost, not pinned)"
            return text

        self.conclude(pins.abort_before_register(self.bench, _rooms), "abort before register", why)


    def test_seed_decode_abort_before_prefill_sender(self):
        """Decode registers, then aborts (ABORT frame), before prefill made the room's sender: the sender's own
        first status write comes after the Failed. Not an inflight pin: where it resurrects the room, the request
        waits in the bootstrap queue for SGLang's own bootstrap timeout, which this test then lets end it."""
        if not pins.handles_decode_abort(self.manager):
            self.skipTest(f"{self.backend}: no decode ABORT frame on this release: prefill's "
                          f"{type(self.manager).__name__} ({_file(type(self.manager))}) never compares a frame with "
                          "\"ABORT\"; decode's registration stands and the request is served")
        facts, sender = pins.abort_frame_before_sender(self.bench, _rooms)
        print(f"\nconformance: pins: {self.backend} decode ABORT before the prefill sender: {facts}", flush=True)
        self.assertEqual(facts["status_after_abort"], "Failed", f"SGLang's ABORT handler did not mark the room: {facts}")
        if facts["poll"] == "Failed":
            self.skipTest(f"{self.backend}: no stall on this release: the sender's first status write "
                          f"({type(sender).__mro__[1].__name__}.__init__) leaves the Failed decode's ABORT set "
                          f"({_where(self.manager.update_status)} keeps it), so the bootstrap queue releases the "
                          "request at once")
        # The resurrection, by SGLang's own code: the sender's constructor wrote Bootstrapping over Failed.
        self.assertEqual((facts["status_after_sender"], facts["poll"]), ("Bootstrapping", "Bootstrapping"), facts)
        # Decode will not register again: only SGLang's bootstrap timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT,
        # 300 s by default, read by the sender's poll from its manager) ends the wait. Shortened here as that
        # variable would, to see that it does, and how.
        self.assertTrue(hasattr(self.manager, "bootstrap_timeout"), "no bootstrap timeout: the wait has no end")
        pins.ensure_warning_once()
        self.manager.bootstrap_timeout = 1
        _until(lambda: self.rt.poll_names[int(sender.poll())] == "Failed", 15, "SGLang's bootstrap timeout")
        reason = self.manager.failure_records.get(sender.bootstrap_room, "")
        self.assertIn("Bootstrapping", reason, "ended, but not by SGLang's bootstrap timeout")

class Nixl(_Pins, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Pins, unittest.TestCase):
    backend = "mooncake"


if __name__ == "__main__":
    unittest.main()
