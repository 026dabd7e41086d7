"""The listing (GET /debug/inflight), built on an HTTP thread from the latest snapshot.

The shared fields (``server``, ``loop``) come from ``Listing.listing``; each
mode adds its own server fields and rows (``_server_extras``,
``_queues_json``): the prefill ones here, the decode ones in
decode_monitor.py. docs/plugin-api.md documents every field.
"""

import os
import time

from . import kv_threads, peers, transfer_watch
from .identity import sglang_version
from .observe import poll_name
from .snapshot import listed_rooms

API_VERSION = 1


class Listing:
    """The listing's part of a Monitor: reads the monitor's snapshot and settings, changes nothing."""

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
        threads = kv_threads.listing(self.kv_threads)
        if threads is not None:  # absent while none is known, as the Go writers of the listing leave it
            body["kv_threads"] = threads
        body.update(self._queues_json(snapshot, now, peer_view))
        return body

    def _peer_view(self):
        """(ranks of the group watched, this one included; the other ranks' View), read once per listing."""
        own = 1 if self.transfer_tracking else 0
        view = peers.View(0, {}, {}, []) if self.peers is None else self.peers.read(queues=self.transfer_queues)
        return own + view.watched, view

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
        rows = [_room_json(room, now, queued, others) for room in listed_rooms(snapshot)]
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
        if others.workers:  # attention TP/CP > 1 only: without peers the listing is as before
            body["peer_transfer_workers"] = others.workers
        return body


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
    if others.watched:  # attention TP/CP > 1 only: absent without peers
        row["peer_chunks_queued"] = others.queued.get(facts.bootstrap_room, 0)
    return row
