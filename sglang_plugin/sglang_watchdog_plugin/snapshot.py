"""What the scheduler thread publishes for the HTTP threads of a prefill scheduler.

The scheduler thread builds a Snapshot at a pass and swaps it in with one
attribute write (monitor.py); the HTTP threads build the listing (listing.py)
and answer orders (admin.py) from the latest one, and never touch SGLang's
objects.
"""

from typing import NamedTuple


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


EMPTY = Snapshot(members=(), rooms={}, inflight=0, bootstrap=0, waiting=0, orphans=())


def listed_rooms(snapshot):
    """The snapshot's rooms in queue order (only ids of the members are used)."""
    rooms = snapshot.rooms
    for req in snapshot.members:
        room = rooms.get(id(req))
        if room is not None:
            yield room
