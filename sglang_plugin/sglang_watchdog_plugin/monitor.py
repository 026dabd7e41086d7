"""Per-scheduler state: loop counter, inflight rooms, pending orders.

Threading model: only the scheduler thread (inside the hooked pass) reads
SGLang objects or changes them. It publishes a Snapshot by swapping one
attribute; the HTTP threads read that snapshot and the loop counters, and
hand force-fail orders over through a deque. At most MAX_PENDING_ORDERS
orders wait in it; an HTTP thread that gives up on its order takes it out
again, so a stuck scheduler loop does not collect them.

Cost model, per pass: a counter bump and two length checks when nothing
changed. When the queue length changed, the snapshot takes the live
membership (a tuple copy of the queue) and reads only requests it has not
seen before: SGLang appends to the queue between passes and only the pass
removes, so membership does not lag. Every room's poll and progress are
re-read (1-2 us a room) every REOBSERVE_INTERVAL_S and right after an order
was handled; that also bounds any staleness if a release ever did remove and
append outside the pass.
"""

import collections
import logging
import os
import threading
import time
from typing import NamedTuple

from .identity import sglang_version
from .observe import UNKNOWN, observe, poll_name
from .orders import (
    ForceFailOrder,
    apply_order,
    internal_error,
    not_found,
    room_mismatch,
    too_many_orders,
    unresponsive,
)

logger = logging.getLogger("sglang_watchdog_plugin")

API_VERSION = 1
ORDER_TIMEOUT_S = 5.0
MAX_PENDING_ORDERS = 64
REOBSERVE_INTERVAL_S = 0.1
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST
_ERROR_LOG_INTERVAL_S = 60.0


class RequestFacts(NamedTuple):
    """What does not change while a request sits in the inflight queue."""

    rid: str
    bootstrap_room: int
    bootstrap_addr: str
    prompt_tokens: int
    entry_perf: float
    health_check: bool


class Snapshot(NamedTuple):
    """What the HTTP threads may read.

    ``rooms`` maps id(req) to a room, the plain tuple
    ``(req, RequestFacts, poll, progress, send_failed)``: plain because the
    scheduler thread builds one per room on every re-observation. Holding req
    keeps its id() from being taken by another object while the room is known.
    The scheduler thread only adds to that dict until it replaces it with a
    fresh one, so a reader's ``get`` is safe. The HTTP threads never touch the
    request objects themselves.
    """

    members: tuple
    rooms: dict
    inflight: int
    bootstrap: int
    waiting: int


_EMPTY = Snapshot(members=(), rooms={}, inflight=0, bootstrap=0, waiting=0)


class Monitor:
    def __init__(self, identity):
        self.identity = identity
        self.order_timeout = ORDER_TIMEOUT_S
        self.max_pending_orders = MAX_PENDING_ORDERS
        self.iterations = 0
        self.last_iteration_unix = 0.0
        self.snapshot = _EMPTY
        self.listener = None
        self._orders = collections.deque()
        # HTTP threads only: makes the length check and the append one step.
        # The scheduler thread never takes it (it only pops, which keeps the bound).
        self._enqueue_lock = threading.Lock()
        # Scheduler thread only from here on.
        self._rooms = {}  # id(req) -> room tuple, shared with the latest snapshot
        self._last_queue = None  # the queue list at the last publication, and its length
        self._last_length = 0
        self._length_before_pass = 0
        self._handled_order = False
        self._reobserve_interval = REOBSERVE_INTERVAL_S
        self._next_reobserve = 0.0
        self._next_error_log = 0.0
        self._suppressed_errors = 0

    # -- scheduler thread -------------------------------------------------

    def before_pass(self, scheduler):
        try:
            self.iterations += 1
            self.last_iteration_unix = time.time()
            queue = scheduler.disagg_prefill_inflight_queue
            if self._orders:
                self._handle_orders(queue)
            self._length_before_pass = len(queue)
            if len(queue) != self.snapshot.inflight:
                self._publish(scheduler, queue, self._newcomers(queue), time.perf_counter())
        except Exception:
            self._log_error("before the inflight pass")

    def after_pass(self, scheduler):
        try:
            queue = scheduler.disagg_prefill_inflight_queue
            now = time.perf_counter()
            if self._handled_order or now >= self._next_reobserve:
                self._reobserve_all(queue, now)
                self._publish(scheduler, queue, (), now)
            elif len(queue) != self.snapshot.inflight:
                # The pass only ever removes requests: nothing new to observe.
                newcomers = () if len(queue) <= self._length_before_pass else self._newcomers(queue)
                self._publish(scheduler, queue, newcomers, now)
        except Exception:
            self._log_error("after the inflight pass")

    def _handle_orders(self, queue):
        while self._orders:
            order = self._orders.popleft()
            if not order.claim():
                continue  # withdrawn after its timeout: never apply it
            outcome = internal_error(order.rid, "the plugin failed while applying the order; see the scheduler log")
            try:
                outcome = apply_order(order, queue)
            except Exception:
                logger.exception("applying a force-fail order for rid=%s failed", order.rid)
            finally:
                order.finish(outcome)
                self._handled_order = True

    def _newcomers(self, queue):
        if queue is self._last_queue and len(queue) >= self._last_length:
            return queue[self._last_length:]  # SGLang appends to the queue between passes
        rooms = self._rooms
        return [req for req, room in zip(queue, map(rooms.get, map(id, queue))) if room is None]

    def _publish(self, scheduler, queue, newcomers, now):
        rooms = self._rooms
        for req in newcomers:
            if id(req) not in rooms:
                facts = _describe(req, now)
                if facts is not None:  # unnamed requests cannot be listed nor targeted
                    rooms[id(req)] = _observed(req, facts)
        self._last_queue = queue
        self._last_length = len(queue)
        self.snapshot = Snapshot(
            members=tuple(queue),
            rooms=rooms,
            inflight=len(queue),
            bootstrap=_length(getattr(getattr(scheduler, "disagg_prefill_bootstrap_queue", None), "queue", None)),
            waiting=_length(getattr(scheduler, "waiting_queue", None)),
        )

    def _reobserve_all(self, queue, now):
        known = self._rooms
        rooms = {}
        for req in queue:
            room = known.get(id(req))
            facts = _describe(req, now) if room is None else room[1]
            if facts is not None:
                rooms[id(req)] = _observed(req, facts)
        # A fresh dict: released requests are let go, and readers of the
        # previous snapshot keep a dict that no longer changes.
        self._rooms = rooms
        self._handled_order = False
        self._next_reobserve = now + self._reobserve_interval

    def _log_error(self, where):
        # Called from except blocks. A persistent fault would otherwise log on
        # every pass of the scheduler loop.
        now = time.monotonic()
        if now < self._next_error_log:
            self._suppressed_errors += 1
            return
        logger.exception(
            "sglang-watchdog plugin failed %s (%d similar errors suppressed); the scheduler carries on",
            where,
            self._suppressed_errors,
        )
        self._suppressed_errors = 0
        self._next_error_log = now + _ERROR_LOG_INTERVAL_S

    # -- HTTP threads -----------------------------------------------------

    def listing(self):
        snapshot = self.snapshot
        now = time.perf_counter()
        ident = self.identity
        return {
            "api_version": API_VERSION,
            "server": {
                "pid": os.getpid(),
                "dp_rank": ident.dp_rank,
                "pp_rank": ident.pp_rank,
                "tp_rank": ident.tp_rank,
                "disaggregation_mode": ident.mode,
                "transfer_backend": ident.backend,
                "sglang_version": sglang_version(),
            },
            "now_unix": time.time(),
            "loop": {"iterations": self.iterations, "last_iteration_unix": self.last_iteration_unix},
            "queues": {"bootstrap": snapshot.bootstrap, "waiting": snapshot.waiting, "inflight": snapshot.inflight},
            "inflight": [_room_json(room, now) for room in _listed(snapshot)],
        }

    def force_fail(self, rid, bootstrap_room, reason, dry_run):
        """Answers fast from the latest snapshot where it can, else waits for the scheduler thread."""
        known = next((facts for _, facts, *_ in _listed(self.snapshot) if facts.rid == rid), None)
        if known is None:
            return not_found(rid)
        if bootstrap_room is not None and bootstrap_room != known.bootstrap_room:
            return room_mismatch(rid, known.bootstrap_room)
        order = ForceFailOrder(rid, bootstrap_room, reason, dry_run)
        with self._enqueue_lock:
            pending = len(self._orders)
            if pending >= self.max_pending_orders:
                return too_many_orders(rid, pending)
            self._orders.append(order)
        timeout = self.order_timeout
        outcome = order.wait(timeout)
        if outcome is not None:
            return outcome
        # Withdrawn: take it out now rather than leave it to the next pass,
        # which may be far off while the scheduler loop is stuck.
        try:
            self._orders.remove(order)
        except (ValueError, IndexError):
            pass  # the scheduler thread popped it first (and skips it: it is withdrawn)
        return unresponsive(rid, timeout)

    def close(self):
        if self.listener is not None:
            self.listener.close()


def _listed(snapshot):
    """The snapshot's rooms in queue order (only ids of the members are used)."""
    rooms = snapshot.rooms
    for req in snapshot.members:
        room = rooms.get(id(req))
        if room is not None:
            yield room


def _observed(req, facts):
    try:
        return (req, facts) + observe(getattr(req, "disagg_kv_sender", None), facts.bootstrap_room)
    except Exception:  # a sender that fails to answer is listed, not dropped
        return (req, facts, UNKNOWN, -1, False)


def _describe(req, now):
    rid = getattr(req, "rid", None)
    room = getattr(req, "bootstrap_room", None)
    if not isinstance(rid, str) or not isinstance(room, int) or isinstance(room, bool):
        return None  # cannot be named in the listing nor targeted by an order
    host = getattr(req, "bootstrap_host", None)
    port = getattr(req, "bootstrap_port", None)
    if host is None:
        addr = ""
    elif port is None:
        addr = str(host)
    else:
        addr = f"{host}:{port}"
    return RequestFacts(
        rid=rid,
        bootstrap_room=room,
        bootstrap_addr=addr,
        prompt_tokens=_length(getattr(req, "origin_input_ids", None)),
        entry_perf=_entry_time(req, now),
        health_check=rid.startswith("HEALTH_CHECK") or room == 0 or host == FAKE_BOOTSTRAP_HOST,
    )


def _entry_time(req, now):
    # SGLang stamps the entry with time.perf_counter(); releases without the
    # field (or with a value from another clock) get the time of first sight.
    stamped = getattr(getattr(req, "time_stats", None), "prefill_transfer_queue_entry_time", None)
    if isinstance(stamped, (int, float)) and not isinstance(stamped, bool) and 0 < stamped <= now:
        return float(stamped)
    return now


def _length(collection):
    try:
        return len(collection)
    except TypeError:
        return 0


def _room_json(room, now):
    _, facts, poll, progress, send_failed = room
    return {
        "rid": facts.rid,
        "bootstrap_room": facts.bootstrap_room,
        "bootstrap_addr": facts.bootstrap_addr,
        "poll": poll_name(poll),
        "age_seconds": round(max(0.0, now - facts.entry_perf), 3),
        "prompt_tokens": facts.prompt_tokens,
        "progress": progress,
        "send_failed": send_failed,
        "health_check": facts.health_check,
    }
