"""Standing wedge orders (POST /admin/wedge_order): fail every room queued behind one wedged transfer worker.

An order names a transfer queue and the chunk its worker holds. While it
holds (not expired on the monotonic clock, and the worker still holds that
very chunk), the scheduler thread fails, at each pass before SGLang's
inflight pass, every room of the inflight queue bound for that queue, with
the force-fail levers (orders.fail_request): health checks and warm-ups,
Success rooms and rooms younger than the order's min_age_seconds excepted.
Chunk numbers only grow, so once the worker holds another chunk the order is
void for good: the wedge cleared.

Threads: HTTP threads create and renew orders under ``_lock`` (which the
scheduler thread never takes) and publish the per-queue dict by replacing
it; a renewal of the same chunk only re-assigns single fields. The scheduler
thread appends the rooms it failed to the order's ``failed`` deque, which
the next call for that queue drains (deque appends and pops are atomic), and
it alone writes ``rooms_failed`` and ``ineffective``.
"""

import collections
import logging
import threading
import time
from typing import NamedTuple

from . import transfer_watch
from .observe import FAILED, SUCCESS
from .orders import Outcome, fail_request

logger = logging.getLogger("sglang_watchdog_plugin")

MAX_TTL_S = 300.0


class _Target(NamedTuple):
    """What orders.fail_request reads of an order, for one room of a wedge order."""

    rid: str
    bootstrap_room: int
    reason: str
    dry_run: bool


class WedgeOrder:
    def __init__(self, queue, chunk, expires, min_age, reason, failed):
        self.queue = queue
        self.chunk = chunk
        self.expires = expires  # time.monotonic()
        self.min_age = min_age
        self.reason = reason
        self.failed = failed  # the queue's deque of rooms failed and not yet reported, kept across orders
        self.rooms_failed = 0
        self.ineffective = None  # the lever_ineffective body, once the levers did not make a room read Failed

    def holds(self, workers, now):
        return (self.ineffective is None and now < self.expires
                and transfer_watch.held_chunk(workers[self.queue]) == self.chunk)


class WedgeOrders:
    def __init__(self):
        self.orders = {}  # transfer queue -> WedgeOrder; replaced, never changed in place
        self._lock = threading.Lock()

    # -- HTTP threads -----------------------------------------------------

    def order(self, workers, queue, chunk, ttl, min_age, reason, dry_run, would_fail):
        """Answers one call. ``would_fail()`` lists the rooms a real order would fail now (dry runs)."""
        held = transfer_watch.held_chunk(workers[queue])
        with self._lock:
            orders = self.orders
            standing = orders.get(queue)
            if held != chunk:
                if standing is not None:
                    self._drop(queue)
                return _cleared(queue, chunk, held, workers[queue], _drain(standing))
            if dry_run:
                return Outcome(200, {"result": "would_order", "expires_in_seconds": ttl, "failed": would_fail()})
            failed = _drain(standing)
            if standing is not None and standing.ineffective is not None:
                self._drop(queue)
                return Outcome(500, {**standing.ineffective, "failed": failed})
            now = time.monotonic()
            if standing is not None and standing.chunk == chunk and now < standing.expires:
                standing.min_age, standing.reason = min_age, reason
                standing.expires = now + ttl
            else:
                deque = standing.failed if standing is not None else collections.deque()
                self.orders = {**orders, queue: WedgeOrder(queue, chunk, now + ttl, min_age, reason, deque)}
        return Outcome(200, {"result": "ordered", "expires_in_seconds": ttl, "failed": failed})

    def _drop(self, queue):
        self.orders = {q: o for q, o in self.orders.items() if q != queue}

    def listing(self, workers):
        now = time.monotonic()
        return [
            {"transfer_queue": q, "chunk": o.chunk, "expires_in_seconds": round(o.expires - now, 3),
             "rooms_failed": o.rooms_failed}
            for q, o in sorted(self.orders.items()) if o.holds(workers, now)
        ]

    # -- scheduler thread -------------------------------------------------

    def apply(self, workers, queue, facts_of, capabilities_for):
        """Fails the rooms of the live inflight queue that a holding order covers; True if any was failed."""
        orders = self.orders
        if not orders:
            return False
        now = time.monotonic()
        live = {q: o for q, o in orders.items() if o.holds(workers, now)}
        if not live:
            return False
        perf = time.perf_counter()
        changed = False
        for req in tuple(queue):
            facts = facts_of(req, perf)
            order = live.get(facts.transfer_queue) if facts is not None else None
            if order is None or facts.health_check or perf - facts.entry_perf < order.min_age:
                continue
            target = _Target(facts.rid, facts.bootstrap_room, order.reason, False)
            outcome = fail_request(target, req, capabilities_for)
            if outcome.body["result"] == "flipped":
                order.failed.append({"rid": facts.rid, "bootstrap_room": facts.bootstrap_room,
                                     "levers": outcome.body["levers"]})
                order.rooms_failed += 1
                changed = True
            elif outcome.body["result"] == "lever_ineffective":
                # Pulling again at every pass would change nothing: the order stops, its next call says why.
                order.ineffective = outcome.body
                del live[order.queue]
        return changed


def would_fail(rooms, queue, min_age, levers, now):
    """The rooms a real order would fail now, from the latest observation (room tuples of monitor.py)."""
    return [
        {"rid": facts.rid, "bootstrap_room": facts.bootstrap_room, "levers": list(levers)}
        for _, facts, poll, *_ in rooms
        if facts.transfer_queue == queue and not facts.health_check and poll not in (SUCCESS, FAILED)
        and now - facts.entry_perf >= min_age
    ]


def _drain(order):
    failed = []
    if order is not None:
        while order.failed:
            failed.append(order.failed.popleft())
    return failed


def _cleared(queue, chunk, held, worker_queue, failed):
    if held is not None:
        now_holds = f"holds chunk {held}"
    elif transfer_watch.state_of(worker_queue) is None:
        now_holds = "has not been seen taking a chunk yet (tracked: false)"
    else:
        now_holds = "holds no chunk: it waits for one"
    return Outcome(409, {"result": "wedge_cleared", "failed": failed,
                         "error": f"the worker of transfer queue {queue} {now_holds}, not chunk {chunk}; "
                                  "no order stands for this queue"})
