"""Decode side, orders: a force-fail decided against the live decode queues, on the scheduler thread.

The hand-over between the HTTP thread and the scheduler thread is the
prefill side's (orders.py); this is what the scheduler thread does with a
decode order once it claimed it.
"""

import logging
import time

from .capabilities import ABORT
from .decode_capabilities import abort_frame_problem, pending_release_problem
from .decode_observe import PREALLOC, TRANSFER, WHERE, observe_receiver, queued, request_room
from .decode_release import can_register_deferred, deferred_release
from .observe import FAILED, SUCCESS
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


def _in_pending(scheduler, decode_req):
    pending = getattr(getattr(scheduler, "disagg_decode_prealloc_queue", None), "pending_reqs", None) or ()
    return any(d is decode_req for d in list(pending))


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
    if not failed and _would_send_abort(receiver):
        problem = abort_frame_problem(type(receiver), type(manager))
        if problem:
            return unsupported(order.rid, problem)
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


def _would_send_abort(receiver):
    """Whether the receiver's abort() would send its prefill peers a frame: it knows them, and has not told them.

    The condition of SGLang's own CommonKVReceiver.abort (disaggregation/common/conn.py, v0.5.18).
    """
    return getattr(receiver, "bootstrap_infos", None) is not None and getattr(receiver, "abort_notified", False) is not True


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
