"""The silent pin's seed mechanisms, tried on the loaded SGLang release with its own code.

A silent pin is a prefill request that sits in ``disagg_prefill_inflight_queue``
with a non-terminal poll for ever. Besides a transfer handle that never
completes (tested in test_prefill.py), three seeds were named from reading
SGLang:

* ``decode_abort``: decode's ABORT frame reaches the prefill manager, which
  drops the room's transfer info but cannot mark it Failed, so its worker skips
  the room's chunks and nobody concludes it;
* ``resurrection``: a max()-based ``update_status`` turns a Failed (0) set by
  one path back into WaitingForInput/Transferring when another path writes
  after it;
* ``abort_before_register``: a client abort reaches the prefill sender before
  decode registered the room, and the registration undoes it.

Each scene here plays the real event with SGLang's own objects (decode's own
receiver ``abort()``, the sender's ``abort()`` as ``Scheduler.abort_request``
calls it, decode's own registration, SGLang's own transfer workers and
inflight pass); only the transport below them is the fake fabric. A scene
returns what SGLang's own code did: the request pinned, or concluded by SGLang
itself (and how), so that a test can assert the pin and its release, or skip
naming the code that prevents it. Nothing is decided from a version number.
"""

import ast
import inspect
import logging
import os
import textwrap
import time

from . import scheduler as sch
from . import transports
from .scheduler import _until

# A healthy transfer here takes milliseconds; a request still queued this long after the scene's last event,
# with nothing of its own in flight on the fabric, is pinned (SGLang's own timeouts are 300 s). Generous, for
# hosts that run three releases side by side on two cores: only a pinned request waits it out.
SETTLE_SECONDS = 5.0
# How long SGLang's own threads get to act on an event (a frame on the bootstrap socket) before it is read.
ACT_SECONDS = 10.0


class Outcome:
    """What SGLang's own code did with the scene's request."""

    def __init__(self, req, pinned, finish=None, seconds=None, facts=None, logs=()):
        self.req, self.pinned, self.finish, self.seconds = req, pinned, finish, seconds
        self.facts = dict(facts or {})
        self.logs = list(logs)  # SGLang's own log lines (WARNING and up) that name the room

    @property
    def finish_name(self):
        return type(self.finish).__name__ if self.finish is not None else None

    def __repr__(self):
        return f"Outcome(pinned={self.pinned}, finish={self.finish_name}, seconds={self.seconds}, facts={self.facts})"


class _RoomLog(logging.Handler):
    """SGLang's log records (WARNING and up) that name a room: a pin is silent when there are none."""

    def __init__(self, room):
        super().__init__(logging.WARNING)
        self.room, self.lines = str(room), []

    def emit(self, record):
        try:
            text = record.getMessage()
        except Exception:
            return
        if self.room in text and record.name.startswith("sglang"):
            self.lines.append(f"{record.name}: {text}")


# Structure ----------------------------------------------------------------

def _sglang_classes(obj):
    return [c for c in type(obj).__mro__ if c.__module__.startswith("sglang.")]


def handles_decode_abort(manager):
    """Whether the prefill manager reads decode's ABORT frame: a comparison with "ABORT" in its code.

    Looked for in the manager's class and its SGLang bases, so that a handler
    moved to a base class (common/conn.py) is found too.
    """
    for cls in _sglang_classes(manager):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if isinstance(side, ast.Constant) and side.value in ("ABORT", b"ABORT"):
                        return True
    return False


def failed_survives_later_write(rt, manager, scratch_room):
    """Behaviour of the manager's own ``update_status``: after Failed, does a later WaitingForInput keep it Failed?

    Played on a scratch room no request uses, and removed afterwards. True:
    Failed is kept (sticky or overriding); False: the later write resurrects it
    (``max(Failed=0, status)``).
    """
    Poll = rt.KVPoll
    status = manager.request_status
    try:
        manager.update_status(scratch_room, Poll.WaitingForInput)
        manager.update_status(scratch_room, Poll.Failed)
        if status.get(scratch_room) != Poll.Failed:
            return None  # Failed never lands (an old max-only update_status): nothing to resurrect
        manager.update_status(scratch_room, Poll.Transferring)
        return status.get(scratch_room) == Poll.Failed
    finally:
        status.pop(scratch_room, None)


# Scenes --------------------------------------------------------------------

def _same_queue_room(bench, blocker_room, rooms):
    """A room whose chunks go to the blocker's transfer queue (every room does where the queue follows decode's
    endpoints, which all rooms here share)."""
    key = bench._queue_key
    room = next(rooms)
    if key.rule == "room" and key.count:
        while room % key.count != blocker_room % key.count:
            room = next(rooms)
    return room


def _blocker(bench, rooms):
    """A request whose transfer hangs on the victim's transfer queue, where the manager has worker queues:
    the victim's chunk then waits in SGLang's queue behind it, untaken, as on a busy server."""
    if not bench._queue_key.count:
        return None
    return bench.admit(next(rooms), transports.HANG, rid=f"blocker-{os.getpid()}-{time.monotonic_ns()}")


def _unblock(bench, blocker):
    if blocker is not None:
        # COMPLETE, not FAIL: a failed Mooncake transfer marks the decode session dead and fails every later room.
        transports.fabric.end_hangs([blocker.bootstrap_room], behaviour=transports.COMPLETE)


def _watch(bench, req, since, log, facts, settle=SETTLE_SECONDS):
    """Waits for SGLang's pass to let the request go; pinned if it is still queued, non-terminal and with nothing
    of its own in flight after ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline:
        finish = bench.released(req.rid)
        if finish is not None:
            return Outcome(req, False, finish, round(time.monotonic() - since, 2), facts, log.lines)
        time.sleep(0.02)
    if transports.fabric.in_flight(req.bootstrap_room):
        # Still moving bytes: not a pin (yet). The scene is wrong if this happens.
        raise AssertionError(f"room {req.bootstrap_room} still has a transfer in flight after {settle:g} s")
    pinned = bench.queued(req.rid)
    return Outcome(req, pinned, bench.released(req.rid), round(time.monotonic() - since, 2), facts, log.lines)


def _logging(room):
    log = _RoomLog(room)
    logging.getLogger().addHandler(log)
    return log


def decode_abort(bench, rooms):
    """Decode aborts a request whose prefill chunk is still queued: decode's own receiver ``abort()`` sends its
    ABORT frame to the prefill manager's bootstrap socket; then the worker reaches the room's chunk."""
    manager = bench.prefill_mgr
    blocker = _blocker(bench, rooms)
    room = _same_queue_room(bench, blocker.bootstrap_room if blocker else 0, rooms)
    log = _logging(room)
    try:
        req = bench.admit(room, transports.COMPLETE if blocker else transports.slow(1.0))
        link = bench.links[req.rid]
        facts = {"had_transfer_info": room in manager.transfer_infos}
        # The scheduler holds between two passes while the frame is handled, so that what the ABORT did to the
        # manager is read before SGLang's pass acts on it (and clears the room).
        bench.hold()
        try:
            before = manager.request_status.get(room)
            link.receiver.abort()
            facts["abort_notified"] = bool(getattr(link.receiver, "abort_notified", False))
            # The prefill manager handles the frame on its bootstrap thread: wait (bounded) for it to act. Where it
            # ignores the frame, this waits the whole bound and the facts say nothing changed.
            deadline = time.monotonic() + ACT_SECONDS
            while time.monotonic() < deadline and manager.request_status.get(room) == before and \
                    room in manager.transfer_infos:
                time.sleep(0.01)
            facts["status_after_abort"] = _name(bench, manager.request_status.get(room))
            facts["transfer_info_after_abort"] = room in manager.transfer_infos
        finally:
            bench.running.set()
        since = time.monotonic()
        _unblock(bench, blocker)
        return _watch(bench, req, since, log, facts)
    finally:
        logging.getLogger().removeHandler(log)


def resurrection(bench, rooms):
    """A client abort (``Scheduler.abort_request`` calls the sender's ``abort()``, which sets Failed) on a request
    whose chunk is still queued or in flight; then SGLang's worker writes the room's status again."""
    manager = bench.prefill_mgr
    blocker = _blocker(bench, rooms)
    room = _same_queue_room(bench, blocker.bootstrap_room if blocker else 0, rooms)
    log = _logging(room)
    try:
        req = bench.admit(room, transports.COMPLETE if blocker else transports.slow(1.0))
        # Scheduler.abort_request runs on the scheduler thread between two passes and calls the sender's abort();
        # the same here, with the loop held, so that its effect is read before the next pass acts on it.
        bench.hold()
        try:
            req.disagg_kv_sender.abort()
            facts = {"status_after_abort": _name(bench, manager.request_status.get(room)),
                     "conclude_state": _name(bench, getattr(req.disagg_kv_sender, "conclude_state", None))}
        finally:
            bench.running.set()
        since = time.monotonic()
        _unblock(bench, blocker)
        outcome = _watch(bench, req, since, log, facts)
        outcome.facts["status_at_end"] = _name(bench, manager.request_status.get(room))
        return outcome
    finally:
        logging.getLogger().removeHandler(log)


def abort_before_register(bench, rooms):
    """A client abort while the request waits in the bootstrap queue, before decode registered the room: the
    sender's ``abort()``, then decode's own registration, then (if SGLang's poll lets it through, as
    ``pop_bootstrapped`` would) prefill's forward pass hands the KV over and the request enters the inflight
    queue."""
    manager = bench.prefill_mgr
    room = next(rooms)
    log = _logging(room)
    try:
        transports.fabric.plan(room, transports.COMPLETE)
        slot = bench.scheduler.req_to_metadata_buffer_idx_allocator.alloc()
        link = sch.Link(bench.rt, bench.backend, room, bench.prefill_mgr, bench.decode_mgr, slot=slot)
        link.sender.abort()
        after_abort = manager.request_status.get(room)
        facts = {"status_after_abort": _name(bench, after_abort)}
        link.bootstrap()
        # Decode's registration lands on prefill's bootstrap thread; wait until the manager holds it.
        _until(lambda: room in manager.transfer_infos, ACT_SECONDS, f"decode's registration of room {room} on prefill")
        # The bootstrap thread fills the room's transfer info, then writes its status: let it (bounded; where the
        # status does not change, a sticky Failed, this waits the whole bound).
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and manager.request_status.get(room) == after_abort:
            time.sleep(0.01)
        facts["status_after_register"] = _name(bench, manager.request_status.get(room))
        poll = link.sender.poll()
        facts["poll_after_register"] = _name(bench, poll)
        req = sch.make_req(bench.rt, room, rid=f"abort-before-register-{room}", sender=link.sender)
        req.metadata_buffer_index = slot
        if int(poll) in (int(bench.rt.KVPoll.Failed), int(bench.rt.KVPoll.Bootstrapping)):
            # SGLang's bootstrap queue (pop_bootstrapped) reads this poll: Failed is released there, Bootstrapping
            # waits for its own bootstrap timeout; neither reaches the inflight queue.
            return Outcome(req, False, None, 0.0, facts, log.lines)
        link.send(1)
        bench.links[req.rid] = link
        since = time.monotonic()
        with bench._lock:
            bench._pending.append(req)
        return _watch(bench, req, since, log, facts)
    finally:
        logging.getLogger().removeHandler(log)


def _put_lines(manager):
    fn = getattr(type(manager), "add_transfer_request", None)
    if fn is None:
        return None, []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None, []
    return tree, [n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "put"]


def hands_to_worker(manager):
    """Whether ``add_transfer_request`` hands chunks to a transfer worker through a queue (a ``put()``), rather
    than posting the transfers itself on the scheduler thread (the earliest NIXL)."""
    return bool(_put_lines(manager)[1])


def status_write_after_put(manager):
    """Whether the manager's ``add_transfer_request`` writes the room's status after handing the chunk to its
    worker (a ``put()`` on the transfer queue): an assignment to ``request_status[...]`` or an ``update_status``
    call placed after the put. Then the worker can conclude the room (Success or Failed) before that write,
    which undoes the conclusion."""
    tree, puts = _put_lines(manager)
    if not puts:
        return False
    writes = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for target in n.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) and \
                        target.value.attr == "request_status":
                    writes.append(n.lineno)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update_status":
            writes.append(n.lineno)
    return any(line > min(puts) for line in writes)


def conclusion_overwritten(bench, rooms):
    """The worker concludes the room's last chunk before ``add_transfer_request`` writes its status after the
    put: the scheduler thread is held right after its ``put()`` until SGLang's worker wrote the room's terminal
    status, the interleaving a loaded host gives when the scheduler thread is descheduled there for as long as
    the transfer takes. Nothing of SGLang's code is changed: only when the scheduler thread resumes."""
    manager = bench.prefill_mgr
    Poll = bench.rt.KVPoll
    terminal = (Poll.Success, Poll.Failed)
    queues = list(getattr(manager, "transfer_queues", None) or [manager.transfer_queue])
    room = next(rooms)
    facts = {}

    def held_after(real):
        def put(item, *args, **kwargs):
            real(item, *args, **kwargs)
            last = getattr(item, "is_last", getattr(item, "is_last_chunk", False))
            if getattr(item, "room", None) == room and last:
                _until(lambda: manager.request_status.get(room) in terminal, 10,
                       f"SGLang's worker to conclude room {room}")
                facts["worker_wrote"] = _name(bench, manager.request_status.get(room))
        return put

    for q in queues:
        q.put = held_after(q.put)  # an instance attribute: removed below, the queue's own method is back
    log = _logging(room)
    try:
        try:
            req = bench.admit(room, transports.COMPLETE)
        finally:
            for q in queues:
                vars(q).pop("put", None)
        facts["status_after_send"] = _name(bench, manager.request_status.get(room))
        facts["transfer_info_after_send"] = room in manager.transfer_infos
        return _watch(bench, req, time.monotonic(), log, facts)
    finally:
        logging.getLogger().removeHandler(log)


_warned = set()


def _warning_once(self, *args, **kwargs):
    key = (self.name, str(args[0]) if args else "")
    if key not in _warned:
        _warned.add(key)
        self.warning(*args, **kwargs)


def ensure_warning_once():
    """SGLang's code calls ``logger.warning_once``, a method that a serving process has on every logger
    because transformers, which it imports, adds one to ``logging.Logger``; the harness has no transformers, so
    SGLang's timeout paths (its bootstrap timeout) would raise AttributeError here. A stand-in that logs a
    message once per logger."""
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = _warning_once


def abort_frame_before_sender(bench, rooms):
    """Decode registers a room and then aborts it (its ABORT frame reaches prefill) before prefill's scheduler
    made the room's sender: a decode that was quick where prefill had a queue. Then the sender is made, as
    the bootstrap queue does, and its poll read. Returns (facts, sender); the request never got further than
    the bootstrap queue here."""
    rt, manager = bench.rt, bench.prefill_mgr
    conn = rt.conns[bench.backend]
    from .runtime import _class_named

    Sender = _class_named(conn, f"{bench.backend}kvsender")
    Receiver = _class_named(conn, f"{bench.backend}kvreceiver")
    room = next(rooms)
    addr = f"127.0.0.1:{rt.bootstrap_server(bench.backend)[1]}"
    slot = bench.scheduler.req_to_metadata_buffer_idx_allocator.alloc()
    receiver = Receiver(**sch._accepted(Receiver, mgr=bench.decode_mgr, bootstrap_addr=addr, bootstrap_room=room,
                                        prefill_dp_rank=0, data_parallel_rank=0))
    dmgr = receiver.kv_mgr
    if hasattr(dmgr, "try_ensure_parallel_info"):
        _until(lambda: dmgr.try_ensure_parallel_info(receiver.bootstrap_addr), ACT_SECONDS, "prefill parallel info")
    indices = sch.np.arange(slot * 4, (slot + 1) * 4, dtype=sch._index_dtype(receiver))
    if hasattr(receiver, "send_metadata"):
        if "prefill_dp_rank" in inspect.signature(receiver.init).parameters:
            receiver.init(0)
        receiver.send_metadata(indices, slot)
    else:
        receiver.init(indices, slot)
    _until(lambda: manager.request_status.get(room) is not None, ACT_SECONDS, f"decode's registration of {room}")
    facts = {"status_after_register": _name(bench, manager.request_status.get(room))}
    registered = manager.request_status.get(room)
    receiver.abort()
    deadline = time.monotonic() + ACT_SECONDS
    while time.monotonic() < deadline and manager.request_status.get(room) == registered:
        time.sleep(0.01)
    facts["status_after_abort"] = _name(bench, manager.request_status.get(room))
    sender = Sender(**sch._accepted(Sender, mgr=manager, bootstrap_addr=addr, bootstrap_room=room,
                                    dest_tp_ranks=[0], pp_rank=0))
    facts["status_after_sender"] = _name(bench, manager.request_status.get(room))
    facts["poll"] = _name(bench, sender.poll())
    return facts, sender


def _name(bench, status):
    if status is None:
        return None
    try:
        return bench.rt.poll_names.get(int(status), str(status))
    except (TypeError, ValueError):
        return str(status)
