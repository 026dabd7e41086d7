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
"""

import functools
import importlib
import logging
import sys
import time
from typing import NamedTuple

logger = logging.getLogger("sglang_watchdog_plugin")

RECENT = 32
FASTQUEUE_MODULE = "sglang.srt.disaggregation.common.utils"
_STATE = "_sglang_watchdog_worker"
_MARK = "__sglang_watchdog_watch__"


class Chunk(NamedTuple):
    number: int  # chunks_taken when it was taken
    room: int
    pages: int
    last_chunk: bool
    taken: float  # time.monotonic()


class WorkerState(NamedTuple):
    taken: int  # chunks taken since the watch saw the worker first
    chunk: Chunk | None  # in the worker's hands; None while it waits for one
    recent: tuple  # ((pages, seconds), ...) of finished chunks with pages, oldest first


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
            recent = (recent + ((chunk.pages, time.monotonic() - chunk.taken),))[-RECENT:]
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
        chunk = Chunk(number, room if room.__class__ is int else -1, _pages(item), last is True, time.monotonic())
        queue.__dict__[_STATE] = WorkerState(number, chunk, state.recent)
    except Exception:
        pass


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
    return {
        "transfer_queue": index,
        "tracked": state is not None,
        "depth": depth(queue),
        "chunks_taken": state.taken if state is not None else 0,
        "in_flight": None if chunk is None else {
            "chunk": chunk.number, "bootstrap_room": chunk.room, "pages": chunk.pages,
            "last_chunk": chunk.last_chunk, "seconds": round(max(0.0, now - chunk.taken), 3),
        },
        "recent": [[pages, round(seconds, 4)] for pages, seconds in state.recent] if state is not None else [],
    }


def held_chunk(queue):
    """The number of the chunk the worker holds, or None (waiting, or untracked)."""
    state = state_of(queue)
    chunk = state.chunk if state is not None else None
    return None if chunk is None else chunk.number
