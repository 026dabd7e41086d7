"""What each KV transfer worker of a prefill manager holds, since when, and how fast its last chunks went.

Each transfer worker (``transfer_worker`` in SGLang's ``nixl/conn.py`` from
v0.5.18 and ``mooncake/conn.py`` from v0.4.10) is serial: it takes one
``TransferKVChunk`` from its ``FastQueue`` (``common/utils.py``), posts it,
waits for it, and only then asks for the next one. So the worker's call to
``get()`` ends the chunk it held, and its return starts the next one.

The plugin watches ``FastQueue.get`` at class level, installed when the hook
is (before SGLang builds its KV managers and starts their workers), rather
than per queue instance at the first hooked pass: by then every worker is
already blocked inside the original ``get``, and its first chunk, the one a
dead peer wedges on a fresh server, would go unseen. A worker that entered
the original ``get`` before the watch was installed cannot be intercepted
until it calls ``get`` again; until then its queue has no state and is
reported ``tracked: false``.

Worker threads write, the scheduler and HTTP threads read: each queue's
state is one immutable ``WorkerState``, replaced by a single attribute
assignment, so a reader sees either the old or the new one. Each chunk costs
O(1) (the ring is at most RECENT long). Nothing here may raise into the
worker: every step is guarded, and SGLang's own ``get`` runs as it would.

Each chunk also names its link: the decode destinations its room is sent
to, read when the worker takes it from the manager's ``transfer_infos``
(``{room: {destination: TransferInfo}}`` in every release with transfer
workers: NIXL keys a destination by its decode agent name, Mooncake and
Ascend by the decode engine's session id, ``host:port``). The worker sends
the chunk to each of them in turn, so the set is the link whose pace the
chunk shows. A queue's workers are serial but not bound to one
destination: SGLang puts a room on the queue its destinations' port sum
hashes to, so destinations of any speed share a queue.
"""

import functools
import hashlib
import importlib
import logging
import sys
import time
from typing import NamedTuple

logger = logging.getLogger("sglang_watchdog_plugin")

RECENT = 32
FASTQUEUE_MODULE = "sglang.srt.disaggregation.common.utils"
_STATE = "_sglang_watchdog_worker"
_LINKS = "_sglang_watchdog_transfer_infos"
_MARK = "__sglang_watchdog_watch__"
MAX_LINK = 256  # bytes of a link name; a longer destination set is named by its hash


class Chunk(NamedTuple):
    number: int  # chunks_taken when it was taken
    room: int
    pages: int
    last_chunk: bool
    taken: float  # time.monotonic()
    link: str = ""  # the room's decode destinations; "" where unknown


class WorkerState(NamedTuple):
    taken: int  # chunks taken since the watch saw the worker first
    chunk: Chunk | None  # in the worker's hands; None while it waits for one
    recent: tuple  # ((pages, seconds, number, link), ...) of finished chunks with pages, oldest first


_IDLE = WorkerState(0, None, ())


def install(queue_class=None):
    """Watches ``get`` of SGLang's FastQueue (or of queue_class); True once watched. Never raises.

    Without queue_class, the class is taken from SGLang's module, imported if
    need be: it holds only small helpers, and every prefill scheduler with
    worker queues imports it anyway.
    """
    try:
        if queue_class is None:
            module = sys.modules.get(FASTQUEUE_MODULE)
            if module is None:
                module = importlib.import_module(FASTQUEUE_MODULE)
            queue_class = getattr(module, "FastQueue", None)
        if queue_class is None:
            return False
        original = queue_class.get
        if getattr(original, _MARK, False):
            return True
        setattr(queue_class, "get", _watched(original))
        return True
    except Exception:  # no such module on this release (v0.4.6), or a class that will not take it
        logger.debug("sglang-watchdog plugin does not watch transfer worker queues here", exc_info=True)
        return False


def bind_links(queue, manager):
    """Names the links of this queue's chunks from the manager's ``transfer_infos``. Never raises."""
    try:
        infos = getattr(manager, "transfer_infos", None)
        if isinstance(infos, dict):
            queue.__dict__[_LINKS] = infos
    except Exception:
        pass


def link_of(infos, room):
    """The link of a room: its destinations' names, sorted, joined by commas ("" where unknown)."""
    dests = infos.get(room)
    if dests is None:
        return ""
    if isinstance(dests, dict):
        names = sorted(str(name) for name, info in tuple(dests.items()) if not _dummy(info))
    else:  # v0.4.6 keeps one TransferInfo per room (and has no transfer workers)
        names = [f"{dests.endpoint}:{dests.dst_port}"]
    link = ",".join(names)
    if len(link.encode()) > MAX_LINK:
        link = "sha256:" + hashlib.sha256(link.encode()).hexdigest()
    return link


def _dummy(info):
    """A destination that takes no KV from this rank (attention CP's non-authoritative ranks, v0.5.18)."""
    is_dummy = getattr(info, "is_dummy", None)
    try:
        return bool(is_dummy()) if callable(is_dummy) else False
    except Exception:
        return False


def watched(queue):
    """Whether this queue's get() is the watched one."""
    return getattr(getattr(type(queue), "get", None), _MARK, False)


def _watched(original):
    @functools.wraps(original)
    def get(self, *args, **kwargs):
        _finish(self)
        item = original(self, *args, **kwargs)
        _take(self, item)
        return item

    setattr(get, _MARK, True)
    return get


def _finish(queue):
    """The worker asks for its next chunk: the one it held is done, whatever became of it."""
    try:
        state = queue.__dict__.get(_STATE, _IDLE)
        chunk = state.chunk
        if chunk is None:
            if state is _IDLE:
                queue.__dict__[_STATE] = _IDLE  # seen waiting in the watched get: every take from here is seen
            return
        recent = state.recent
        if chunk.pages > 0:
            recent = (recent + ((chunk.pages, time.monotonic() - chunk.taken, chunk.number, chunk.link),))[-RECENT:]
        queue.__dict__[_STATE] = WorkerState(state.taken, None, recent)
    except Exception:
        pass


def _take(queue, item):
    try:
        state = queue.__dict__.get(_STATE, _IDLE)
        number = state.taken + 1
        room = getattr(item, "room", None)
        # is_last_chunk from v0.5.11 (Mooncake), is_last before (v0.4.10 to v0.5.3).
        last = getattr(item, "is_last_chunk", None)
        last = getattr(item, "is_last", False) if last is None else last
        room = room if room.__class__ is int else -1
        chunk = Chunk(number, room, _pages(item), last is True, time.monotonic(), _link(queue, room))
        queue.__dict__[_STATE] = WorkerState(number, chunk, state.recent)
    except Exception:
        pass


def _link(queue, room):
    infos = queue.__dict__.get(_LINKS)
    if infos is None:
        return ""
    try:
        return link_of(infos, room)
    except Exception:  # a TransferInfo of another shape: the queue stands for the link
        return ""


def _pages(item):
    try:
        return len(item.prefill_kv_indices)
    except Exception:  # None, or no such field
        return 0


def state_of(queue):
    """The queue's WorkerState, or None while untracked."""
    try:
        return queue.__dict__.get(_STATE)
    except Exception:
        return None


def depth(queue):
    """Chunks waiting in the queue, not yet taken (0 if unreadable)."""
    try:
        return len(queue._buf)
    except Exception:
        return 0


def queued_by_room(queues):
    """{room: chunks waiting} over these queues, from a copy of each buffer taken in one C call."""
    counts = {}
    for queue in queues:
        try:
            waiting = tuple(queue._buf)
        except Exception:  # mutated while copied, or not a FastQueue: that queue counts nothing this time
            continue
        for item in waiting:
            room = getattr(item, "room", None)
            counts[room] = counts.get(room, 0) + 1
    return counts


def queued_rooms(queue):
    """The rooms with a chunk waiting in this queue, in queue order (from one copy of its buffer; [] if unreadable)."""
    try:
        waiting = tuple(queue._buf)
    except Exception:
        return []
    rooms = []
    for item in waiting:
        room = getattr(item, "room", None)
        if room.__class__ is int and room not in rooms:
            rooms.append(room)
    return rooms


def worker_json(index, queue, now):
    """One entry of the listing's transfer_workers."""
    state = state_of(queue)
    chunk = state.chunk if state is not None else None
    recent = state.recent if state is not None else ()
    # A chunk that names no room cannot be listed (a room is a 64-bit unsigned integer): the worker
    # then proves nothing, and the whole listing stays readable.
    tracked = state is not None and (chunk is None or chunk.room >= 0)
    if not tracked:
        chunk = None
    return {
        "transfer_queue": index,
        "tracked": tracked,
        "depth": depth(queue),
        "chunks_taken": state.taken if state is not None else 0,
        "in_flight": None if chunk is None else {
            "chunk": chunk.number, "bootstrap_room": chunk.room, "pages": chunk.pages,
            "last_chunk": chunk.last_chunk, "seconds": round(max(0.0, now - chunk.taken), 3), "link": chunk.link,
        },
        "recent": [[pages, round(seconds, 4)] for pages, seconds, _, _ in recent],
        "finished": [{"chunk": number, "pages": pages, "seconds": round(seconds, 4), "link": link}
                     for pages, seconds, number, link in recent],
    }


def held_chunk(queue):
    """The number of the chunk the worker holds, or None (waiting, or untracked)."""
    state = state_of(queue)
    chunk = state.chunk if state is not None else None
    return None if chunk is None else chunk.number
