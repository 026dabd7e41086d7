"""Force-fail orders: the hand-over between the HTTP thread and the scheduler thread.

An order is PENDING until exactly one side moves it on, under its lock: the
scheduler thread claims it (and then always finishes it), or the HTTP thread
withdraws it after its timeout. A withdrawn order is never applied, so a 503
answer can never be followed by a flip.
"""

import logging
import threading
import time
from typing import NamedTuple

from .capabilities import ABORT, SEND_FAILED
from .observe import FAILED, SUCCESS, UNKNOWN, as_poll_code, lever_name, observe, poll_name

logger = logging.getLogger("sglang_watchdog_plugin")

DEFAULT_REASON = "force-failed by sglang-watchdog"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST

_PENDING, _CLAIMED, _WITHDRAWN = range(3)


class Outcome(NamedTuple):
    status: int
    body: dict


class ForceFailOrder:
    def __init__(self, rid, bootstrap_room, reason, dry_run, prefill_stopped=False):
        self.rid = rid
        self.bootstrap_room = bootstrap_room  # None: any room
        self.reason = reason  # None: none given
        self.dry_run = dry_run
        # Decode only: the caller asserts that the prefill peer stopped writing.
        self.prefill_stopped = prefill_stopped
        self._lock = threading.Lock()
        self._state = _PENDING
        self._done = threading.Event()
        self._outcome = None

    def claim(self):
        """Scheduler thread: True if the order is still wanted; the caller must finish() it."""
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _CLAIMED
            return True

    def finish(self, outcome):
        self._outcome = outcome
        self._done.set()

    def wait(self, timeout):
        """HTTP thread: the outcome, or None once the order has been withdrawn."""
        if self._done.wait(timeout):
            return self._outcome
        with self._lock:
            if self._state == _PENDING:
                self._state = _WITHDRAWN
                return None
        # Claimed just in time: the scheduler thread is applying it right now.
        self._done.wait()
        return self._outcome


def screen(order, room, host, holder, no_holder, capabilities_for, where="inflight"):
    """The refusals an order meets before its transfer is read, in this order: another room, a health check,
    no KV sender or receiver (``holder`` None; ``no_holder`` is the error), no lever for the holder's class.

    Returns (refusal, None), or (None, the holder's capabilities).
    """
    if order.bootstrap_room is not None and room != order.bootstrap_room:
        return room_mismatch(order.rid, room, where), None
    if is_health_check(order.rid, room, host):
        return health_check(order.rid, room), None
    if holder is None:
        return internal_error(order.rid, no_holder), None
    capabilities = capabilities_for(holder)
    if not capabilities.levers:
        return unsupported(order.rid, capabilities.note), None
    return None, capabilities


def apply_order(order, queue, capabilities_for, sent_elsewhere=None):
    """Scheduler thread: decides the order against the live inflight queue and applies it.

    ``capabilities_for(sender)`` gives the levers that work for that sender's class;
    ``sent_elsewhere(room)`` (whether another rank of the TP/CP group still sends the room, the ranks not
    watched).
    """
    req = next((r for r in queue if getattr(r, "rid", None) == order.rid), None)
    if req is None:
        return not_found(order.rid)
    return fail_request(order, req, capabilities_for, sent_elsewhere)


def fail_request(order, req, capabilities_for, sent_elsewhere=None):
    """Scheduler thread: applies an order (rid, bootstrap_room, reason, dry_run) to this inflight request.

    A wedge order (wedge.py) passes one such order per room it fails.
    """
    room = getattr(req, "bootstrap_room", None)
    sender = getattr(req, "disagg_kv_sender", None)
    refused, capabilities = screen(order, room, getattr(req, "bootstrap_host", None), sender,
                                   "the request has no KV sender to fail", capabilities_for)
    if refused is not None:
        return refused

    poll = observe(sender, room)[0]
    succeeded = poll != FAILED and (poll == SUCCESS or _status(sender, room) == SUCCESS)
    sending_elsewhere, unwatched = sent_elsewhere(room) if succeeded and sent_elsewhere else (False, [])
    if poll == FAILED:  # a lever is set, or the status already reads Failed
        result, levers = "already_failed", _levers_set(sender, room, capabilities.levers)
    elif succeeded and not sending_elsewhere:
        # update_status(room, Failed) would overwrite a Success: leave it to the Success branch. Not where
        # another rank of the group still sends the room: SGLang's pass MIN-reduces the polls over the group,
        # so its Success branch waits for that rank (for ever on a wedged one), and SGLang's own abort()
        # overwrites this rank's Success just so. A rank not watched may be sending it or be done: whether
        # the group succeeded is unknown, so nothing is changed and nothing is promised.
        if unwatched:
            return group_unwatched(order.rid, room, unwatched)
        return transfer_succeeded(order.rid, room)
    elif order.dry_run:
        result, levers = "would_flip", list(capabilities.levers)
    else:
        reason = DEFAULT_REASON if order.reason is None else f"{DEFAULT_REASON}: {order.reason}"
        levers = _pull(sender, room, capabilities.levers, order.rid)
        record_failure(getattr(sender, "kv_mgr", None), room, reason)
        after = observe(sender, room)[0]
        if after != FAILED:
            # The code read said these levers work; the sender says otherwise. Never answer "flipped"
            # for a request SGLang's pass will not release.
            logger.error("rid=%s bootstrap_room=%s: levers %s pulled but the sender still reads %s",
                         order.rid, room, ",".join(levers), poll_name(after))
            return lever_ineffective(order.rid, room, levers, after)
        result = "flipped"
        logger.warning("rid=%s bootstrap_room=%s %s (levers %s)", order.rid, room, reason, ",".join(levers))
    return Outcome(
        200,
        {"result": result, "rid": order.rid, "bootstrap_room": room, "lever": lever_name(sender),
         "levers": levers, "applied_unix": time.time()},
    )


def is_health_check(rid, room, host):
    """SGLang's health checks (rid prefix) and warm-ups (fake host or room 0 without the prefix)."""
    return room == 0 or host == FAKE_BOOTSTRAP_HOST or (isinstance(rid, str) and rid.startswith("HEALTH_CHECK"))


def _pull(sender, room, levers, rid):
    """Pulls the levers in order: abort() as Scheduler.abort_request does, then the NIXL flip."""
    pulled = []
    for lever in levers:
        if lever == ABORT:
            try:
                sender.abort()
            except Exception:
                # The flip that may follow still releases the request; say which lever failed.
                logger.exception("rid=%s bootstrap_room=%s: the sender's abort() raised", rid, room)
                continue
        else:
            sender._send_failed = True
        pulled.append(lever)
    if not pulled:
        raise RuntimeError("no lever could be pulled")
    return pulled


def _levers_set(sender, room, levers):
    found = []
    for lever in levers:
        if lever == SEND_FAILED:
            if getattr(sender, "_send_failed", False) is True:
                found.append(lever)
        elif as_poll_code(getattr(sender, "conclude_state", None)) == FAILED or _status(sender, room) == FAILED:
            found.append(lever)
    return found


def _status(sender, room):
    check_status = getattr(getattr(sender, "kv_mgr", None), "check_status", None)
    if check_status is None:
        return UNKNOWN
    try:
        return as_poll_code(check_status(room))
    except Exception:
        return UNKNOWN


def record_failure(manager, room, reason, carry_on="the levers are pulled anyway"):
    # Backends that keep failure records surface the reason in SGLang's own
    # "Prefill/Decode transfer failed ... with exception ..." log line; this
    # replaces abort()'s "Aborted by AbortReq.". carry_on says what happens
    # when the record fails.
    record = getattr(manager, "record_failure", None)
    if record is None:
        return
    try:
        record(room, reason)
    except Exception:
        logger.exception("kv_mgr.record_failure failed for bootstrap_room=%s; %s", room, carry_on)


def health_check(rid, room):
    return Outcome(
        409,
        {"result": "health_check", "rid": rid, "bootstrap_room": room,
         "error": f"rid {rid!r} is an SGLang health check or warm-up request (fake bootstrap host or room 0); "
                  "it is never force-failed"},
    )


def transfer_succeeded(rid, room):
    return Outcome(
        409,
        {"result": "transfer_succeeded", "rid": rid, "bootstrap_room": room,
         "error": f"the KV transfer of bootstrap_room {room} succeeded; nothing was changed and the scheduler's "
                  "Success branch releases the request on its next pass"},
    )


def group_unwatched(rid, room, ranks):
    return Outcome(
        409,
        {"result": "group_unwatched", "rid": rid, "bootstrap_room": room, "ranks": list(ranks),
         "error": f"this rank sent its share of bootstrap_room {room}, but the plugin cannot see whether ranks "
                  f"{', '.join(ranks)} of its attention TP/CP group still send theirs (no fresh file of theirs "
                  "says what their KV manager counts), so whether the request will release itself is unknown; "
                  "nothing was changed"},
    )


def unsupported(rid, note):
    return Outcome(
        501,
        {"result": "unsupported", "rid": rid,
         "error": f"no lever releases a request on this SGLang version and backend, so nothing was changed: {note}"},
    )


def lever_ineffective(rid, room, levers, poll):
    return Outcome(
        500,
        {"result": "lever_ineffective", "rid": rid, "bootstrap_room": room, "levers": list(levers),
         "error": f"levers {', '.join(levers)} were pulled but the sender still reads {poll_name(poll)}: "
                  "SGLang's pass will not release this request"},
    )


def not_found(rid, where="inflight"):
    return Outcome(404, {"result": "not_found", "rid": rid, "error": f"no {where} request has rid {rid!r}"})


def room_mismatch(rid, actual_room, where="inflight"):
    return Outcome(
        409,
        {
            "result": "room_mismatch",
            "rid": rid,
            "bootstrap_room": actual_room,
            "error": f"rid {rid!r} is {where} with bootstrap_room {actual_room}, not the one given",
        },
    )


def unresponsive(rid, timeout):
    return Outcome(
        503,
        {
            "result": "scheduler_unresponsive",
            "rid": rid,
            "error": f"the scheduler loop did not pick the order up within {timeout:g}s; the order was withdrawn",
        },
    )


def too_many_orders(rid, pending):
    return Outcome(
        503,
        {
            "result": "scheduler_unresponsive",
            "rid": rid,
            "error": f"{pending} force-fail orders are already waiting for the scheduler loop; "
            "this one was not queued",
        },
    )


def internal_error(rid, error):
    return Outcome(500, {"result": "internal_error", "rid": rid, "error": error})


def bad_request(error):
    return Outcome(400, {"result": "bad_request", "error": error})


def unauthorized(error):
    return Outcome(401, {"result": "unauthorized", "error": error})
