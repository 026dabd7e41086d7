"""Per-scheduler state: loop counter, inflight rooms, pending orders.

This module is the scheduler thread's side of a Monitor; the HTTP threads'
side is mixed in from listing.py (the listing JSON) and admin.py (force-fail,
wedge and restart orders), both reading the Snapshot of snapshot.py.

Threading model: only the scheduler thread (inside the hooked pass) reads
SGLang objects or changes them. It publishes a Snapshot by swapping one
attribute; the HTTP threads read that snapshot and the loop counters, and
hand force-fail orders over through a deque. At most MAX_PENDING_ORDERS
orders wait in it; an HTTP thread that gives up on its order takes it out
again, so a stuck scheduler loop does not collect them. Standing wedge orders
(wedge.py) are left for the scheduler thread, which applies them after the
force-fail orders and before SGLang's pass; the transfer workers' state
(transfer_watch.py) is written by SGLang's worker threads and only read here.

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

from . import capabilities, kv_threads, peers, process_tree, transfer_watch
from .admin import Admin
from .listing import Listing
from .observe import UNKNOWN, observe, outstanding_chunks
from .orders import apply_order, internal_error, is_health_check
from .snapshot import EMPTY, RequestFacts, Snapshot
from .wedge import WedgeOrders

logger = logging.getLogger("sglang_watchdog_plugin")

ORDER_TIMEOUT_S = 5.0
MAX_PENDING_ORDERS = 64
REOBSERVE_INTERVAL_S = 0.1
# Rooms remembered after they left the queue with chunks outstanding; a
# wedged worker holds a few, so this bound only stops a leak from growing.
MAX_ORPHANS = 1024
_NO_SENDER_YET = "no KV sender of this backend has been seen yet; the levers are worked out from the first one"
_ERROR_LOG_INTERVAL_S = 60.0


class Monitor(Listing, Admin):
    mode = "prefill"
    where = "inflight"  # how not_found and room_mismatch answers name the queue
    no_lever_yet = _NO_SENDER_YET  # lever_note (listing, load log) until the first sender is seen

    def __init__(self, identity):
        self.identity = identity
        # Levers of the backend's sender class; None until a sender of it is seen.
        self.capabilities = None
        self.transfer_queues = None
        # Whether transfer_in_flight reads the manager's per-room count of
        # outstanding chunks; False (proves nothing) until a manager is seen.
        self.transfer_tracking = False
        # The manager's transfer worker queues, once every one of them is watched (transfer_watch.py).
        self.workers = None
        # SGLang's threads of the KV manager (kv_threads.py); None until a manager is seen.
        self.kv_threads = None
        self.wedges = WedgeOrders()
        # The other ranks of the attention TP/CP group, which send their own share of each room's KV
        # (peers.py); None where the group is this rank alone.
        self.peers = None
        # The parent at load, as SGLang's peer recovery records it: a process
        # re-parented since then must not signal its new parent.
        self.parent_pid = os.getppid()
        self.kill = os.kill  # injectable: tests must never end the test runner
        # Where a restart's signal goes (SGLang's launcher, found by walking /proc): injectable too.
        self.find_restart_target = process_tree.serving_top
        self.exit = os._exit
        self.order_timeout = ORDER_TIMEOUT_S
        self.max_pending_orders = MAX_PENDING_ORDERS
        self.iterations = 0
        self.last_iteration_unix = 0.0
        self.snapshot = EMPTY
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
        self._pass_problem = ""
        self._by_class = {}  # sender class -> Capabilities
        self._queue_keys = {}  # id(manager) -> (manager, QueueKey)
        self._orphans = {}  # bootstrap_room -> (sender, transfer_queue)
        self._orphan_rows = ()

    def configure(self, scheduler, pass_fn):
        """Scheduler thread, at load: works out the levers from the code of this SGLang."""
        try:
            self._pass_problem = capabilities.failed_branch_problem(pass_fn)
            sender_cls, manager_cls = capabilities.sender_classes(scheduler, self.identity.backend)
            if sender_cls is not None:
                self._resolve(sender_cls, manager_cls)
            if self.identity.attn_tp_size * self.identity.attn_cp_size > 1:
                self.peers = peers.Group(peers.directory(scheduler, self.identity), self.identity)
            manager = getattr(getattr(scheduler, "disagg_prefill_bootstrap_queue", None), "kv_manager", None)
            if manager is not None:
                self.transfer_queues = self._queue_key(manager).count
                self.transfer_tracking = capabilities.transfer_tracking(manager)
                self._watch_workers(manager)
                self.kv_threads = kv_threads.find(manager)
        except Exception as e:
            self._cannot_inspect(e, "levers")
        logger.info("sglang-watchdog plugin levers on this SGLang: %s%s", *self._lever_summary())

    def _cannot_inspect(self, e, what):
        """From configure's except block: never guess, no lever until the code can be read."""
        logger.exception("sglang-watchdog plugin could not work out the %s of this SGLang", what)
        self._pass_problem = f"the plugin could not inspect this SGLang ({type(e).__name__}: {e})"
        self.capabilities = capabilities.Capabilities((), self._pass_problem)

    def _lever_summary(self):
        """The levers and their note, as the load-time log line shows them."""
        caps = self.capabilities
        return (
            ",".join(caps.levers) if caps and caps.levers else "none",
            f" ({caps.note})" if caps and caps.note else "" if caps else f" ({self.no_lever_yet})",
        )

    def capabilities_for(self, sender):
        cls = type(sender)
        caps = self._by_class.get(cls)
        if caps is None:
            caps = capabilities.detect(cls, type(getattr(sender, "kv_mgr", None)), self._pass_problem)
            self._by_class[cls] = caps
        return caps

    def _resolve(self, sender_cls, manager_cls):
        caps = capabilities.detect(sender_cls, manager_cls, self._pass_problem)
        self._by_class[sender_cls] = caps
        self.capabilities = caps

    def _watch_workers(self, manager):
        """Reports the manager's transfer workers once each of its queues is a FastQueue the plugin watches.

        The hook's install watched FastQueue before SGLang built its managers;
        where that could not happen, watching starts now, and each worker is
        tracked from its next call to get().
        """
        queues = getattr(manager, "transfer_queues", None)
        if not isinstance(queues, (list, tuple)) or not queues:
            return  # NIXL up to v0.5.11 posts from the scheduler thread; Mooncake v0.4.6 has one queue.Queue
        if not all(hasattr(queue, "_buf") for queue in queues):
            return
        for queue in queues:
            if not transfer_watch.watched(queue):
                transfer_watch.install(type(queue))
            transfer_watch.bind_links(queue, manager)
        if all(transfer_watch.watched(queue) for queue in queues):
            self.workers = tuple(queues)

    @property
    def transfer_progress(self):
        return self.workers is not None

    def _queue_key(self, manager):
        entry = self._queue_keys.get(id(manager))
        if entry is None:
            entry = self._queue_keys[id(manager)] = (manager, capabilities.queue_key(manager))
        return entry[1]

    def _sent_elsewhere(self, room):
        """(whether another rank of the group still has a share of this room to send, in flight or waiting in
        its worker queues; the other ranks not watched now), from their files, read now.

        A room done on this rank is not done on the group: SGLang's pass MIN-reduces
        the polls over the group, so its Success branch waits for every rank.
        """
        if self.peers is None:
            return False, []
        return self.peers.sending(room)

    # -- scheduler thread -------------------------------------------------

    def before_pass(self, scheduler):
        try:
            self.iterations += 1
            self.last_iteration_unix = time.time()
            queue = scheduler.disagg_prefill_inflight_queue
            if self._orders:
                self._handle_orders(lambda order: apply_order(order, queue, self.capabilities_for,
                                                              self._sent_elsewhere))
            if self.wedges.orders and self.wedges.apply(self.workers, queue, self._facts_now, self.capabilities_for):
                self._handled_order = True
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

    def _handle_orders(self, apply, what="force-fail order"):
        """Applies the pending orders with apply(order) -> Outcome; what names them in the log."""
        while self._orders:
            order = self._orders.popleft()
            if not order.claim():
                continue  # withdrawn after its timeout: never apply it
            outcome = internal_error(order.rid, "the plugin failed while applying the order; see the scheduler log")
            try:
                outcome = apply(order)
            except Exception:
                logger.exception("applying a %s for rid=%s failed", what, order.rid)
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
                facts = self._describe(req, now)
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
            orphans=self._orphan_rows,
        )

    def _reobserve_all(self, queue, now):
        known = self._rooms
        rooms = {}
        for req in queue:
            room = known.get(id(req))
            if room is None:
                facts = self._describe(req, now)
            else:
                facts = room[1]
                if facts.transfer_queue is None:  # the destinations may have arrived since
                    facts = facts._replace(transfer_queue=self._transfer_queue(req, facts.bootstrap_room))
            if facts is not None:
                rooms[id(req)] = _observed(req, facts)
        departed = known.keys() - rooms.keys()
        if departed or self._orphans:
            self._track_orphans(known, departed, rooms)
        # A fresh dict: released requests are let go, and readers of the
        # previous snapshot keep a dict that no longer changes.
        self._rooms = rooms
        self._handled_order = False
        self._next_reobserve = now + self._reobserve_interval

    def _track_orphans(self, known, departed, rooms):
        """Rooms that left the queue while the manager still counts chunks for them."""
        orphans = self._orphans
        for key in departed:
            if len(orphans) >= MAX_ORPHANS:
                break
            req, facts = known[key][0], known[key][1]
            sender = getattr(req, "disagg_kv_sender", None)
            if outstanding_chunks(sender, facts.bootstrap_room):
                orphans[facts.bootstrap_room] = (sender, facts.transfer_queue)
        if not orphans:
            self._orphan_rows = ()
            return
        listed = {room[1].bootstrap_room for room in rooms.values()}
        rows = []
        for bootstrap_room, (sender, queue) in list(orphans.items()):
            count = outstanding_chunks(sender, bootstrap_room)
            if count == 0 or bootstrap_room in listed:
                del orphans[bootstrap_room]
            else:
                rows.append((bootstrap_room, queue, count))
        self._orphan_rows = tuple(rows)

    def _describe(self, req, now):
        rid = getattr(req, "rid", None)
        room = getattr(req, "bootstrap_room", None)
        if not isinstance(rid, str) or not isinstance(room, int) or isinstance(room, bool):
            return None  # cannot be named in the listing nor targeted by an order
        if self.capabilities is None:
            found = capabilities.backend_sender(getattr(req, "disagg_kv_sender", None), self.identity.backend)
            if found is not None:
                self._resolve(*found)
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
            health_check=is_health_check(rid, room, host),
            transfer_queue=self._transfer_queue(req, room),
        )

    def _facts_now(self, req, now):
        """A live request's facts, with its transfer queue where it can be known by now; None if unnamed."""
        room = self._rooms.get(id(req))
        facts = room[1] if room is not None else self._describe(req, now)
        if facts is not None and facts.transfer_queue is None:
            facts = facts._replace(transfer_queue=self._transfer_queue(req, facts.bootstrap_room))
        return facts

    def _transfer_queue(self, req, room):
        manager = getattr(getattr(req, "disagg_kv_sender", None), "kv_mgr", None)
        if manager is None:
            return None
        key = self._queue_key(manager)
        if self.transfer_queues is None and key.count is not None:
            self.transfer_queues = key.count
        if not self.transfer_tracking:
            self.transfer_tracking = capabilities.transfer_tracking(manager)
        if self.workers is None:
            self._watch_workers(manager)
        return capabilities.queue_of(key, manager, room)

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

    def close(self):
        if self.listener is not None:
            self.listener.close()


def _observed(req, facts):
    sender = getattr(req, "disagg_kv_sender", None)
    try:
        room = facts.bootstrap_room
        return (req, facts) + observe(sender, room) + (outstanding_chunks(sender, room) > 0,)
    except Exception:  # a sender that fails to answer is listed, not dropped
        return (req, facts, UNKNOWN, -1, False, False)


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
