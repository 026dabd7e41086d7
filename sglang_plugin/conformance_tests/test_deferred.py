"""Deferred decode KV release, on and off, NIXL and Mooncake: SGLang's own abort and the plugin's release side by side.

With ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` on (read by
SGLang's ``envs`` when the KV managers and the DecodeTransferQueue are
built: ``disaggregation/common/conn.py``, ``disaggregation/decode.py``),
a transfer-queue request whose receiver sent prefill an ABORT is not freed
when its Failed poll takes it out of the queue: ``pop_transferred`` puts it
in ``_deferred_releases`` (its KV pages not handed to the tree cache, its
metadata slot taken, its receiver kept) and ``resolve_deferred_releases``
frees it once every notified prefill rank sent ``ABORT_ACK`` for the room
(``is_abort_release_safe``, counted only for a room armed by
``register_deferred_abort_room``), or once the timeout
(``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``) passed.
Prefill acks when no chunk of the room is in flight (``_maybe_ack_drained_abort``).
``Scheduler.abort_request`` arms the room after ``receiver.abort()``, when the
manager's flag is on and the receiver notified prefill. Off, the Failed poll
frees everything at once.

Each scene runs on a bench whose managers and transfer queue were built
with the setting on or off (the test's name ends in ``_on`` or ``_off``),
and releases a request either by SGLang's own statements (the transfer-queue
loop of ``Scheduler.abort_request``, read from ``managers/scheduler.py`` and
run on the scheduler thread between passes) or by the plugin's release
(``/admin/force_fail`` with prefill_stopped). The prefill side is SGLang's
real prefill manager; prefill's acks are held at decode's door
(``AckGate``) so that the test sees the pages held while an ack is on its way.
"""

import ast
import inspect
import logging
import os
import threading
import time
import types
import unittest

from sglang_watchdog_plugin import decode
from sglang_watchdog_plugin.conformance import aftermath, decode_bench, runtime, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_decode

SETTING = decode.DEFERRED_SETTING
TIMEOUT_SETTING = SETTING + "_TIMEOUT"
# The ack scenes: a hold that ends by the timeout (SGLang's default 30 s) instead of the ack would fail them.
# The timeout scene: short, so that SGLang's fallback runs within the test.
TIMEOUT_SCENE_SECONDS = 1.5

_RT = None
_rooms = iter(range(200000, 240000))


def setUpModule():
    global _RT
    if test_decode._RT is None:
        test_decode.setUpModule()
    _RT = test_decode._RT


def absent_reason(backend):
    """Why this release has no deferred decode KV release, read from its code; "" where it has one."""
    Manager = runtime._class_named(_RT.conns[backend], f"{backend}kvmanager")
    Transfer = _RT.decode.DecodeTransferQueue
    has_register = hasattr(Manager, "register_deferred_abort_room")
    has_hold = hasattr(Transfer, "resolve_deferred_releases")
    reads_setting = SETTING in inspect.getsource(Transfer.__init__)
    if not (has_register or has_hold or reads_setting):
        return (f"no deferred decode KV release in this release: {Manager.__name__} has no "
                "register_deferred_abort_room (disaggregation/common/conn.py), DecodeTransferQueue no "
                f"resolve_deferred_releases and its constructor does not read {SETTING} (disaggregation/decode.py)")
    if not (has_register and has_hold and reads_setting):
        raise AssertionError(f"part of deferred decode KV release only: register_deferred_abort_room {has_register}, "
                             f"resolve_deferred_releases {has_hold}, {SETTING} read by the transfer queue "
                             f"{reads_setting}: these scenes do not know this shape")
    return ""


def prefill_never_acks(backend):
    """Why this backend's prefill never sends a drain ABORT_ACK, read from its code; "" where it does."""
    source = inspect.getsource(_RT.conns[backend])
    if "register_deferred_ack_target" in source or "_maybe_ack_drained_abort" in source:
        return ""
    return (f"{backend}'s prefill never acks a drained abort (no register_deferred_ack_target in "
            f"disaggregation/{backend}/conn.py): SGLang frees on the timeout only "
            "(test_timeout_frees_the_pages_with_the_chunk_still_in_flight_on)")


def sglang_abort_transfer_queue(scheduler, rid):
    """Runs the transfer-queue loop of SGLang's own Scheduler.abort_request (managers/scheduler.py) for ``rid``.

    The loop's statements are SGLang's, read from the release's file; only the scheduler (the bench's, built
    of SGLang's decode mixin and queues) and the AbortReq are the test's. To be called on the scheduler thread.
    """
    path = os.path.join(os.path.dirname(os.path.dirname(inspect.getsourcefile(_RT.decode))), "managers",
                        "scheduler.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    method = next((node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == "Scheduler"
                   for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "abort_request"), None)
    loop = None if method is None else next(
        (node for node in ast.walk(method) if isinstance(node, ast.For) and
         ast.unparse(node.iter) == "self.disagg_decode_transfer_queue.queue"), None)
    if loop is None:
        raise AssertionError(f"no loop over the decode transfer queue in Scheduler.abort_request ({path})")
    code = compile(ast.fix_missing_locations(ast.Module(body=[loop], type_ignores=[])), f"<{path}: abort_request>",
                   "exec")
    exec(code, {"self": scheduler, "recv_req": types.SimpleNamespace(rid=rid, abort_all=False),
                "logger": logging.getLogger("sglang.abort_request")})


class AckGate:
    """Prefill's drain acks, held at decode's door: SGLang's receiving thread (Mooncake's decode thread, NIXL's
    decode listener) waits in the manager's note_abort_ack until the gate opens, as a slow network would hold
    the frame. Records each ack that arrived and each that SGLang then counted."""

    def __init__(self, manager):
        self.arrived, self.noted = [], []
        self.opened = threading.Event()
        real = manager.note_abort_ack

        def note_abort_ack(room, prefill_rank):
            self.arrived.append((int(room), int(prefill_rank)))
            self.opened.wait(30)
            real(room, prefill_rank)
            self.noted.append(int(room))

        manager.note_abort_ack = note_abort_ack

    def rooms_arrived(self):
        return [room for room, _ in self.arrived]


class _Backend(aftermath.Checked):
    backend = None

    def setUp(self):
        name = self._testMethodName
        self.on = name.endswith("_on")
        if not self.on and not name.endswith("_off"):
            raise AssertionError(f"{name}: a scene's name ends in _on or _off (the setting it runs with)")
        reason = absent_reason(self.backend)
        if reason:
            self.skipTest(reason)
        env = {SETTING: "true" if self.on else "false"}
        if name.startswith("test_timeout"):
            env[TIMEOUT_SETTING] = str(TIMEOUT_SCENE_SECONDS)
        saved = {key: os.environ.get(key) for key in env}
        self.addCleanup(_restore, saved)
        os.environ.update(env)  # before the managers and the transfer queue are built: SGLang reads it then
        self.bench = decode_bench.DecodeBench(_RT, self.backend)
        self.bench.start()
        self.addCleanup(self.bench.stop)
        self.gate = AckGate(self.bench.decode_mgr)
        self.watch_aftermath(self.bench)
        self.server = self.bench.listing()["server"]
        self.transfer_queue = self.bench.scheduler.disagg_decode_transfer_queue

    def tearDown(self):
        self.gate.opened.set()
        self.check_aftermath()
        self.assertEqual(self.bench.errors, [], "SGLang's decode pass raised: a real scheduler would have died")

    # What SGLang holds ------------------------------------------------------

    def held(self, req, slot):
        """Which of the request's resources SGLang still holds: its KV pages (not handed to the tree cache), its
        metadata slot (not back in the allocator), its entry in the transfer queue's deferred releases."""
        scheduler = self.bench.scheduler
        return {"pages": req.rid not in scheduler.tree_cache.released,
                "metadata_slot": slot not in list(scheduler.req_to_metadata_buffer_idx_allocator.free_slots),
                "deferred": any(entry[0].req.rid == req.rid for entry in list(self.transfer_queue._deferred_releases))}

    def armed(self, room):
        """Whether the decode manager counts prefill's acks for the room (register_deferred_abort_room)."""
        return room in self.bench.decode_mgr._deferred_abort_ack_tracker

    # The two releases ------------------------------------------------------

    def release(self, req, by):
        """Releases the request as SGLang's abort_request does (``by="sglang"``) or by the plugin's order."""
        if by == "sglang":
            self.bench.hold()
            try:  # on the scheduler thread's turn, as abort_request runs between passes
                sglang_abort_transfer_queue(self.bench.scheduler, req.rid)
            finally:
                self.bench.running.set()
            return
        status, body = self.bench.force_fail(req, prefill_stopped=True)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self.assertEqual(body["levers"], ["abort", "deferred_abort"] if self.on else ["abort"],
                         "the plugin's levers differ from what SGLang's abort_request does with this setting")

    def admitted(self, behaviour=transports.COMPLETE, chunks=1):
        req = self.bench.admit(next(_rooms), behaviour, chunks=chunks)
        _until(lambda: self.bench.queue_of(req.rid) == "transfer", 10, "the request to join the transfer queue")
        return req, req.decode_request.metadata_buffer_index

    def left_queue(self, req):
        _until(lambda: not self.bench.queued(req.rid), 10, "SGLang's pass to take the request out of the queue")
        self.assertEqual(type(req.finished_reason).__name__, "FINISH_ABORT")
        self.assertTrue([r for r in self.bench.scheduler.streamed if r.rid == req.rid],
                        "its abort was not streamed to the client")

    # Scenes ------------------------------------------------------------------

    def _holds_until_the_ack(self, by):
        reason = prefill_never_acks(self.backend)
        if reason:
            self.skipTest(reason)
        self.assertIs(self.server["deferred_release"], True, "the listing's deferred_release differs from the setting")
        # Prefill has sent no chunk (its forward pass still runs): it acks at once.
        req, slot = self.admitted(chunks=0)
        room = req.bootstrap_room
        self.release(req, by)
        self.assertTrue(self.armed(room), "the room is not armed for prefill's acks (register_deferred_abort_room)")
        self.left_queue(req)
        _until(lambda: room in self.gate.rooms_arrived(), 10, "prefill's ABORT_ACK for the room")
        time.sleep(0.3)  # many passes: only the ack may free it
        self.assertEqual(self.held(req, slot), {"pages": True, "metadata_slot": True, "deferred": True},
                         "freed before prefill's ABORT_ACK was counted")
        self.assertIsNotNone(req.decode_request.kv_receiver, "its receiver was cleared while held")
        self.gate.opened.set()
        _until(lambda: not any(self.held(req, slot).values()), 10, "SGLang to free the pages once the ack counted")
        self.assertIn(room, self.gate.noted)
        self.assertFalse(self.armed(room), "the room's ack accounting outlived its release")
        self.assertIsNone(req.decode_request.kv_receiver)

    def _frees_at_once(self, by):
        self.assertIs(self.server["deferred_release"], False, "the listing's deferred_release differs from the setting")
        req, slot = self.admitted(chunks=0)
        self.release(req, by)
        self.assertFalse(self.armed(req.bootstrap_room), "a room armed for acks with the setting off")
        self.left_queue(req)
        # The same pass that took it out of the queue freed it.
        self.assertEqual(self.held(req, slot), {"pages": False, "metadata_slot": False, "deferred": False})
        time.sleep(0.3)
        self.assertEqual(self.gate.arrived, [], "a drain ack was counted with the setting off")

    def test_sglang_abort_holds_the_pages_until_the_ack_on(self):
        self._holds_until_the_ack("sglang")

    def test_plugin_release_holds_the_pages_until_the_ack_on(self):
        self._holds_until_the_ack("plugin")

    def test_sglang_abort_frees_the_pages_at_once_off(self):
        self._frees_at_once("sglang")

    def test_plugin_release_frees_the_pages_at_once_off(self):
        self._frees_at_once("plugin")

    def test_chunk_in_flight_holds_the_pages_until_it_lands_on(self):
        """Both releases, each on a request whose prefill chunk is still on the wire: no page is freed while the
        fabric has a transfer of the room in flight; prefill acks once it landed, then SGLang frees."""
        reason = prefill_never_acks(self.backend)
        if reason:
            self.skipTest(reason)
        self.gate.opened.set()
        for by in ("sglang", "plugin"):
            req, slot = self.admitted(transports.slow(1.5))
            room = req.bootstrap_room
            _until(lambda: transports.fabric.in_flight(room), 10, "prefill's chunk to be on the wire")
            self.release(req, by)
            self.assertTrue(self.armed(room), f"{by}: the room is not armed for prefill's acks")
            held_in_flight = False
            deadline = time.monotonic() + 15
            while True:
                freed = not self.held(req, slot)["pages"]  # read before the fabric: a later landing is no excuse
                in_flight = transports.fabric.in_flight(room)
                if freed:
                    break
                held_in_flight = held_in_flight or bool(in_flight)
                self.assertLess(time.monotonic(), deadline, f"{by}: the pages are still held")
                time.sleep(0.01)
            self.assertEqual(in_flight, [], f"{by}: pages freed while prefill's chunk was still in flight")
            self.assertTrue(held_in_flight, f"{by}: no moment seen with the chunk in flight and the pages held")
            self.assertIn(room, self.gate.noted, f"{by}: freed without prefill's ABORT_ACK")
            # The pages go first within SGLang's release (the tree cache), the metadata slot and the deferred
            # entry right after, on the scheduler thread that this one may read between the two.
            _until(lambda: not any(self.held(req, slot).values()), 5,
                   f"{by}: the metadata slot and the deferred entry to go with the pages")

    def test_timeout_frees_the_pages_with_the_chunk_still_in_flight_on(self):
        """SGLang's fallback: no ack (prefill's chunk hangs), so after the timeout it frees anyway, the chunk
        still in flight. The plugin's release is held to the same timeout; and since the hold ends under a live
        write, deferred release does not make releasing a started transfer safe: the plugin still wants
        prefill_stopped."""
        self.assertEqual(self.transfer_queue.deferred_kv_release_timeout, TIMEOUT_SCENE_SECONDS)
        self.gate.opened.set()
        req, slot = self.admitted(transports.HANG)
        status, body = self.bench.force_fail(req)
        self.assertEqual((status, body["result"]), (409, "transfer_live"), body)
        self.release(req, "plugin")
        released_at = time.monotonic()
        self.left_queue(req)
        _until(lambda: not self.held(req, slot)["pages"], 10, "SGLang's timeout to free the pages")
        held_for = time.monotonic() - released_at
        self.assertGreaterEqual(held_for, TIMEOUT_SCENE_SECONDS * 0.9, "freed before the timeout, without an ack")
        self.assertTrue(transports.fabric.in_flight(req.bootstrap_room), "the hung chunk ended: not the timeout scene")
        self.assertNotIn(req.bootstrap_room, self.gate.noted)
        self.assertFalse(any(self.held(req, slot).values()))


def _restore(saved):
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class Nixl(_Backend, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Backend, unittest.TestCase):
    backend = "mooncake"


if __name__ == "__main__":
    unittest.main()
