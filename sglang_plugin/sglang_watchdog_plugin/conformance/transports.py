"""Fake transport libraries below SGLang's code: NIXL's agent and Mooncake's transfer engine.

SGLang's KV managers, transfer workers, senders and receivers run as they
are; only the library they call to move bytes is replaced, and the test
decides per room what a transfer does:

* ``COMPLETE``: done at once;
* ``HANG``: never done (NIXL: ``check_xfer_state`` answers "PROC" for ever;
  Mooncake: the synchronous batch call blocks until the fabric closes);
* ``slow(seconds)``: done after that long;
* ``FAIL``: the transport reports an error (NIXL "ERR", Mooncake -1);
* ``fail_after(seconds)``: the error comes after that long;
* ``raising(exception)``: Mooncake's synchronous call raises that exception
  instead of returning, as a library fault would (NIXL: a plain failure);
* a list of those: one per KV chunk of the room, in the order its worker
  posts them (the last one repeats).

A plan may target one prefill rank's transfers of the room only
(``plan(room, behaviour, rank=1)``): in a TP group every rank sends its own
share of the room into its own decode peer, and a wedge on one of them is
what the leader cannot see by itself. A transfer's rank is the one its
destination was tagged with (``claim(..., rank=)`` for Mooncake, which writes
to decode addresses; ``tag_agent(name, rank)`` for NIXL, whose transfers name
the decode agent they write to); untagged transfers have rank None and
follow the room's plan.

The room's metadata (aux) transfer completes at once once its KV was
posted; a room with no KV transfer (an aux-only chunk) follows the plan.

On top of that a link speed, in seconds per KV page, for every queue or per
transfer worker queue (``link_speed``), stretches every KV transfer that is
not hung by its page count (``chunk_pages``, told by the bench when it
splits a request into chunks): a link at 10% speed is ten times the seconds
per page of a healthy one. A decode destination's own speed
(``destination_speed``: keyed by the NIXL agent a transfer writes to, or the
Mooncake session it names) stands over its queue's, so destinations of
different speeds may share a queue; a change applies to the transfers
started after it, as a link that slows down or recovers.

The fabric records every transfer it was asked for (room, chunk kind,
start, end), which is how tests tell a chunk in flight from one settled.

The page ledger (``ledger``) adds what each KV transfer touches: the prefill
pages it reads and the decode pages it writes (told by the bench per chunk,
``chunk_indices``), and every time SGLang's release path hands a request's
pages back (the tree cache stand-ins call ``ledger.freed``), which posted
handles over those pages were still outstanding then: stuck (``HANG``) or
still moving. A free is a lever's when the plugin's order failed the room
(its failure record or the request's abort message carries the plugin's
reason), else SGLang's own.
"""

import itertools
import re
import threading
import time
import traceback
import types

from ..orders import DEFAULT_REASON
from .loader import install_module

COMPLETE = "complete"
HANG = "hang"
FAIL = "fail"


def slow(seconds):
    return ("slow", float(seconds))


def fail_after(seconds):
    return ("fail", float(seconds))


def raising(exception):
    return ("raise", exception)


class Transfer:
    """One transfer the fabric was asked for."""

    def __init__(self, room, notif, behaviour, link_seconds=0.0, rank=None, aux=False, reads=(), writes=()):
        self.room = room
        self.rank = rank  # the prefill rank whose share this is, where its destination was tagged
        self.notif = notif
        self.behaviour = behaviour
        self.link_seconds = link_seconds  # the page count times the link's seconds per page
        self.aux = aux
        self.reads = frozenset(reads)  # prefill pages of the room this KV transfer reads
        self.writes = frozenset(writes)  # (decode pool, page) this KV transfer writes
        self.started = time.monotonic()
        self.ended = None
        self.state = "PROC"

    def _plan(self):
        """(kind, seconds) of a transfer that is not hung."""
        behaviour = self.behaviour
        kind, seconds = behaviour if isinstance(behaviour, tuple) else (behaviour, 0.0)
        if kind == "raise":
            kind, seconds = FAIL, 0.0
        return kind, seconds

    def outstanding(self, now):
        """Whether the transfer still holds its pages at ``now``: hung, or not yet due, and not settled."""
        if self.ended is not None:
            return False
        if self.behaviour == HANG:
            return True
        return now - self.started < self._plan()[1] + self.link_seconds

    def settle(self, now):
        if self.ended is not None:
            return self.state
        if self.behaviour == HANG:
            return self.state
        kind, seconds = self._plan()
        if now - self.started >= seconds + self.link_seconds:
            self.state, self.ended = ("ERR" if kind in (FAIL, "fail") else "DONE"), now
            if self.state == "DONE":
                fabric.landed(self.room)
        return self.state


class Fabric:
    """What both fake libraries share in one process: the plan per room and the transfers made."""

    def __init__(self):
        self.lock = threading.Lock()
        self.plans = {}
        self.rank_plans = {}  # (room, rank) -> behaviour: one rank's share of a room, over the room's plan
        self.agent_ranks = {}  # NIXL decode agent name -> the rank whose share is written to it
        self.default = COMPLETE
        self.transfers = []
        self.closed = threading.Event()
        self.notifs = {}  # agent name -> [notification bytes]
        self.ranges = []  # (first byte, end, room, aux): decode memory each room's transfers write into
        self.pages = {}  # room -> KV pages of each chunk, in order
        self.posted = {}  # room -> KV chunk transfers started so far
        self.speeds = {}  # transfer queue (None: every queue) -> seconds per KV page
        self.destination_speeds = {}  # decode destination (NIXL agent, Mooncake session) -> seconds per KV page
        self.queue_of = lambda room: None  # set by the bench: the transfer queue a room's chunks go to
        self.landing = {}  # room -> fn(room), called when a transfer of the room is done (on_landed)
        self.indices = {}  # room or (room, rank) -> [(prefill pages read, decode pages written)] per KV chunk

    def plan(self, room, behaviour, rank=None):
        """What the room's transfers do; with ``rank``, only the transfers of that rank's share."""
        with self.lock:
            if rank is None:
                self.plans[int(room)] = behaviour
            else:
                self.rank_plans[(int(room), int(rank))] = behaviour

    def on_landed(self, room, fn):
        """Calls ``fn(room)`` from the thread that sees a transfer of the room done, before it tells anyone (a
        NIXL notification, Mooncake's return to SGLang's worker): what lands with the KV on real hardware, the
        metadata, is written there. ``fn`` may be called more than once."""
        with self.lock:
            self.landing[int(room)] = fn

    def landed(self, room):
        with self.lock:
            fn = self.landing.get(room)
        if fn is not None:
            fn(room)

    def tag_agent(self, name, rank):
        """NIXL: transfers into this (decode) agent are the share of that rank."""
        with self.lock:
            self.agent_ranks[name] = int(rank)

    def chunk_pages(self, room, pages):
        with self.lock:
            self.pages[int(room)] = list(pages)

    def chunk_indices(self, room, chunks, rank=None):
        """The pages each KV chunk of the room (of one rank's share) reads on prefill and writes on decode, in
        the order its worker posts them: [(prefill pages, decode (pool, page)s)]."""
        with self.lock:
            self.indices[int(room) if rank is None else (int(room), int(rank))] = list(chunks)

    def link_speed(self, seconds_per_page, queue=None):
        """Seconds per KV page for one transfer queue's transfers, or every queue's (None)."""
        with self.lock:
            if queue is None:
                self.speeds = {None: float(seconds_per_page)}
            else:
                self.speeds[int(queue)] = float(seconds_per_page)

    def destination_speed(self, destination, seconds_per_page):
        """Seconds per KV page for every transfer into this decode destination, over its queue's speed (None:
        back to the queue's)."""
        with self.lock:
            if seconds_per_page is None:
                self.destination_speeds.pop(destination, None)
            else:
                self.destination_speeds[destination] = float(seconds_per_page)

    def claim(self, room, start, length, aux=False, rank=None):
        """Decode memory that belongs to a room (and to one rank's share of it): a transfer writing there is theirs."""
        with self.lock:
            self.ranges.append((start, start + length, int(room), aux, rank))

    def room_at(self, address):
        """(room, whether it is the room's metadata slot) of a decode address, or (None, False)."""
        return self.owner_at(address)[:2]

    def owner_at(self, address):
        """(room, metadata slot?, rank) of a decode address, or (None, False, None)."""
        with self.lock:
            for start, end, room, aux, rank in reversed(self.ranges):
                if start <= address < end:
                    return room, aux, rank
        return None, False, None

    def start(self, room, notif=None, aux=False, rank=None, agent=None, destination=None):
        """A transfer of the room; ``destination``: the decode agent (NIXL) or session (Mooncake) it writes to."""
        queue = self.queue_of(room) if room is not None else None
        with self.lock:
            if rank is None and agent is not None:
                rank = self.agent_ranks.get(agent)
            behaviour, link_seconds = self.rank_plans.get((room, rank), self.plans.get(room, self.default)), 0.0
            reads = writes = ()
            if not aux:
                # Chunks are counted per rank: each rank's worker posts its own share of every chunk.
                key = room if rank is None else (room, rank)
                index = self.posted.get(key, 0)
                self.posted[key] = index + 1
                pages = self.pages.get(room, ())
                speed = self.destination_speeds.get(destination)
                if speed is None:
                    speed = self.speeds.get(queue, self.speeds.get(None, 0.0))
                link_seconds = speed * (pages[min(index, len(pages) - 1)] if pages else 0)
                chunks = self.indices.get(key, self.indices.get(room))
                if chunks:
                    reads, writes = chunks[min(index, len(chunks) - 1)]
                if isinstance(behaviour, list):
                    behaviour = behaviour[min(index, len(behaviour) - 1)]
            elif isinstance(behaviour, list) or self.posted.get(room if rank is None else (room, rank)):
                # A chunk's time is its KV's: Mooncake posts the aux after the KV on the same worker, which
                # would count a slow plan twice. Only an aux-only transfer (no KV posted) follows the plan.
                behaviour = COMPLETE
            transfer = Transfer(room, notif, behaviour, link_seconds, rank, aux, reads, writes)
            self.transfers.append(transfer)
            return transfer

    def of_room(self, room):
        with self.lock:
            return [t for t in self.transfers if t.room == room]

    def in_flight(self, room):
        now = time.monotonic()
        return [t for t in self.of_room(room) if t.settle(now) == "PROC"]

    def deliver(self, agent, notif):
        with self.lock:
            self.notifs.setdefault(agent, []).append(notif)

    def take_notifs(self, agent):
        with self.lock:
            return self.notifs.pop(agent, [])

    def end_hangs(self, rooms, behaviour=FAIL):
        """Ends the hung transfers of these rooms (failed, or as ``behaviour`` says), so the workers they hold
        move on: a test's clean-up, or a wedge that clears. Mooncake takes a failed transfer for a dead peer
        and fails every later room bound to the same session, so a wedge that clears completes instead."""
        rooms = set(rooms)
        with self.lock:
            for room in rooms:
                if self.plans.get(room) == HANG:
                    self.plans[room] = behaviour  # the room's transfers still to come (its aux) too
            for key, plan in self.rank_plans.items():
                if key[0] in rooms and plan == HANG:
                    self.rank_plans[key] = behaviour
            for transfer in self.transfers:
                if transfer.room in rooms and transfer.behaviour == HANG:
                    transfer.behaviour = behaviour

    def close(self):
        """Lets every blocked Mooncake call return (failed), so threads can end."""
        self.closed.set()


fabric = Fabric()


class Free:
    """One hand-back of a request's pages by SGLang's release path, and the KV handles over them at that moment.

    ``live``: pages under a handle still moving (not due yet); ``stuck``: pages
    under a hung one only.
    """

    def __init__(self, side, room, rid, backend, req, pages, live, stuck, moving, ordered):
        self.side, self.room, self.rid, self.backend, self.req = side, room, rid, backend, req
        self.pages, self.live, self.stuck = pages, live, stuck
        self.moving = moving  # the plans of the moving handles, as they were (a heal later ends hung ones)
        self.ordered = ordered  # the plugin's order had failed the room (its failure record) by then

    @property
    def by_lever(self):
        """The plugin's order released the request; else SGLang's own failure, abort or success did. Where a
        backend keeps no failure records, the plugin's reason is in the abort message SGLang set."""
        if self.ordered:
            return True
        reason = getattr(self.req, "finished_reason", None)
        return DEFAULT_REASON in str(getattr(reason, "message", "") or "")

    def describe(self):
        return (f"{self.side} room {self.room} ({self.rid}): {len(self.live)} of its {len(self.pages)} pages under "
                f"{len(self.moving)} moving handle(s) ({', '.join(sorted(set(self.moving)))})")


class Ledger:
    """The pages each request owns on each side, and every free of them by SGLang's release path.

    Prefill pages are the request's own KV pages, numbered within it (the
    bench gives each request its own prefill KV: no prefill page is shared or
    reused). Decode pages are (decode pool, page), the pages the receiver gave
    prefill; the decode bench reuses them when SGLang reuses the metadata slot,
    and a reuse while a handle still writes them is recorded (``reused``).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.pages = {}  # (side, room, rank) -> the request's pages on that side
        self.frees = []
        self.reused = []  # (room, the earlier room whose handle still wrote its new pages, hung?) per request
        self.ordered = set()  # rooms the plugin's order failed (seen in the manager's failure record)
        self._freed_decode = {}  # decode (pool, page) -> the room whose free handed it back last

    def owns(self, side, room, pages, rank=None):
        """The request's pages on one side (a link's); on decode, a reuse under a handle still writing is noted."""
        pages = frozenset(pages)
        now = time.monotonic()
        with self.lock:
            self.pages[(side, int(room), rank)] = pages
            earlier = {self._freed_decode.pop(page) for page in pages if page in self._freed_decode} \
                if side == "decode" else set()
        for other in earlier - {int(room)}:
            for t in fabric.of_room(other):
                if not t.aux and t.writes & pages and t.outstanding(now):
                    with self.lock:
                        self.reused.append((int(room), other, t.behaviour == HANG))
                    break

    def order_seen(self, room):
        with self.lock:
            self.ordered.add(int(room))

    def order_refused(self, room):
        with self.lock:
            self.ordered.discard(int(room))

    def freed(self, side, req, backend=None, rank=None):
        """SGLang's release path handed the request's pages back (``cache_finished_req``), on this side/rank."""
        room = getattr(req, "bootstrap_room", None)
        if room is None:
            return
        room = int(room)
        with self.lock:
            pages = self.pages.get((side, room, rank)) or self.pages.get((side, room, None))
            ordered = room in self.ordered
        if not pages:  # a request with no link here (a health check on a fake sender): no transfer reads it
            return
        now = time.monotonic()
        live, stuck, moving = set(), set(), []
        for t in fabric.of_room(room):
            if t.aux or (rank is not None and t.rank not in (None, rank)) or not t.outstanding(now):
                continue
            over = pages & (t.reads if side == "prefill" else t.writes)
            if over:
                if t.behaviour == HANG:
                    stuck.update(over)
                else:
                    live.update(over)
                    moving.append(_plan_words(t))
        free = Free(side, room, getattr(req, "rid", None), backend, req, pages, live, stuck - live, moving, ordered)
        with self.lock:
            self.frees.append(free)
            if side == "decode":
                self._freed_decode.update((page, room) for page in pages)

    def mark(self):
        with self.lock:
            return len(self.frees), len(self.reused)

    def since(self, mark):
        """(frees, reuses) since a mark."""
        with self.lock:
            return self.frees[mark[0]:], self.reused[mark[1]:]


def _plan_words(transfer):
    kind, seconds = transfer._plan()
    link = f" + link {transfer.link_seconds:g}s" if transfer.link_seconds else ""
    return f"{kind} {seconds:g}s{link}"


def ledger_counts(frees, reused=()):
    """Pages freed under outstanding handles, per side: by a lever under a live / a stuck handle, by SGLang."""
    counts, zero = {}, {"lever_live": 0, "lever_stuck": 0, "stock": 0, "frees": 0}
    for free in frees:
        c = counts.setdefault(free.side, dict(zero))
        c["frees"] += 1
        if free.by_lever:
            c["lever_live"] += len(free.live)
            c["lever_stuck"] += len(free.stuck)
        else:
            c["stock"] += len(free.live) + len(free.stuck)
    if reused:
        counts.setdefault("decode", dict(zero))["reused"] = len(reused)
    return counts


def describe_counts(counts):
    """The counts in words, one clause per side."""
    def clause(side, c):
        reused = f", {c['reused']} requests given pages a handle still wrote" if "reused" in c else ""
        return (f"{side} pages freed under a live handle by a lever {c['lever_live']}, under a stuck handle by a "
                f"lever (the remedy) {c['lever_stuck']}, under an outstanding handle by SGLang itself {c['stock']} "
                f"({c['frees']} frees in all{reused})")

    return "; ".join(clause(side, c) for side, c in sorted(counts.items())) or "no frees"


ledger = Ledger()

_ROOM = re.compile(rb"^(\d+)")


def _room_of(notif):
    if notif is None:
        return None
    if isinstance(notif, str):
        notif = notif.encode()
    match = _ROOM.match(bytes(notif))
    return int(match.group(1)) if match else None


# NIXL ---------------------------------------------------------------------

class NixlError(Exception):
    pass


class _Descs:
    def __init__(self, items=()):
        self.items = list(items)

    def __len__(self):
        return len(self.items)

    def trim(self):
        return self


class _Handle:
    _ids = itertools.count(1)

    def __init__(self, transfer, remote):
        self.id = next(self._ids)
        self.transfer = transfer
        self.remote = remote
        self.notified = False


class NixlAgent:
    """The subset of ``nixl._api.nixl_agent`` SGLang's NIXL backend calls, over the fabric."""

    def __init__(self, name, config=None, *args, **kwargs):
        self.name = name
        self.backends = []

    def create_backend(self, name, params=None):
        self.backends.append(name)

    def get_plugin_list(self):
        return ["UCX", "LIBFABRIC", "GDS", "GDS_MT", "OBJ", "UCCL", "MOONCAKE"]

    def register_memory(self, addrs, mem_type=None, *args, **kwargs):
        return _Descs(addrs if isinstance(addrs, (list, tuple)) else [addrs])

    def deregister_memory(self, *args, **kwargs):
        pass

    def get_reg_descs(self, addrs, mem_type=None, *args, **kwargs):
        return _Descs(addrs)

    def get_xfer_descs(self, addrs, mem_type=None, *args, **kwargs):
        return _Descs(addrs if isinstance(addrs, (list, tuple)) else [addrs])

    def prep_xfer_dlist(self, agent_name, descs, mem_type=None, *args, **kwargs):
        return ("prepped", agent_name)

    def get_agent_metadata(self):
        return self.name.encode() if isinstance(self.name, str) else bytes(self.name)

    def add_remote_agent(self, metadata):
        return bytes(metadata).decode() if not isinstance(metadata, str) else metadata

    def remove_remote_agent(self, name):
        pass

    def _xfer(self, remote, notif):
        aux = notif is not None and b"_aux" in (notif.encode() if isinstance(notif, str) else bytes(notif))
        return _Handle(fabric.start(_room_of(notif), notif, aux, agent=remote, destination=remote), remote)

    def initialize_xfer(self, op, local, remote_descs, remote_agent, notif=b"", *args, **kwargs):
        return self._xfer(remote_agent, notif)

    def make_prepped_xfer(self, op, local_side, local_idx, remote_side, remote_idx, notif=b"", *args, **kwargs):
        remote = remote_side[1] if isinstance(remote_side, tuple) else remote_side
        return self._xfer(remote, notif)

    def transfer(self, handle, notif=None, *args, **kwargs):
        state = handle.transfer.settle(time.monotonic())
        return "ERR" if state == "ERR" else "PROC" if state == "PROC" else "DONE"

    def check_xfer_state(self, handle):
        state = handle.transfer.settle(time.monotonic())
        if state == "PROC":
            time.sleep(0.001)  # SGLang's worker spins on this call; a real one takes time too
        elif state == "DONE" and not handle.notified and handle.transfer.notif:
            handle.notified = True
            fabric.deliver(handle.remote, bytes(handle.transfer.notif) if not isinstance(
                handle.transfer.notif, str) else handle.transfer.notif.encode())
        return state

    def release_xfer_handle(self, handle):
        pass

    def release_dlist_handle(self, handle):
        pass

    def send_notif(self, remote_agent, msg):
        fabric.deliver(remote_agent, msg if isinstance(msg, bytes) else str(msg).encode())

    def get_new_notifs(self):
        notifs = fabric.take_notifs(self.name)
        return {"peer": notifs} if notifs else {}

    def query_xfer_backend(self, handle):
        return "UCX"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _nixl_modules():
    nixl = types.ModuleType("nixl")
    nixl.__path__ = []
    api = types.ModuleType("nixl._api")
    api.nixl_agent = NixlAgent
    api.nixl_agent_config = lambda *args, **kwargs: types.SimpleNamespace(args=args, kwargs=kwargs)
    api.nixl_thread_sync_t = types.SimpleNamespace(NIXL_THREAD_SYNC_STRICT="strict", NIXL_THREAD_SYNC_NONE="none")
    bindings = types.ModuleType("nixl._bindings")
    for name in ("nixlBackendError", "nixlCancelledError", "nixlRemoteDisconnectError", "nixlNotFoundError",
                 "nixlInvalidParamError"):
        setattr(bindings, name, type(name, (NixlError,), {}))
    nixl._api, nixl._bindings = api, bindings
    return {"nixl": nixl, "nixl._api": api, "nixl._bindings": bindings}


# Mooncake -----------------------------------------------------------------

class MooncakeEngine:
    """``mooncake.engine.TransferEngine``: synchronous transfers, so a hang blocks the calling worker."""

    _ports = itertools.count(17000)

    def __init__(self, *args, **kwargs):
        self.port = next(self._ports)

    def initialize(self, *args, **kwargs):
        return 0

    def initialize_ext(self, *args, **kwargs):
        return 0

    def get_rpc_port(self):
        return self.port

    def register_memory(self, *args, **kwargs):
        return 0

    def unregister_memory(self, *args, **kwargs):
        return 0

    def batch_register_memory(self, *args, **kwargs):
        return 0

    def batch_unregister_memory(self, *args, **kwargs):
        return 0

    def _sync(self, session, address):
        try:
            room, aux, rank = fabric.owner_at(address)
            transfer = fabric.start(room, aux=aux, rank=rank, destination=session)
        except Exception:
            # SGLang's engine wrapper takes any exception for a failed transfer (-1) and says nothing: a fault
            # of this fake must not pass for the room's plan.
            traceback.print_exc()
            raise
        if isinstance(transfer.behaviour, tuple) and transfer.behaviour[0] == "raise":
            transfer.state, transfer.ended = "ERR", time.monotonic()
            raise transfer.behaviour[1]
        while True:
            now = time.monotonic()
            state = transfer.settle(now)
            if state == "DONE":
                return 0
            if state == "ERR":
                return -1
            if fabric.closed.wait(0.01):
                transfer.state, transfer.ended = "ERR", now
                return -1

    def transfer_sync_write(self, session, src, dst, length, *args, **kwargs):
        return self._sync(session, int(dst))

    def batch_transfer_sync_write(self, session, srcs, dsts, lengths, *args, **kwargs):
        return self._sync(session, int(dsts[0]) if len(dsts) else -1)

    transfer_sync_read = transfer_sync_write
    batch_transfer_sync_read = batch_transfer_sync_write

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: 0


class AscendEngine(MooncakeEngine):
    """The Ascend transfer engine (``memfabric_hybrid.TransferEngine``, ``mf_adapter`` before v0.5.10), which
    SGLang's Ascend backend drives through its Mooncake engine wrapper (``AscendTransferEngine``): the same
    synchronous calls, so the same fake."""

    TransDataOpType = types.SimpleNamespace(SDMA="SDMA", DEVICE_RDMA="DEVICE_RDMA")


def _ascend_modules():
    modules = {}
    for name in ("memfabric_hybrid", "mf_adapter"):
        module = types.ModuleType(name)
        module.TransferEngine = AscendEngine
        modules[name] = module
    return modules


def _mooncake_modules():
    mooncake = types.ModuleType("mooncake")
    mooncake.__path__ = []
    engine = types.ModuleType("mooncake.engine")
    engine.TransferEngine = MooncakeEngine
    mooncake.engine = engine
    return {"mooncake": mooncake, "mooncake.engine": engine}


def install():
    """Puts the fake NIXL, Mooncake and Ascend libraries in place of any real ones, in this process."""
    for modules in (_nixl_modules(), _mooncake_modules(), _ascend_modules()):
        for name, module in modules.items():
            install_module(name, module)
