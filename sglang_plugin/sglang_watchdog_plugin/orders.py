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

from .observe import FAILED, lever_name, observe, pull_lever

logger = logging.getLogger("sglang_watchdog_plugin")

DEFAULT_REASON = "force-failed by sglang-watchdog"

_PENDING, _CLAIMED, _WITHDRAWN = range(3)


class Outcome(NamedTuple):
    status: int
    body: dict


class ForceFailOrder:
    def __init__(self, rid, bootstrap_room, reason, dry_run):
        self.rid = rid
        self.bootstrap_room = bootstrap_room  # None: any room
        self.reason = reason  # None: none given
        self.dry_run = dry_run
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


def apply_order(order, queue):
    """Scheduler thread: decides the order against the live inflight queue and applies it."""
    req = next((r for r in queue if getattr(r, "rid", None) == order.rid), None)
    if req is None:
        return not_found(order.rid)
    room = getattr(req, "bootstrap_room", None)
    if order.bootstrap_room is not None and room != order.bootstrap_room:
        return room_mismatch(order.rid, room)
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is None:
        return internal_error(order.rid, "the request has no KV sender to fail")

    lever = lever_name(sender)
    if observe(sender, room)[0] == FAILED:  # the lever is set, or the status already reads Failed
        result = "already_failed"
    elif order.dry_run:
        result = "would_flip"
    else:
        reason = DEFAULT_REASON if order.reason is None else f"{DEFAULT_REASON}: {order.reason}"
        pull_lever(sender)
        _record_failure(sender, room, reason)
        result = "flipped"
        logger.warning("rid=%s bootstrap_room=%s %s (lever %s)", order.rid, room, reason, lever)
    return Outcome(
        200,
        {"result": result, "rid": order.rid, "bootstrap_room": room, "lever": lever, "applied_unix": time.time()},
    )


def _record_failure(sender, room, reason):
    # Backends that keep failure records surface the reason in SGLang's own
    # "Prefill transfer failed ... with exception ..." log line.
    record = getattr(getattr(sender, "kv_mgr", None), "record_failure", None)
    if record is None:
        return
    try:
        record(room, reason)
    except Exception:
        logger.exception("kv_mgr.record_failure failed for bootstrap_room=%s; the lever is set anyway", room)


def not_found(rid):
    return Outcome(404, {"result": "not_found", "rid": rid, "error": f"no inflight request has rid {rid!r}"})


def room_mismatch(rid, actual_room):
    return Outcome(
        409,
        {
            "result": "room_mismatch",
            "rid": rid,
            "bootstrap_room": actual_room,
            "error": f"rid {rid!r} is inflight with bootstrap_room {actual_room}, not the one given",
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
