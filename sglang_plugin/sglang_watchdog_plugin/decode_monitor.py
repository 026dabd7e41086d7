"""Per-scheduler state of a decode scheduler: loop counter, the two decode queues, pending orders.

The threading model is the prefill Monitor's (monitor.py): only the
scheduler thread, inside the hooked ``process_decode_queue`` (under SGLang's
PP decode loop: the pass made of ``process_prealloc_queue`` and
``process_decode_transfer_queue``, hook.py), reads SGLang objects or changes
them; it publishes a DecodeSnapshot by swapping one attribute, which the
HTTP threads read.

Cost model, per pass: a counter bump and two length checks when nothing
changed. Between passes SGLang only appends to the prealloc queue (the PP
loop's stage consensus between its passes only polls receivers); inside
the pass requests only leave the prealloc queue (for the transfer queue, or
failed) and leave the transfer queue. So while both lengths are unchanged,
so is the membership (the pass rebuilds both lists every polling pass, so
their identity says nothing). When a length changed, the snapshot copies
the two lists (tuples) and describes only requests appended since the last
publication; inside the pass there is nothing new to describe. Every room's
poll and progress are re-read every REOBSERVE_INTERVAL_S and right after an
order was handled, which also lets go of requests that left.
"""

import time
from typing import NamedTuple

from . import kv_threads
from .decode_capabilities import abort_frame_problem, detect, pass_problem
from .decode_observe import (
    _UNKNOWN_VIEW,
    PREALLOC,
    TRANSFER,
    WHERE,
    backend_receiver,
    observe_receiver,
    queues,
    receiver_class,
    request_room,
    waiting_for_memory,
)
from .decode_orders import apply_order
from .decode_release import deferred_release
from .monitor import _NO_SENDER_YET, Monitor, logger
from .observe import poll_name
from .orders import is_health_check

_NO_RECEIVER_YET = _NO_SENDER_YET.replace("KV sender", "KV receiver")


class DecodeFacts(NamedTuple):
    """What does not change while a request sits in the decode queues."""

    rid: str
    bootstrap_room: int
    bootstrap_addr: str
    first_seen: float  # perf_counter
    health_check: bool


class DecodeSnapshot(NamedTuple):
    """What the HTTP threads may read.

    ``prealloc_members`` and ``transfer_members`` are the queued
    DecodeRequests of each queue, in queue order; ``rooms`` maps
    id(decode_req) to the plain tuple ``(decode_req, DecodeFacts,
    ReceiverView)``. As on prefill, the scheduler thread only adds to that
    dict until it replaces it, and holding the DecodeRequest keeps its id()
    from being reused while it is known.
    """

    prealloc_members: tuple
    transfer_members: tuple
    rooms: dict


_EMPTY = DecodeSnapshot(prealloc_members=(), transfer_members=(), rooms={})


class DecodeMonitor(Monitor):
    mode = "decode"
    where = WHERE
    no_lever_yet = _NO_RECEIVER_YET

    def __init__(self, identity):
        super().__init__(identity)
        self.snapshot = _EMPTY
        self.deferred_release = None
        self._deferred = {}  # id(decode_req) -> decode_req registered as a deferred abort by the plugin
        self._known_prealloc = 0
        self._known_transfer = 0
        self._last_prealloc = None  # the prealloc list at the last publication
        self._total_before_pass = 0
        # The hooked pass that is open now (hook.py), so that a loop running both
        # process_decode_queue and the PP passes counts one pass, not two.
        self.pass_owner = None

    def configure(self, scheduler, pass_fn):
        """Scheduler thread, at load: works out the decode lever from the code of this SGLang."""
        try:
            self._pass_problem = pass_problem(scheduler)
            receiver_cls = receiver_class(scheduler, self.identity.backend)
            if receiver_cls is not None:
                self._resolve_receiver(receiver_cls)
            manager = getattr(getattr(scheduler, "disagg_decode_prealloc_queue", None), "kv_manager", None)
            self.deferred_release = deferred_release(manager)
            if manager is not None:
                self.kv_threads = kv_threads.find(manager)
                if receiver_cls is not None:
                    # Read the ABORT frame's two sides from the code now, not on the scheduler thread's first order.
                    abort_frame_problem(receiver_cls, type(manager))
        except Exception as e:
            self._cannot_inspect(e, "decode lever")
        logger.info(
            "sglang-watchdog plugin levers on this SGLang (decode): %s%s; deferred decode KV release: %s",
            *self._lever_summary(),
            {True: "on", False: "off", None: "not in this release"}[self.deferred_release],
        )

    def capabilities_for(self, receiver):
        cls = type(receiver)
        caps = self._by_class.get(cls)
        if caps is None:
            caps = self._by_class[cls] = detect(cls, self._pass_problem)
        return caps

    def _resolve_receiver(self, receiver_cls):
        self.capabilities = self._by_class[receiver_cls] = detect(receiver_cls, self._pass_problem)

    # -- scheduler thread -------------------------------------------------

    def before_pass(self, scheduler):
        try:
            self.iterations += 1
            self.last_iteration_unix = time.time()
            if self._orders:
                self._handle_orders(lambda order: apply_order(order, scheduler, self.capabilities_for,
                                                                     self._note_deferred, self.identity.pp_size),
                                    "decode force-fail order")
            prealloc, transfer = queues(scheduler)
            self._total_before_pass = len(prealloc) + len(transfer)
            if len(prealloc) != self._known_prealloc or len(transfer) != self._known_transfer:
                self._publish(prealloc, transfer, time.perf_counter(), newcomers=True)
        except Exception:
            self._log_error("before the decode queue pass")

    def after_pass(self, scheduler):
        try:
            now = time.perf_counter()
            prealloc, transfer = queues(scheduler)
            if self._handled_order or now >= self._next_reobserve:
                self._reobserve_all(prealloc, transfer, now)
                self._publish(prealloc, transfer, now, newcomers=False)
            elif len(prealloc) != self._known_prealloc or len(transfer) != self._known_transfer:
                # Inside the pass requests only move on or leave: nothing new to describe.
                self._publish(prealloc, transfer, now, newcomers=len(prealloc) + len(transfer) > self._total_before_pass)
        except Exception:
            self._log_error("after the decode queue pass")

    def _note_deferred(self, decode_req, registered):
        if registered:
            self._deferred[id(decode_req)] = decode_req
        return self._deferred.get(id(decode_req)) is decode_req

    def _publish(self, prealloc, transfer, now, newcomers):
        if newcomers:
            rooms = self._rooms
            for decode_req in self._newcomers(prealloc, transfer):
                facts = self._describe(decode_req, now)
                if facts is not None:  # unnamed requests cannot be listed nor targeted
                    rooms[id(decode_req)] = self._observed(decode_req, facts, None)
                    if self.capabilities is None:
                        self._resolve_from(decode_req)
        self._last_prealloc = prealloc
        self._known_prealloc = len(prealloc)
        self._known_transfer = len(transfer)
        self.snapshot = DecodeSnapshot(tuple(prealloc), tuple(transfer), self._rooms)

    def _newcomers(self, prealloc, transfer):
        rooms = self._rooms
        if prealloc is self._last_prealloc and len(prealloc) >= self._known_prealloc and \
                len(transfer) == self._known_transfer:
            return [d for d in prealloc[self._known_prealloc:] if id(d) not in rooms]  # appended between passes
        return [d for queue in (prealloc, transfer) for d in queue if id(d) not in rooms]

    def _reobserve_all(self, prealloc, transfer, now):
        known = self._rooms
        rooms = {}
        for queue in (prealloc, transfer):
            for decode_req in queue:
                room = known.get(id(decode_req))
                if room is None:
                    facts = self._describe(decode_req, now)
                    if facts is None:
                        continue
                    room = self._observed(decode_req, facts, None)
                    if self.capabilities is None:
                        self._resolve_from(decode_req)
                else:
                    room = self._observed(decode_req, room[1], room[2])
                rooms[id(decode_req)] = room
        # A fresh dict: released requests are let go, and readers of the
        # previous snapshot keep a dict that no longer changes.
        self._rooms = rooms
        for gone in self._deferred.keys() - rooms.keys():
            del self._deferred[gone]
        self._handled_order = False
        self._next_reobserve = now + self._reobserve_interval

    def _resolve_from(self, decode_req):
        found = backend_receiver(getattr(decode_req, "kv_receiver", None), self.identity.backend)
        if found is not None:
            self._resolve_receiver(found)

    def _describe(self, decode_req, now):
        req = getattr(decode_req, "req", None)
        rid = getattr(req, "rid", None)
        room = request_room(req)
        if not isinstance(rid, str) or not isinstance(room, int) or isinstance(room, bool):
            return None
        host = getattr(req, "bootstrap_host", None)
        addr = getattr(getattr(decode_req, "kv_receiver", None), "bootstrap_addr", None)
        if not isinstance(addr, str) or not addr:
            port = getattr(req, "bootstrap_port", None)
            addr = "" if host is None else str(host) if port is None else f"{host}:{port}"
        return DecodeFacts(rid=rid, bootstrap_room=room, bootstrap_addr=addr, first_seen=now,
                           health_check=is_health_check(rid, room, host))

    @staticmethod
    def _observed(decode_req, facts, previous):
        try:
            view = observe_receiver(getattr(decode_req, "kv_receiver", None), facts.bootstrap_room)
        except Exception:  # a receiver that fails to answer is listed, not dropped
            view = _UNKNOWN_VIEW
        if previous is not None and previous.progress > view.progress:
            view = view._replace(progress=previous.progress)  # progress never decreases
        return (decode_req, facts, view._replace(waiting_for_memory=waiting_for_memory(decode_req, view)))

    # -- HTTP threads -----------------------------------------------------

    def _known_facts(self, rid):
        return next((facts for _, facts, _, _ in _listed(self.snapshot) if facts.rid == rid), None)

    def _peer_view(self):
        return None  # decode sends nothing: no transfer of its own to count

    def _server_extras(self, peer_view):
        return {"deferred_release": self.deferred_release}

    def _queues_json(self, snapshot, now, peer_view):
        return {
            "queues": {"bootstrap": 0, "waiting": 0, "inflight": 0,
                       "prealloc": len(snapshot.prealloc_members), "transfer": len(snapshot.transfer_members)},
            # Empty on decode, so that a watchdog predating decode listings finds nothing to act on.
            "inflight": [],
            "orphaned_transfers": [],
            "decode_requests": [_row(facts, view, queue, now) for _, facts, view, queue in _listed(snapshot)],
            "transfer_workers": None,
            "wedge_orders": [],
        }


def _listed(snapshot):
    """(decode_req, facts, view, queue name) of the snapshot's requests, prealloc queue first, in queue order."""
    rooms = snapshot.rooms
    for queue, members in ((PREALLOC, snapshot.prealloc_members), (TRANSFER, snapshot.transfer_members)):
        for decode_req in members:
            room = rooms.get(id(decode_req))
            if room is not None:
                yield room + (queue,)


def _row(facts, view, queue, now):
    return {
        "rid": facts.rid,
        "bootstrap_room": facts.bootstrap_room,
        "bootstrap_addr": facts.bootstrap_addr,
        "queue": queue,
        "poll": poll_name(view.poll),
        "age_seconds": round(max(0.0, now - facts.first_seen), 3),
        "progress": view.progress,
        "chunks_expected": view.chunks_expected,
        "transfer_started": view.transfer_started,
        "health_check": facts.health_check,
        # Only the prealloc queue waits for memory; SGLang leaves the flag set in the transfer queue.
        "waiting_for_memory": queue == PREALLOC and view.waiting_for_memory,
        "prefill_rank_addrs": None if view.prefill_rank_addrs is None else list(view.prefill_rank_addrs),
    }
