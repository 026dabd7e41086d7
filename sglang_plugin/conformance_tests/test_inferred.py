"""What the plugin infers, played on SGLang's own code (issue 24): the listing, the verdict, the action, the aftermath.

Three scenes, each decided from the release's code, never its version:

* a Mooncake transfer worker that dies: SGLang's engine wrapper
  (``MooncakeTransferEngine``) and the manager's worker loop
  (``MooncakeKVManager.transfer_worker``, or the earliest releases' one
  ``transfer_thread``; ``disaggregation/mooncake/conn.py``) are read for the
  plainest fault they let through, and the fake engine plays exactly that: a
  failed transfer where the wrapper raises on one, else an exception the
  wrapper's and the loop's ``except`` clauses do not keep. The thread dies,
  the listing's ``kv_threads`` shows it dead, the rooms behind it wait on
  its queue with nothing in flight, the plugin's force-fail releases them
  (or says it has no lever), and another queue still serves while the dead
  one never will: only a restart clears it;
* NIXL's poll on a failed transfer: where ``NixlKVSender.poll`` raises
  ("KVSender transfer encountered an error."), SGLang's own inflight pass
  raises, which kills a real scheduler; where it answers Failed, the pass
  releases the request;
* a decode that never answers the bootstrap: the prefill bootstrap queue is
  a stand-in here (scheduler.prefill_scheduler), so the sender is built alone,
  for a room no receiver ever registers, and polled as that queue would. A
  sender whose poll() reads the manager's ``bootstrap_timeout`` (from
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``) fails after it; one that does
  not keeps its first answer for ever (Bootstrapping, or, where poll() reads
  no status before the KV is sent, WaitingForInput at once).
"""

import ast
import inspect
import os
import time
import unittest
from unittest import mock

from sglang_watchdog_plugin import capabilities, kv_threads
from sglang_watchdog_plugin.conformance import aftermath, pins, runtime, transports
from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance import scheduler as sch
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

_rooms = iter(range(600000, 700000))

# The bootstrap timeout the scene sets, in seconds (SGLang's default is 300): whole, as the earliest releases
# read the variable as an int.
BOOTSTRAP_TIMEOUT = 1
# How long a room on a dead worker's queue is watched to stay there: it never leaves, so any time shows it.
WATCH_SECONDS = 0.5


class EngineFault(BaseException):
    """A transfer library fault that is no ``Exception``: what an ``except Exception`` lets through."""


def _clauses(fn):
    """(caught classes, re-raises) of each except clause of ``fn``; None when its source cannot be read."""
    tree = capabilities._function_tree(fn)
    if tree is None:
        return None
    namespace = getattr(fn, "__func__", fn).__globals__
    clauses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler):
            caught = (BaseException,) if node.type is None else _resolve(node.type, namespace)
            clauses.append((caught, any(isinstance(stmt, ast.Raise) for stmt in node.body)))
    return clauses


def _resolve(node, namespace):
    if isinstance(node, ast.Tuple):
        return tuple(cls for element in node.elts for cls in _resolve(element, namespace))
    if isinstance(node, ast.Call):
        node = node.func
    try:
        value = eval(compile(ast.Expression(node), "<except>", "eval"), dict(namespace))
    except Exception:
        return ()
    return tuple(value) if isinstance(value, tuple) else (value,)


def _swallows(clauses, cls):
    """Whether one of these clauses catches ``cls`` and goes on (a clause that raises again passes it on)."""
    return any(issubclass(cls, caught) and not reraises for caught, reraises in clauses)


def _raised_on_failure(fn):
    """The classes ``fn`` raises outside its except clauses: an engine wrapper that raises on a failed transfer."""
    tree = capabilities._function_tree(fn)
    if tree is None:
        return ()
    handled = {id(node) for handler in ast.walk(tree) if isinstance(handler, ast.ExceptHandler)
               for node in ast.walk(handler)}
    namespace = getattr(fn, "__func__", fn).__globals__
    return tuple(cls for node in ast.walk(tree) if isinstance(node, ast.Raise) and node.exc is not None
                 and id(node) not in handled for cls in _resolve(node.exc, namespace) if isinstance(cls, type))


def _fatal_fault(wrappers, worker):
    """(plan, class) of the plainest fault that SGLang's engine wrappers and its worker loop both let through,
    the class being what then ends the thread; None when the worker survives every one."""
    layers = [_clauses(fn) for fn in (*wrappers, worker)]
    if any(clauses is None for clauses in layers):
        return None
    worker_clauses = layers[-1]
    raised = [_raised_on_failure(fn) for fn in wrappers]
    if wrappers and all(raised):  # a failed transfer alone raises out of the wrapper
        cls = raised[0][0]
        if not _swallows(worker_clauses, cls):
            return transports.FAIL, cls
    for cls in (RuntimeError, EngineFault):
        if not any(_swallows(clauses, cls) for clauses in layers):
            return transports.raising(cls("transfer engine fault")), cls
    return None


def _poll_reads(sender_cls, name):
    """Whether the sender's poll(), or a method of its own that poll() calls, reads attribute ``name``."""
    poll = capabilities._function_tree(sender_cls.poll)
    if poll is None:
        return False
    own = [capabilities._function_tree(getattr(sender_cls, node.func.attr, None)) for node in ast.walk(poll)
           if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
           and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"]
    return any(name in capabilities._attributes(tree) for tree in (poll, *own) if tree is not None)


def _raises(fn):
    tree = capabilities._function_tree(fn)
    return tree is not None and any(isinstance(node, ast.Raise) for node in ast.walk(tree))


class _Inferred(aftermath.Checked):
    backend = None

    def setUp(self):
        self.bench = bench_module.Bench(test_prefill._RT, self.backend).start()
        self.addCleanup(self.bench.stop)
        self.watch_aftermath(self.bench)
        self.levers = self.bench.listing()["server"]["levers"]

    def tearDown(self):
        self.check_aftermath()
        self.assertEqual(self.bench.errors, [], "SGLang's pass raised: a real scheduler would have died")

    def room(self):
        return next(_rooms)

    def sender_class(self):
        return runtime._class_named(test_prefill._RT.conns[self.backend], f"{self.backend}kvsender")

    def force_fail_releases(self, req):
        status, body = self.bench.force_fail(req)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_ABORT")

    def test_a_decode_that_never_answers_the_bootstrap(self):
        Sender = self.sender_class()
        mgr = self.bench.prefill_mgr
        applies = _poll_reads(Sender, "bootstrap_timeout")
        if applies:
            # SGLang reads the variable once, into the manager, when the manager is made: the manager's
            # attribute is what poll() compares against.
            self.assertTrue(hasattr(mgr, "bootstrap_timeout"), "poll() reads a timeout its manager lacks")
            default, mgr.bootstrap_timeout = mgr.bootstrap_timeout, BOOTSTRAP_TIMEOUT
        try:
            self.poll_unanswered_sender(Sender, mgr, applies)
        finally:  # before the aftermath's new request, which bootstraps on this manager
            if applies:
                mgr.bootstrap_timeout = default

    def poll_unanswered_sender(self, Sender, mgr, applies):
        pins.ensure_warning_once()  # SGLang's timeout path logs with it
        addr = f"127.0.0.1:{test_prefill._RT.bootstrap_server(self.backend)[1]}"
        Poll = test_prefill._RT.KVPoll
        with mock.patch.dict(os.environ, {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT)}):
            sender = Sender(**sch._accepted(Sender, mgr=mgr, bootstrap_addr=addr, bootstrap_room=self.room(),
                                            dest_tp_ranks=[0], pp_rank=0))
            first = sender.poll()
            if not (_poll_reads(Sender, "check_status") or _poll_reads(Sender, "request_status")):
                # poll() reads no status before the KV is sent: the bootstrap is not seen at all, and the room
                # answers as ready though no decode ever asked for it (a stated limit: nothing times it out).
                self.assertFalse(applies)
                self.assertNotEqual(first, Poll.Bootstrapping)
            else:
                self.assertEqual(first, Poll.Bootstrapping)
            if applies:
                _until(lambda: sender.poll() == Poll.Failed, BOOTSTRAP_TIMEOUT + 5, "the bootstrap timeout")
                return
            # A stated limit: nothing in this release's poll() times the bootstrap out; pinned for ever.
            deadline = time.monotonic() + 3 * BOOTSTRAP_TIMEOUT
            while time.monotonic() < deadline:
                self.assertEqual(sender.poll(), first)
                time.sleep(0.05)


class Mooncake(_Inferred, unittest.TestCase):
    backend = "mooncake"

    def test_a_transfer_worker_that_dies(self):
        mgr = self.bench.prefill_mgr
        threads = [t for t in kv_threads.find(mgr) if t.role == kv_threads.TRANSFER_WORKER]
        self.assertTrue(threads, "no thread of SGLang's Mooncake prefill manager drains a transfer queue")
        several = len(threads) > 1
        # Several workers: one dies, on queue 1 (its destination's session port is chosen so), another serves.
        worker = next(t for t in threads if t.transfer_queue == 1) if several else threads[0]
        engine_cls = type(mgr.engine)
        wrappers = [getattr(engine_cls, name) for name in ("transfer_sync", "batch_transfer_sync")
                    if callable(getattr(engine_cls, name, None))]
        fatal = _fatal_fault(wrappers, worker.thread._target)
        if fatal is None:
            self.skipTest(f"{engine_cls.__name__} and MooncakeKVManager's {worker.function} "
                          "(disaggregation/mooncake/conn.py) catch every exception: the worker cannot die of one")
        plan, fatal_cls = fatal
        link = None
        if several:
            live = next(t for t in threads if t is not worker)
            self.bench.destination("dead", worker.transfer_queue)
            self.bench.destination("live", live.transfer_queue)
            link = "dead"

        first = self.bench.admit(self.room(), plan, link=link)
        _until(lambda: not worker.thread.is_alive(), 10, f"SGLang's {worker.function} to die")
        escaped = [e for name, e in aftermath.escaped_since(self._aftermath.mark) if name == worker.thread.name]
        # What ends it: the fault, or SGLang's RuntimeError around it ("Transfer thread failed because of ...").
        self.assertTrue(escaped and isinstance(escaped[0], (fatal_cls, RuntimeError)), escaped)

        dead_row = worker.json()
        self.assertFalse(dead_row["alive"])
        listing = self.bench.listing()
        self.assertIn(dead_row, listing["kv_threads"])
        if several:
            self.assertIn(live.json(), listing["kv_threads"])
            self.assertTrue(live.json()["alive"])
        # The room whose transfer killed the worker: nothing queued; in flight only by SGLang's own per-room
        # count of outstanding chunks, which the dead worker raised and never lowered.
        counts = getattr(mgr, "_staging_outstanding", None)
        first_row = self.bench.listed(first.rid)
        self.assertEqual(first_row["transfer_in_flight"],
                         counts is not None and counts.get(first.bootstrap_room, 0) > 0, first_row)

        later = self.bench.admit(self.room(), transports.COMPLETE, link=link)
        time.sleep(WATCH_SECONDS)
        row = self.bench.listed(later.rid)
        self.assertTrue(self.bench.queued(later.rid), "a room behind the dead worker left the queue")
        self.assertEqual((row["transfer_queue"], row["transfer_in_flight"]), (worker.transfer_queue, False), row)
        if row["chunks_queued"] is not None:  # None: the plugin sees no worker queues on this release
            self.assertGreaterEqual(row["chunks_queued"], 1, row)
        self.assertEqual(transports.fabric.of_room(later.bootstrap_room), [], "the engine was asked for its KV")

        if self.levers:
            self.force_fail_releases(later)
            self.force_fail_releases(first)
        else:  # the plugin knows no lever that releases this sender: it says so, and nothing moves
            status, body = self.bench.force_fail(later)
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            self.assertTrue(self.bench.queued(later.rid))

        # The aftermath: another queue's worker still serves a new request; the dead one's queue never will.
        if several:
            served = self.bench.admit(self.room(), transports.COMPLETE, link="live")
            self.assertEqual(type(self.bench.wait_released(served.rid, aftermath.SERVE_SECONDS)).__name__,
                             "FINISH_LENGTH")
        stuck = self.bench.admit(self.room(), transports.COMPLETE, link=link)
        time.sleep(WATCH_SECONDS)
        self.assertTrue(self.bench.queued(stuck.rid))
        self.assertEqual(transports.fabric.of_room(stuck.bootstrap_room), [])
        self.sglang_breaks_itself(
            f"SGLang's Mooncake {worker.function} died of {type(escaped[0]).__name__} and nothing in SGLang starts "
            f"it again: {'its' if several else 'the one'} transfer queue is never drained; only a restart clears it")


class Nixl(_Inferred, unittest.TestCase):
    backend = "nixl"

    def test_a_failed_transfer(self):
        Sender = self.sender_class()
        req = self.bench.admit(self.room(), transports.fail_after(0.3))
        if not _raises(Sender.poll):
            self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_ABORT")
            self.assertEqual(self.bench.listed(req.rid), None)
            return
        _until(lambda: self.bench.errors, 10, "SGLang's inflight pass to raise")
        self.bench.hold()
        poll_source = inspect.getsource(Sender.poll)
        for error in self.bench.errors:
            self.assertIn(str(error), poll_source, f"{type(error).__name__}: {error}")
        self.assertTrue(self.bench.queued(req.rid), "the pass raised, yet let the request go")
        self.assertIsNotNone(self.bench.listed(req.rid), "the plugin stopped listing the request")
        self.assertIsNone(self.bench.released(req.rid))
        self.bench.errors.clear()
        self.sglang_breaks_itself("SGLang's NixlKVSender.poll (disaggregation/nixl/conn.py) raises on a failed "
                                  "transfer, out of the scheduler's inflight pass: a real scheduler process dies")


def setUpModule():
    test_prefill.setUpModule()


if __name__ == "__main__":
    unittest.main()
