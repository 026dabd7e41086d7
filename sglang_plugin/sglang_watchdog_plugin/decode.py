"""Decode side: read-only observation of KV receivers, the decode levers, and decode orders.

Where a decode request waits (SGLang v0.5.18, ``disaggregation/decode.py``): a ``DecodeRequest``
(fields ``req``, ``kv_receiver``, ``waiting_for_input``,
``metadata_buffer_index``) sits in ``disagg_decode_prealloc_queue.queue``
until its pages are allocated and its metadata sent to prefill, then in
``disagg_decode_transfer_queue.queue`` until its receiver polls Success or
Failed. ``kv_receiver`` is set to None once SGLang clears it.

Nothing here calls ``poll()``: it feeds SGLang's all-reduce, applies the
waiting timeout and latches terminal states. Per receiver the plugin reads:

* every receiver: a latched ``conclude_state`` first (``abort()`` latches
  Failed, and every receiver's ``poll()`` returns it);
* common receivers (NIXL, Mooncake and the others): ``kv_mgr.check_status(room)``;
  the metadata hand-over (``init_time``, set when metadata is sent);
* NIXL: ``started_transfer`` and the manager's per-room ``transfer_statuses``
  entry (chunks received per prefill PP rank, chunks expected per rank once
  the last chunk arrived, the number of PP ranks expected);
* the fake receiver of health checks and warm-ups (no ``bootstrap_room``,
  no manager on older releases): ``bootstrap_done`` and ``has_sent_metadata``.
"""

import ast
import inspect
import logging
import os
import sys
import time
import types
from typing import NamedTuple

from . import capabilities
from .capabilities import ABORT, Capabilities
from .observe import (
    BOOTSTRAPPING,
    FAILED,
    SUCCESS,
    TRANSFERRING,
    UNKNOWN,
    WAITING_FOR_INPUT,
    as_poll_code,
)
from .orders import (
    DEFAULT_REASON,
    Outcome,
    internal_error,
    not_found,
    record_failure,
    screen,
    transfer_succeeded,
    unsupported,
)

logger = logging.getLogger("sglang_watchdog_plugin")

DEFERRED_ABORT = "deferred_abort"
PREALLOC, TRANSFER = "prealloc", "transfer"
WHERE = "decode-queued"


class ReceiverView(NamedTuple):
    poll: int
    progress: int  # -1: unknown
    chunks_expected: int | None
    transfer_started: bool | None
    waiting_for_memory: bool = False


_UNKNOWN_VIEW = ReceiverView(UNKNOWN, -1, None, None)


def observe_receiver(receiver, room):
    """What the receiver's poll() would build on, read without calling it."""
    if receiver is None:  # cleared by SGLang: the request leaves its queue in this pass
        return _UNKNOWN_VIEW
    concluded = getattr(receiver, "conclude_state", None)
    if hasattr(receiver, "has_sent_metadata"):  # the fake receiver: no transfer at all
        if concluded is not None:
            poll = as_poll_code(concluded)
        elif not getattr(receiver, "bootstrap_done", False):
            poll = BOOTSTRAPPING
        else:
            poll = SUCCESS if receiver.has_sent_metadata else WAITING_FOR_INPUT
        return ReceiverView(poll, -1, None, bool(receiver.has_sent_metadata))
    manager = getattr(receiver, "kv_mgr", None)
    progress, expected, done = _transfer_status(manager, room)
    if concluded is not None:
        poll = as_poll_code(concluded)
    else:
        reads_status = _poll_reads_status(type(receiver))
        # A poll() that never asks the manager (NIXL up to v0.5.3) answers WaitingForInput until done.
        poll = WAITING_FOR_INPUT if reads_status is False else _status(manager, room)
        if done is not None and poll not in (SUCCESS, FAILED):
            poll = done  # all chunks are in: the next poll() latches this
    return ReceiverView(poll, progress, expected, _started(receiver, progress, poll))


_reads_status = {}


def _poll_reads_status(receiver_cls):
    """Whether the receiver's poll() answers from ``kv_mgr.check_status``: True, False or None (unreadable).

    SGLang's NixlKVReceiver.poll up to v0.5.3 (``disaggregation/nixl/conn.py``,
    v0.4.6, v0.4.10, v0.5.3) returns its latched ``conclude_state``, else
    WaitingForInput until every chunk arrived, and never reads the manager's
    per-room status, which holds no entry for such a room: reading it there
    listed the room as Unknown while SGLang's poll() said WaitingForInput.
    """
    known = _reads_status.get(receiver_cls, ())
    if known != ():
        return known
    tree = capabilities._function_tree(getattr(receiver_cls, "poll", None))
    if tree is None:
        answer = None
    else:
        attributes = capabilities._attributes(tree)
        answer = True if "check_status" in attributes else False if "WaitingForInput" in attributes else None
    _reads_status[receiver_cls] = answer
    return answer


def _status(manager, room):
    check_status = getattr(manager, "check_status", None)
    if check_status is None:
        return UNKNOWN
    try:
        return as_poll_code(check_status(room))
    except Exception:  # KeyError once the room is cleared
        return UNKNOWN


def _transfer_status(manager, room):
    """(chunks received, chunks expected or None, terminal poll code or None) from NIXL's per-room status."""
    statuses = getattr(manager, "transfer_statuses", None)
    if statuses is None:
        return -1, None, None
    try:
        # A defaultdict on the manager: get(), never index, or the read would create an entry.
        status = statuses.get(room)
        if status is None:
            return 0, None, None
        received = sum(len(chunks) for chunks in list(status.received_kvs_per_pp.values()))
        expected_per_pp = dict(status.expected_kvs_per_pp)
        ranks = status.num_pp_ranks_expected
        expected = sum(expected_per_pp.values()) if ranks is not None and len(expected_per_pp) >= ranks else None
        done = None
        is_done = getattr(status, "is_done", None)
        if callable(is_done) and is_done():
            is_failed = getattr(status, "is_failed", None)
            done = FAILED if callable(is_failed) and is_failed() else SUCCESS
        return received, expected, done
    except Exception:  # a transfer thread changed it under us: unknown this time
        return -1, None, None


def waiting_for_memory(decode_req, view):
    """Whether a prealloc request waits for free KV pages: its handshake is done and its receiver not failed.

    SGLang sets ``DecodeRequest.waiting_for_input`` on the WaitingForInput poll
    of the handshake (``DecodePreallocQueue._update_handshake_waiters``, or
    ``pop_preallocated`` on older releases; v0.4.6 to v0.5.18), and
    ``pop_preallocated`` gives pages only to such requests, while pages are
    free. Its waiting timeout starts when the metadata is sent, after that:
    such a request waits as long as decode has no memory, and SGLang never
    times it out.
    """
    return getattr(decode_req, "waiting_for_input", None) is True and view.poll != FAILED


def _started(receiver, progress, poll):
    """Whether prefill may be writing into this request's pages: True, False, or None (unknown).

    Metadata sent (NIXL ``started_transfer``, or ``init_time`` of the common
    receivers) means prefill holds the destination pages and may write at any
    time; a chunk received or a Transferring status means it did.
    """
    if progress > 0 or poll == TRANSFERRING:
        return True
    started = getattr(receiver, "started_transfer", None)
    if started is True:
        return True
    has_init_time = hasattr(receiver, "init_time")
    if has_init_time and receiver.init_time is not None:
        return True
    if started is False or has_init_time:
        return False
    return None


# -- capabilities -----------------------------------------------------------


def pass_problem(scheduler):
    """Why the decode queues' Failed branches cannot be trusted, or ""."""
    transfer = type(getattr(scheduler, "disagg_decode_transfer_queue", None))
    problem = capabilities.failed_branch_problem(
        getattr(transfer, "pop_transferred", None), "DecodeTransferQueue.pop_transferred", "decode transfer queue")
    if problem:
        return problem
    prealloc = type(getattr(scheduler, "disagg_decode_prealloc_queue", None))
    # The handshake's Failed branch moved out of pop_preallocated in newer releases.
    for name in ("_update_handshake_waiters", "pop_preallocated"):
        fn = getattr(prealloc, name, None)
        if fn is None:
            continue
        problem = capabilities.failed_branch_problem(fn, f"DecodePreallocQueue.{name}", "decode prealloc queue")
        if not problem or "raises" in problem:
            return problem
    return problem or "the decode prealloc queue has no pass the plugin can read"


def detect(receiver_cls, problem):
    """Capabilities of a receiver class: ["abort"] when abort() latches Failed and poll() returns it."""
    name = receiver_cls.__name__
    if problem:
        return Capabilities((), problem)
    if getattr(receiver_cls, "abort", None) is None:
        return Capabilities((), f"{name} has no abort()")
    latches = _abort_latches(receiver_cls)
    if latches is None:
        return Capabilities((), f"{name}.abort() cannot be read nor safely probed; no lever is known to work")
    if not latches:
        return Capabilities((), f"{name}.abort() does not latch conclude_state = Failed")
    reads = _poll_returns_latch(receiver_cls)
    if not reads:
        return Capabilities((), f"{name}.poll() does not return a latched conclude_state"
                            if reads is False else f"{name}.poll() cannot be read")
    return Capabilities((ABORT,), "")


def _abort_latches(receiver_cls):
    """Whether abort() sets conclude_state = Failed: True, False or None (unknown).

    Read from the source along the MRO (an override may call super().abort());
    without source, probed on a blank instance whose abort has nobody to notify.
    """
    for cls in receiver_cls.__mro__:
        fn = cls.__dict__.get("abort")
        if fn is None:
            continue
        tree = capabilities._function_tree(fn)
        if tree is None:
            return _probe_abort(receiver_cls)
        if _assigns(tree, "conclude_state") and capabilities._mentions(tree, "Failed"):
            return True
        if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "abort"
                   for n in ast.walk(tree)):
            return False
    return False


def _probe_abort(receiver_cls):
    try:
        blank = object.__new__(receiver_cls)
        blank.__dict__.update({
            "conclude_state": None, "bootstrap_room": 7, "abort_notified": True, "bootstrap_infos": None,
            "kv_mgr": types.SimpleNamespace(record_failure=lambda *a: None, update_status=lambda *a: None,
                                            failure_records={}, enable_deferred_decode_kv_release=False),
        })
        receiver_cls.abort(blank)
        return as_poll_code(blank.__dict__.get("conclude_state")) == FAILED
    except Exception:
        return None


def _poll_returns_latch(receiver_cls):
    tree = capabilities._function_tree(getattr(receiver_cls, "poll", None))
    if tree is not None:
        return "conclude_state" in capabilities._attributes(tree)
    try:
        blank = object.__new__(receiver_cls)
        blank.__dict__["conclude_state"] = capabilities._kvpoll("Failed", FAILED)
        return as_poll_code(receiver_cls.poll(blank)) == FAILED
    except Exception:
        return None


def _assigns(tree, attr):
    return any(isinstance(t, ast.Attribute) and t.attr == attr
               for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets)


DEFERRED_SETTING = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


def deferred_release(manager, env=None):
    """Whether SGLang's decode transfer queue will hold a released request's pages until prefill acks that its
    writes drained (deferred decode KV release); None where this SGLang has no such thing.

    No release up to v0.5.18 has it (no ``enable_deferred_decode_kv_release`` on the managers). Where later
    code has it, the manager's flag alone does not decide: the transfer queue reads SGLang's own setting
    (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, off by default upstream) while Mooncake's manager
    forces its own flag on, and a manager class may say it cannot ack a drain
    (``supports_deferred_decode_kv_release``). So it is on only when the flag, the class and the setting all
    say so; a setting that cannot be read counts as off, under which a release frees the pages at once.
    """
    value = getattr(manager, "enable_deferred_decode_kv_release", None)
    if not isinstance(value, bool):
        return None
    if getattr(manager, "supports_deferred_decode_kv_release", True) is not True:
        return False
    return value and deferred_setting(env) is True


def deferred_setting(env=None):
    """SGLang's deferred-release setting as its code reads it: from SGLang's ``envs`` where loaded (its default
    included), else the variable as SGLang's EnvBool parses it; None when neither says."""
    envs = getattr(sys.modules.get("sglang.srt.environ"), "envs", None)
    get = getattr(getattr(envs, DEFERRED_SETTING, None), "get", None)
    if callable(get):
        try:
            value = get()
        except Exception:
            return None
        return value if isinstance(value, bool) else None
    text = (os.environ if env is None else env).get(DEFERRED_SETTING)
    if text is None:
        return None
    text = text.strip().lower()
    if text in ("1", "true", "yes", "y", "on"):
        return True
    if text in ("0", "false", "no", "n", "off", ""):
        return False
    return None


_pending_problems = {}


def pending_release_problem(prealloc_cls):
    """Why releasing a request still in ``pending_reqs`` would kill the decode scheduler, or "".

    From v0.5.10 a prealloc request whose prefill peer is not resolved yet
    sits in ``DecodePreallocQueue.pending_reqs`` too, and each pass's
    ``_resolve_pending_reqs`` calls its receiver (``init``, or ``abort()``
    after 15 failed attempts, ``_ensure_prefill_info``). Once released, the
    failed request leaves ``queue`` in ``pop_preallocated``. Where that pass
    also sets its ``kv_receiver`` to None but leaves it in ``pending_reqs``
    (SGLang v0.5.14), the next call on the receiver raises AttributeError and
    the scheduler dies, about 14 s later; SGLang's own ``abort_request`` does
    the same there. v0.5.10 and v0.5.11 keep the receiver (``pop_preallocated``
    clears nothing), v0.5.18 drops the failed request from ``pending_reqs``
    too ("DecodeRequest is shared between self.queue and self.pending_reqs").
    Read from the code, not from the version: a pass that cannot be read is
    a problem.
    """
    known = _pending_problems.get(prealloc_cls)
    if known is not None:
        return known
    name = "DecodePreallocQueue.pop_preallocated"
    tree = capabilities._function_tree(getattr(prealloc_cls, "pop_preallocated", None))
    if tree is None:
        problem = (f"{name} cannot be read, so whether a released request still in pending_reqs keeps a receiver "
                   "for SGLang's next _resolve_pending_reqs is unknown")
    elif _assigns_none(tree, "kv_receiver") and not _assigns(tree, "pending_reqs"):
        problem = (f"{name} sets a failed request's kv_receiver to None but leaves it in pending_reqs, where "
                   "SGLang's next _resolve_pending_reqs calls that receiver (AttributeError: the decode scheduler "
                   "dies); a request still resolving its prefill peer cannot be released on this SGLang")
    else:
        problem = ""
    _pending_problems[prealloc_cls] = problem
    return problem


def _in_pending(scheduler, decode_req):
    pending = getattr(getattr(scheduler, "disagg_decode_prealloc_queue", None), "pending_reqs", None) or ()
    return any(d is decode_req for d in list(pending))


def _assigns_none(tree, attr):
    return any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is None
               and any(isinstance(t, ast.Attribute) and t.attr == attr for t in node.targets)
               for node in ast.walk(tree))


def can_register_deferred(manager):
    """Whether register_deferred_abort_room(room) can be called the way Scheduler.abort_request calls it."""
    register = getattr(manager, "register_deferred_abort_room", None)
    if not callable(register):
        return False
    try:
        inspect.signature(register).bind(0)
        return True
    except (TypeError, ValueError):
        return False


def receiver_class(scheduler, backend):
    """The backend's receiver class, or None until one can be seen."""
    conn = sys.modules.get(f"sglang.srt.disaggregation.{backend}.conn")
    if conn is not None:
        for key, value in vars(conn).items():
            if isinstance(value, type) and key.lower() == f"{backend}kvreceiver":
                return value
    for _, decode_req in queued(scheduler):
        found = backend_receiver(getattr(decode_req, "kv_receiver", None), backend)
        if found is not None:
            return found
    return None


def backend_receiver(receiver, backend):
    """The receiver's class if it is one of the backend's own (not a health check's)."""
    if receiver is None or (type(receiver).__name__.startswith("Fake") and backend != "fake"):
        return None
    return type(receiver)


def queues(scheduler):
    """The live (prealloc, transfer) lists; an absent queue reads as empty."""
    prealloc = getattr(getattr(scheduler, "disagg_decode_prealloc_queue", None), "queue", None)
    transfer = getattr(getattr(scheduler, "disagg_decode_transfer_queue", None), "queue", None)
    return (prealloc if prealloc is not None else ()), (transfer if transfer is not None else ())


def queued(scheduler):
    prealloc, transfer = queues(scheduler)
    for decode_req in prealloc:
        yield PREALLOC, decode_req
    for decode_req in transfer:
        yield TRANSFER, decode_req


def request_room(req):
    """The Req's room; None (health checks on some releases) reads as 0."""
    room = getattr(req, "bootstrap_room", None)
    return 0 if room is None else room


# -- orders -----------------------------------------------------------------


def apply_order(order, scheduler, capabilities_for, note_deferred, pp_stages=1):
    """Scheduler thread: decides a decode order against the live queues and pulls the lever.

    ``note_deferred(decode_req)`` remembers a room registered as a deferred abort.
    ``pp_stages``: the PP size of this decode scheduler's group.
    """
    found = next(((queue, d) for queue, d in queued(scheduler)
                  if getattr(getattr(d, "req", None), "rid", None) == order.rid), None)
    if found is None:
        return not_found(order.rid, WHERE)
    queue, decode_req = found
    req = decode_req.req
    room = request_room(req)
    receiver = getattr(decode_req, "kv_receiver", None)
    refused, caps = screen(order, room, getattr(req, "bootstrap_host", None), receiver,
                           "the request has no KV receiver to abort", capabilities_for, WHERE)
    if refused is not None:
        return refused
    if queue == PREALLOC and _in_pending(scheduler, decode_req):
        problem = pending_release_problem(type(scheduler.disagg_decode_prealloc_queue))
        if problem:
            return unsupported(order.rid, problem)
    view = observe_receiver(receiver, room)
    # Under PP a transfer-queue request leaves only once every stage's poll is
    # Success or Failed, and then each stage takes its own branch
    # (SchedulerPPMixin._pp_pd_get_decode_transferred_ids and
    # process_decode_transfer_queue, managers/scheduler_pp_mixin.py, v0.5.10
    # to v0.5.18): a stage left at Success would decode a request the others
    # failed. So there a Success receiver is aborted like a started one, as
    # SGLang's own abort_request does on every stage.
    if view.poll == SUCCESS and not (pp_stages > 1 and queue == TRANSFER):
        return transfer_succeeded(order.rid, room)
    failed = view.poll == FAILED
    # In the prealloc queue no metadata was sent: prefill has no page to write to.
    if queue == TRANSFER and view.transfer_started is not False and not failed and not order.prefill_stopped:
        return transfer_live(order.rid, room, view.transfer_started)
    manager = getattr(receiver, "kv_mgr", None)
    would_defer = queue == TRANSFER and deferred_release(manager) is True and can_register_deferred(manager)
    if failed:
        result, levers = "already_failed", [ABORT] + ([DEFERRED_ABORT] if note_deferred(decode_req, None) else [])
        if not order.dry_run:
            _repoll_prealloc(queue, decode_req)
    elif order.dry_run:
        result, levers = "would_flip", [ABORT] + ([DEFERRED_ABORT] if would_defer else [])
    else:
        reason = DEFAULT_REASON if order.reason is None else f"{DEFAULT_REASON}: {order.reason}"
        try:
            receiver.abort()
        except Exception:
            logger.exception("rid=%s bootstrap_room=%s: the receiver's abort() raised", order.rid, room)
            return internal_error(order.rid, "the receiver's abort() raised; see the scheduler log")
        levers = [ABORT]
        record_failure(manager, room, reason, "the receiver is aborted anyway")
        _repoll_prealloc(queue, decode_req)
        # What Scheduler.abort_request does after abort() for the transfer queue.
        if would_defer and getattr(receiver, "abort_notified", False) is True:
            try:
                manager.register_deferred_abort_room(room)
                levers.append(DEFERRED_ABORT)
                note_deferred(decode_req, True)
            except Exception:
                logger.exception("rid=%s bootstrap_room=%s: register_deferred_abort_room raised; the pages are "
                                 "freed without waiting for prefill's ABORT_ACK", order.rid, room)
        result = "flipped"
        logger.warning("rid=%s bootstrap_room=%s %s (decode %s queue, levers %s)", order.rid, room, reason, queue,
                       ",".join(levers))
    return Outcome(200, {"result": result, "rid": order.rid, "bootstrap_room": room, "lever": "conclude_state",
                         "levers": levers, "applied_unix": time.time()})


def _repoll_prealloc(queue, decode_req):
    """Makes SGLang's prealloc pass poll the aborted receiver, so that its own Failed branch releases it.

    SGLang up to v0.5.11 (``DecodePreallocQueue._update_handshake_waiters``,
    ``disaggregation/decode.py``) returns without polling any receiver while
    every prealloc request has ``waiting_for_input`` set; an aborted one then
    stays queued until pages free up for it (v0.5.18 added the check "Still
    poll if any receiver was aborted"). Clearing the flag of the aborted
    request (set again by SGLang only on a WaitingForInput poll, which a
    latched Failed never returns) makes the next pass poll it and take the
    Failed branch; a request without the flag is never given pages, which is
    what an aborted request needs.
    """
    if queue == PREALLOC and getattr(decode_req, "waiting_for_input", None) is True:
        decode_req.waiting_for_input = False


def transfer_live(rid, room, started):
    why = ("has started and not finished" if started else
           "may have started (this receiver does not say)")
    return Outcome(
        409,
        {"result": "transfer_live", "rid": rid, "bootstrap_room": room,
         "error": f"the KV transfer into the pages of rid {rid!r} {why}, and prefill_stopped was not asserted; "
                  "releasing its pages now could let a late write corrupt another request. Nothing was changed"},
    )
