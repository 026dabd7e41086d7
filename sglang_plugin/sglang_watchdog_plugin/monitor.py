"""Per-scheduler state: loop counter, inflight rooms, pending orders.

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
import signal
import threading
import time
from typing import NamedTuple

from . import capabilities, peers, process_tree, transfer_watch
from .identity import sglang_version
from .observe import UNKNOWN, observe, outstanding_chunks, poll_name
from .orders import (
    ForceFailOrder,
    Outcome,
    apply_order,
    health_check,
    internal_error,
    is_health_check,
    not_found,
    room_mismatch,
    too_many_orders,
    unresponsive,
    unsupported,
)
from .wedge import WedgeOrders, would_fail

logger = logging.getLogger("sglang_watchdog_plugin")

API_VERSION = 1
ORDER_TIMEOUT_S = 5.0
MAX_PENDING_ORDERS = 64
REOBSERVE_INTERVAL_S = 0.1
# Rooms remembered after they left the queue with chunks outstanding; a
# wedged worker holds a few, so this bound only stops a leak from growing.
MAX_ORPHANS = 1024
_NO_SENDER_YET = "no KV sender of this backend has been seen yet; the levers are worked out from the first one"
_ERROR_LOG_INTERVAL_S = 60.0


class RequestFacts(NamedTuple):
    """What does not change while a request sits in the inflight queue."""

    rid: str
    bootstrap_room: int
    bootstrap_addr: str
    prompt_tokens: int
    entry_perf: float
    health_check: bool
    transfer_queue: int | None


class Snapshot(NamedTuple):
    """What the HTTP threads may read.

    ``rooms`` maps id(req) to a room, the plain tuple
    ``(req, RequestFacts, poll, progress, send_failed, transfer_in_flight)``: plain because the
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
    orphans: tuple  # (bootstrap_room, transfer_queue, outstanding_chunks) of rooms gone from the queue


_EMPTY = Snapshot(members=(), rooms={}, inflight=0, bootstrap=0, waiting=0, orphans=())


class Monitor:
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

    # -- HTTP threads -----------------------------------------------------

    def listing(self):
        snapshot = self.snapshot
        now = time.perf_counter()
        ident = self.identity
        caps = self.capabilities
        server = {
            "pid": os.getpid(),
            "dp_rank": ident.dp_rank,
            "pp_rank": ident.pp_rank,
            "tp_rank": ident.tp_rank,
            "disaggregation_mode": ident.mode,
            "transfer_backend": ident.backend,
            "sglang_version": sglang_version(),
            "levers": list(caps.levers) if caps is not None else [],
            "lever_note": caps.note if caps is not None else self.no_lever_yet,
            "pp_size": ident.pp_size,
            "transfer_queues": self.transfer_queues,
        }
        peer_view = self._peer_view()
        server.update(self._server_extras(peer_view))
        body = {
            "api_version": API_VERSION,
            "server": server,
            "now_unix": time.time(),
            "loop": {"iterations": self.iterations, "last_iteration_unix": self.last_iteration_unix},
        }
        body.update(self._queues_json(snapshot, now, peer_view))
        return body

    def _peer_view(self):
        """(ranks of the group watched, this one included; the other ranks' View), read once per listing."""
        own = 1 if self.transfer_tracking else 0
        view = peers.View(0, {}, {}, []) if self.peers is None else self.peers.read(queues=self.transfer_queues)
        return own + view.watched, view

    def _sent_elsewhere(self, room):
        """(whether another rank of the group still has a share of this room to send, in flight or waiting in
        its worker queues; the other ranks not watched now), from their files, read now.

        A room done on this rank is not done on the group: SGLang's pass MIN-reduces
        the polls over the group, so its Success branch waits for every rank.
        """
        if self.peers is None:
            return False, []
        return self.peers.sending(room)

    def _server_extras(self, peer_view):
        """The listing's server fields of this mode alone, after the shared ones."""
        return {"transfer_tracking": self.transfer_tracking, "transfer_progress": self.transfer_progress,
                "transfer_ranks": self.peers.size if self.peers is not None else 1,
                "transfer_ranks_watched": peer_view[0]}

    def _queues_json(self, snapshot, now, peer_view):
        """The listing's queue counts and rows, after the server and loop fields."""
        workers = self.workers
        # Counted here, not at each pass: only a listing needs it.
        queued = transfer_watch.queued_by_room(workers) if workers is not None else None
        monotonic = time.monotonic()
        others = peer_view[1]
        elsewhere = others.in_flight
        rows = [_room_json(room, now, queued, others) for room in _listed(snapshot)]
        listed = {row["bootstrap_room"] for row in rows}
        orphans = {room: (queue, count) for room, queue, count in snapshot.orphans}
        for room, count in elsewhere.items():
            # Another rank still sends for a room this one no longer lists: an orphan of the group.
            if room not in listed:
                queue, own = orphans.get(room, (None, 0))
                orphans[room] = (queue, own + count)
        body = {
            "queues": {"bootstrap": snapshot.bootstrap, "waiting": snapshot.waiting, "inflight": snapshot.inflight},
            "inflight": rows,
            "orphaned_transfers": [
                {"bootstrap_room": room, "transfer_queue": queue, "outstanding_chunks": count}
                for room, (queue, count) in orphans.items()
            ],
            "transfer_workers": None if workers is None else [
                transfer_watch.worker_json(index, queue, monotonic) for index, queue in enumerate(workers)],
            "wedge_orders": self.wedges.listing(workers) if workers is not None else [],
        }
        if others.workers:  # round 5, absent without peers: the listing of one rank is as before
            body["peer_transfer_workers"] = others.workers
        return body

    def force_fail(self, rid, bootstrap_room, reason, dry_run, prefill_stopped=False):
        """Answers fast from the latest snapshot where it can, else waits for the scheduler thread."""
        known = self._known_facts(rid)
        if known is None:
            return not_found(rid, self.where)
        if bootstrap_room is not None and bootstrap_room != known.bootstrap_room:
            return room_mismatch(rid, known.bootstrap_room, self.where)
        if known.health_check:
            return health_check(rid, known.bootstrap_room)
        caps = self.capabilities
        if caps is not None and not caps.levers:
            return unsupported(rid, caps.note)
        order = ForceFailOrder(rid, bootstrap_room, reason, dry_run, prefill_stopped)
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

    def wedge_order(self, transfer_queue, chunk, ttl, min_age, reason, dry_run):
        """POST /admin/wedge_order, on the HTTP thread: wedge.py holds the orders, the scheduler thread applies them."""
        workers = self.workers
        if workers is None:
            return _no_wedge_orders(f"this SGLang's {self.identity.backend} KV manager has no transfer worker "
                                    "queues that the plugin watches (transfer_progress is false)")
        caps = self.capabilities
        if caps is not None and not caps.levers:
            return _no_wedge_orders(f"no lever releases a request on this SGLang version and backend: {caps.note}",
                                    caps.note)
        if transfer_queue >= len(workers):
            return Outcome(404, {"result": "not_found", "failed": [],
                                 "error": f"no transfer queue {transfer_queue}: this KV manager has {len(workers)}"})
        levers = caps.levers if caps is not None else ()
        return self.wedges.order(
            workers, transfer_queue, chunk, ttl, min_age, reason, dry_run,
            lambda: would_fail(_listed(self.snapshot), transfer_queue, min_age, levers, time.perf_counter()))

    def _known_facts(self, rid):
        """The facts of the latest observation of this rid (rid, bootstrap_room, health_check), or None."""
        return next((facts for _, facts, *_ in _listed(self.snapshot) if facts.rid == rid), None)

    def restart_target(self):
        """SGLang's launcher to signal (process_tree.serving_top), refused if this process was re-parented."""
        target = self.find_restart_target()
        if target.ok and len(target.chain) > 1 and target.chain[1] != self.parent_pid:
            return process_tree.Target(None, None, "", target.chain,
                                       f"this process's parent changed since load (was pid {self.parent_pid}, now "
                                       f"pid {target.chain[1]}): SGLang's launcher is gone")
        return target

    def restart(self, pid, dry_run):
        """Decides a restart order (the HTTP handler sends the answer, then calls end_process)."""
        me = os.getpid()
        if pid != me:
            return Outcome(409, {"result": "pid_mismatch", "pid": me,
                                 "error": f"pid {pid} is not this process (pid {me}); it may have restarted already"})
        target = self.restart_target()
        if not target.ok:
            return Outcome(501, {"result": "restart_unsupported", "pid": me, "signal_target": target.json(),
                                 "error": f"a restart would not end SGLang's server: {target.reason}"})
        self._restart_target = target
        if dry_run:
            return Outcome(200, {"result": "would_restart", "pid": me, "signal_target": target.json()})
        return Outcome(202, {"result": "restarting", "pid": me, "signal_target": target.json()})

    def end_process(self, reason):
        """Ends SGLang's server on this node as its own child-failure path does, then this process.

        SIGQUIT to SGLang's launcher (the top of the tree: the HTTP server and
        tokenizer manager, found by restart_target; under DP the scheduler's
        parent is the DataParallelController, which has no SIGQUIT handler),
        whose handler kills the whole process tree; then exit status 1
        (os._exit: this runs on a listener thread) so that the orchestrator
        restarts the server.
        """
        target = getattr(self, "_restart_target", None)
        if target is None or not target.ok:
            target = self.restart_target()
        logger.error("sglang-watchdog plugin ends SGLang's server on request: %s (%s to pid %s, the top of its "
                     "process tree, then exit status 1)", reason or "no reason given",
                     signal.Signals(target.signal).name if target.ok else "no signal", target.pid)
        try:
            if target.ok and target.pid != os.getpid():
                self.kill(target.pid, target.signal)
        except OSError as e:
            logger.error("cannot signal process %d: %s", target.pid, e)
        finally:
            self.exit(1)

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


def _no_wedge_orders(error, lever_note=None):
    body = {"result": "unsupported", "failed": [], "error": f"no wedge order can stand here: {error}"}
    if lever_note:
        body["lever_note"] = lever_note
    return Outcome(501, body)


def _room_json(room, now, queued, others):
    _, facts, poll, progress, send_failed, in_flight = room
    in_flight = in_flight or others.in_flight.get(facts.bootstrap_room, 0) > 0
    row = {
        "rid": facts.rid,
        "bootstrap_room": facts.bootstrap_room,
        "bootstrap_addr": facts.bootstrap_addr,
        "poll": poll_name(poll),
        "age_seconds": round(max(0.0, now - facts.entry_perf), 3),
        "prompt_tokens": facts.prompt_tokens,
        "progress": progress,
        "send_failed": send_failed,
        "health_check": facts.health_check,
        "transfer_in_flight": in_flight,
        "transfer_queue": facts.transfer_queue,
        "chunks_queued": None if queued is None else queued.get(facts.bootstrap_room, 0),
    }
    if others.watched:  # round 5, absent without peers
        row["peer_chunks_queued"] = others.queued.get(facts.bootstrap_room, 0)
    return row
