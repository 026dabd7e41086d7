"""What the other prefill ranks of an attention TP (and CP) group are sending, for the leader's listing.

Every rank of the group runs its own transfer workers into its own decode
peer's pages and counts its own outstanding chunks per room (its manager's
``_staging_outstanding``; SGLang v0.5.18, disaggregation/common/conn.py and
nixl/conn.py). Only the leader serves the listing, so it must know the
others' counts before it says that no chunk of a room is in flight: decode
frees a released request's pages on every decode rank at once.

Each non-leader rank's plugin publishes its counts to a file of its own, from
a thread of its own, every ``PUBLISH_INTERVAL_S`` (a copy of the dict, no
change to SGLang, whatever its scheduler loop is doing); the leader merges
the files written in the last ``FRESH_S``. A rank whose file is missing,
stale, or says its manager keeps no count is not watched, and the listing
says how many ranks are (``transfer_ranks_watched`` of ``transfer_ranks``):
the watchdog's "stopped" verdict needs every one.

The files are on the host's shared memory (``/dev/shm``, else the temporary
directory; ``SGLANG_WATCHDOG_PLUGIN_PEER_DIR`` chooses another), one folder
per SGLang server port, DP rank and PP rank. Ranks of one group on another
host (multi-node TP) never appear there: the group is then never fully
watched, and decode keeps SGLang's own timeout.
"""

import json
import logging
import os
import tempfile
import threading
import time
from typing import NamedTuple

from .transfer_watch import queued_by_room, queued_rooms, watched, worker_json

logger = logging.getLogger("sglang_watchdog_plugin")

PUBLISH_INTERVAL_S = 0.25
FRESH_S = 2.0
_COPY_TRIES = 5


def directory(scheduler, identity, env=os.environ):
    """The folder the ranks of this scheduler's group share."""
    base = env.get("SGLANG_WATCHDOG_PLUGIN_PEER_DIR", "").strip()
    if not base:
        shm = "/dev/shm"
        base = os.path.join(shm if os.path.isdir(shm) else tempfile.gettempdir(), "sglang-watchdog-peers")
    port = getattr(getattr(scheduler, "server_args", None), "port", None)
    return os.path.join(base, f"port{port}-dp{identity.dp_rank}-pp{identity.pp_rank}")


def _file(folder, attn_tp_rank, attn_cp_rank):
    return os.path.join(folder, f"rank-tp{attn_tp_rank}-cp{attn_cp_rank}.json")


def outstanding(manager):
    """room -> outstanding chunks (> 0) of this manager, or None where it keeps no count (or it moved under us)."""
    counts = getattr(manager, "_staging_outstanding", None)
    if counts is None or not callable(getattr(counts, "items", None)):
        return None
    for _ in range(_COPY_TRIES):
        try:
            # The transfer workers change it meanwhile; a copy that raced them raises and is tried again.
            return {int(room): n for room, n in list(counts.items()) if n.__class__ is int and n > 0}
        except RuntimeError:
            continue
    return None


class Publisher:
    """A non-leader rank's side: its counts, to its file, every interval."""

    def __init__(self, folder, identity, manager, interval=PUBLISH_INTERVAL_S):
        self.path = _file(folder, identity.attn_tp_rank, identity.attn_cp_rank)
        self.manager = manager
        self.interval = interval
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.publish()
        self._thread = threading.Thread(target=self._run, name="sglang-watchdog-peer", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception:
                # The file goes stale: the leader stops counting this rank as watched.
                logger.exception("sglang-watchdog plugin could not publish this rank's transfers to %s", self.path)

    def publish(self):
        counts = outstanding(self.manager)
        queues = getattr(self.manager, "transfer_queues", None)
        queues = queues if isinstance(queues, list) else []
        # Chunks still waiting in this rank's worker queues: not in flight (a released room's are dropped
        # unsent), but the room is not done on this rank, so the group's MIN still holds it (Group.sending).
        waiting = queued_by_room(queues)
        # What each worker holds and how fast its last chunks went, as the leader lists its own: the
        # watchdog judges a chunk of this rank by this rank's worker and link, not by the leader's. The
        # rooms waiting behind it too, which the leader's own rooms say of themselves (transfer_queue).
        monotonic = time.monotonic()
        workers = [dict(worker_json(index, queue, monotonic), queued_rooms=queued_rooms(queue))
                   for index, queue in enumerate(queues)] \
            if queues and all(hasattr(queue, "_buf") and watched(queue) for queue in queues) else None
        body = {"pid": os.getpid(), "written_unix": time.time(), "tracking": counts is not None,
                "in_flight": {str(room): n for room, n in (counts or {}).items()},
                "queued": {str(room): n for room, n in waiting.items() if isinstance(room, int) and n > 0},
                "transfer_workers": workers}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one


class View(NamedTuple):
    """The other ranks of the group as their fresh files tell them."""

    watched: int  # ranks whose fresh file says their manager counts
    in_flight: dict  # room -> outstanding chunks, summed over them
    queued: dict  # room -> chunks waiting in their worker queues, summed over them
    workers: list  # {"rank": "tp<R>-cp<C>", "transfer_workers": [...]} of each that reports its workers


class Group:
    """The leader's side: the other ranks' files, merged."""

    def __init__(self, folder, identity):
        self.folder = folder
        self.size = max(1, identity.attn_tp_size) * max(1, identity.attn_cp_size)
        self.others = [(tp, cp) for tp in range(max(1, identity.attn_tp_size))
                       for cp in range(max(1, identity.attn_cp_size))
                       if (tp, cp) != (identity.attn_tp_rank, identity.attn_cp_rank)]

    def read(self, now_unix=None):
        """What the other ranks' fresh files say, merged (a View)."""
        view = View(0, {}, {}, [])
        for (tp, cp), body, rooms in self._fresh(now_unix):
            view = view._replace(watched=view.watched + 1)
            for room, n in rooms.items():
                view.in_flight[room] = view.in_flight.get(room, 0) + n
            for room, n in (_rooms(body.get("queued")) or {}).items():
                view.queued[room] = view.queued.get(room, 0) + n
            workers = body.get("transfer_workers")
            if isinstance(workers, list) and all(isinstance(worker, dict) for worker in workers):
                view.workers.append({"rank": f"tp{tp}-cp{cp}", "transfer_workers": workers})
        return view

    def sending(self, room, now_unix=None):
        """(whether another rank still has a chunk of the room outstanding or waiting in its worker queues,
        the other ranks not watched now as "tp<R>-cp<C>"): a room quiet on the watched ranks is done on the group
        only if that list is empty."""
        watched = set()
        for (tp, cp), body, rooms in self._fresh(now_unix):
            if rooms.get(room, 0) > 0 or (_rooms(body.get("queued")) or {}).get(room, 0) > 0:
                return True, []
            watched.add((tp, cp))
        return False, [f"tp{tp}-cp{cp}" for tp, cp in self.others if (tp, cp) not in watched]

    def _fresh(self, now_unix):
        """((tp, cp), file body, its in_flight rooms) of every other rank whose fresh file says its manager
        counts."""
        for tp, cp in self.others:
            body = _read(_file(self.folder, tp, cp))
            if body is None or body.get("tracking") is not True:
                continue
            # The age is taken after the read: a file the rank replaced between a clock read and this one
            # would otherwise come from the future and pass for stale.
            now = time.time() if now_unix is None else now_unix
            written = body.get("written_unix")
            if not isinstance(written, (int, float)) or not (0 <= now - written <= FRESH_S):
                continue
            rooms = _rooms(body.get("in_flight"))
            if rooms is not None:
                yield (tp, cp), body, rooms


def _rooms(value):
    """room -> count of a file's in_flight, or None if any entry is not one (the rank is then unwatched)."""
    if not isinstance(value, dict):
        return None
    try:
        return {int(room): int(n) for room, n in value.items()}
    except (TypeError, ValueError):
        return None


def _read(path):
    try:
        with open(path) as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None
