"""A prefill (and decode) server made of SGLang's own PD code, with the plugin loaded, for scenarios.

``Bench`` owns one backend's prefill and decode KV managers, a prefill
scheduler whose loop thread runs SGLang's own inflight pass every few
milliseconds (as the event loop does between batches), and the plugin's
listener. Requests are admitted the way SGLang admits them: a real sender
and receiver, bootstrapped through SGLang's bootstrap server, the KV sent
chunk by chunk, then the request appended to the inflight queue on the
scheduler thread.

A prefill rank sends to one decode manager by default; ``destination``
adds more (each SGLang's own decode KV manager: its own NIXL agent, or its
own Mooncake session ``host:port``), and a request admitted with ``link=``
goes to that one. SGLang's prefill bootstrap learns each from its receivers
as it does from separate decode servers, and puts a room on the transfer
queue its destinations' ports hash to.
"""

import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request

from . import scheduler as sch
from . import transports

# Mooncake session ports of the destinations (a name only: the fake engine dials nothing), above the fake
# engines' own (transports.MooncakeEngine counts from 17000).
session_ports = itertools.count(18000)
# Decode managers built to find a NIXL port that lands on a wanted queue: SGLang binds a random one.
_NIXL_PORT_TRIES = 32

# Bootstrap rooms are unique in SGLang; here too, across every bench of a process: SGLang's leftover
# managers of earlier benches and the fabric's plans are keyed by room.
_first_rooms = itertools.count(900000)


class Bench:
    def __init__(self, rt, backend, pass_interval=0.005, prefill_mgr=None):
        """``prefill_mgr``: another bench's, for benches that are one server's ranks (the bootstrap server here
        knows one prefill manager per rank, the last one registered)."""
        self.rt, self.backend = rt, backend
        self.prefill_mgr = prefill_mgr or rt.manager(backend, "prefill")
        self.decode_mgr = rt.manager(backend, "decode")
        self.pass_interval = pass_interval
        self.passes = 0
        self.errors = []  # exceptions SGLang's pass raised: each one would kill a real scheduler
        self._pending = []
        self._calls = []  # run on the loop thread before the next pass, as SGLang handles its inputs
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.running = threading.Event()  # cleared: the loop holds between passes
        self.running.set()
        self._held = threading.Event()
        self._thread = None
        self.links = {}
        self.destinations = {}  # name -> Destination, besides the default decode manager
        self.after_pass = []  # callables run on the scheduler thread after each pass (the server's stats)
        self.scheduler = self._scheduler()
        self.needs_requests = self._pass_needs_requests()
        from .. import capabilities

        # Read once: the fabric asks for every transfer, from SGLang's worker threads.
        self._queue_key = capabilities.queue_key(self.prefill_mgr)
        transports.fabric.queue_of = self.transfer_queue_of

    def transfer_queue_of(self, room):
        """The transfer queue SGLang's manager puts this room's chunks in, as the plugin computes it."""
        from .. import capabilities

        return capabilities.queue_of(self._queue_key, self.prefill_mgr, room)

    def _scheduler(self):
        return sch.prefill_scheduler(self.rt, self.backend, self.prefill_mgr)

    def _pass_needs_requests(self):
        return self.rt.pass_needs_requests()

    def start(self):
        os.environ.setdefault("SGLANG_WATCHDOG_PLUGIN_HOST", "127.0.0.1")
        os.environ["SGLANG_WATCHDOG_PLUGIN_PORT"] = "0"
        self._thread = threading.Thread(target=self._loop, name="bench-scheduler", daemon=True)
        self._thread.start()
        if self.needs_requests:
            # The plugin starts at its first hooked pass, which such an event loop makes only for a request.
            self.admit(next(_first_rooms), transports.COMPLETE, rid="bench-first-request")
        sch._until(lambda: self.monitor is not None, 30, "the plugin's first hooked pass")
        return self

    def stop(self):
        transports.fabric.end_hangs(link.room for link in self.links.values())
        transports.fabric.link_speed(0.0)
        for dest in self.destinations.values():
            transports.fabric.destination_speed(dest.key, None)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        monitor = self.monitor
        if monitor is not None and monitor.listener is not None:
            monitor.listener.close()

    @property
    def monitor(self):
        from .. import hook

        return hook.monitor_for(self.scheduler)

    def _loop(self):
        while not self._stop.is_set():
            if not self.running.is_set():
                self._held.set()
                self.running.wait(0.05)
                continue
            self._held.clear()
            with self._lock:
                pending, self._pending = self._pending, []
                calls, self._calls = self._calls, []
            try:
                for fn in calls:
                    fn()
                self._pass(pending)
            except Exception as e:  # a real scheduler process dies here
                self.errors.append(e)
            for fn in self.after_pass:
                try:
                    fn()
                except Exception as e:
                    self.errors.append(e)
            self.passes += 1
            time.sleep(self.pass_interval)

    def _pass(self, pending):
        """One iteration of the event loop: the newly admitted requests join the queue, then SGLang's pass."""
        self.scheduler.disagg_prefill_inflight_queue.extend(pending)
        if self.scheduler.disagg_prefill_inflight_queue or not self.needs_requests:
            self.scheduler.process_disagg_prefill_inflight_queue()

    # Decode destinations --------------------------------------------------

    def destination(self, name, queue=None, seconds_per_page=None):
        """Adds a decode destination: SGLang's decode KV manager of its own, which the prefill rank learns at
        its first request's bootstrap. ``queue``: its port is chosen so that SGLang puts its rooms on that
        transfer queue (Mooncake: the session's port; NIXL: its managers are built until SGLang's random port
        lands there). ``seconds_per_page``: its link speed (None: its queue's)."""
        if name in self.destinations:
            raise ValueError(f"destination {name!r} exists")
        count = len(getattr(self.prefill_mgr, "transfer_queues", None) or ())
        if queue is not None and not 0 <= queue < max(count, 1):
            raise ValueError(f"transfer_queue {queue}: this rank has {count} transfer queues")
        dest = new_destination(self.rt, self.backend, queue, count)
        self.destinations[name] = dest
        transports.fabric.destination_speed(dest.key, seconds_per_page)
        return dest

    def destination_speed(self, name, seconds_per_page):
        dest = self.destinations.get(name)
        if dest is None:
            raise ValueError(f"no destination {name!r} (add it first)")
        transports.fabric.destination_speed(dest.key, seconds_per_page)

    # Requests -------------------------------------------------------------

    def prepare(self, room, behaviour=transports.COMPLETE, chunks=1, rid=None, link=None):
        """A request bootstrapped and sent, not yet in the queue (admit and admit_held queue it); ``link``: the
        name of the destination it goes to (None: the default decode manager)."""
        if link is not None and link not in self.destinations:
            raise ValueError(f"no destination {link!r} (add it first)")
        decode_mgr = self.decode_mgr if link is None else self.destinations[link].manager
        transports.fabric.plan(room, behaviour)
        # The request's metadata slot, from SGLang's own allocator, as the bootstrap queue takes it.
        slot = self.scheduler.req_to_metadata_buffer_idx_allocator.alloc()
        if slot is None:
            raise RuntimeError("no free metadata slot: more requests in flight than the bench's pool holds")
        link = sch.Link(self.rt, self.backend, room, self.prefill_mgr, decode_mgr, slot=slot)
        link.bootstrap()
        # Read before the KV is sent: SGLang drops a room's transfer_infos once its transfer is done.
        link.destinations, link.queue = self.destination_keys(room), self.transfer_queue_of(room)
        link.send(chunks)
        req = sch.make_req(self.rt, room, rid=rid, sender=link.sender)
        req.metadata_buffer_index = slot
        self.links[req.rid] = link
        return req

    def admit(self, room, behaviour=transports.COMPLETE, chunks=1, rid=None, link=None):
        """A request whose forward pass is done: bootstrapped, its KV handed to the sender, in the inflight queue."""
        req = self.prepare(room, behaviour, chunks, rid, link)
        with self._lock:
            self._pending.append(req)
        sch._until(lambda: self.listed(req.rid) is not None or req in self.scheduler.streamed, 10,
                   f"{req.rid} to be listed")
        return req

    def destination_keys(self, room):
        """The keys of the room's destinations in SGLang's ``transfer_infos`` (None once SGLang dropped them)."""
        infos = getattr(self.prefill_mgr, "transfer_infos", None)
        entry = infos.get(room) if isinstance(infos, dict) else None
        return sorted(str(key) for key in entry) if isinstance(entry, dict) else None

    def abort(self, rid):
        """A client's abort, as Scheduler.abort_request handles it for the prefill inflight queue (SGLang
        v0.5.18, managers/scheduler.py): the matching requests' senders get ``abort()``, on the scheduler
        thread, before the next pass. Returns once it ran."""
        done = threading.Event()

        def abort():
            try:
                for req in self.scheduler.disagg_prefill_inflight_queue:
                    if req.rid.startswith(rid) and hasattr(req.disagg_kv_sender, "abort"):
                        req.disagg_kv_sender.abort()
            finally:
                done.set()

        with self._lock:
            self._calls.append(abort)
        if not done.wait(10):
            raise RuntimeError(f"the scheduler loop did not run the abort of {rid} within 10 s")

    def hold(self):
        """Stops the loop between two passes; returns once no pass is running."""
        self.running.clear()
        sch._until(self._held.is_set, 10, "the scheduler loop to hold")

    def pending_orders(self):
        return len(getattr(self.monitor, "_orders", ()) or ())

    def health_check(self, room, rid=None):
        """SGLang's health check request: a fake sender (FakeKVSender), which the plugin must never fail."""
        try:
            fake = sch.runtime_module.loader.load("sglang.srt.disaggregation.fake.conn")[0]
        except ImportError:
            # Releases without a fake backend (v0.4.6): a health check gets a real sender and transfer,
            # made slow here so that it is still listed when the order comes.
            req = self.prepare(room, transports.slow(1.5), 1, rid or f"HEALTH_CHECK_{room}")
            with self._lock:
                self._pending.append(req)
            return req
        Sender = sch.runtime_module._class_named(fake, "fakekvsender")
        sender = Sender(**sch._accepted(Sender, mgr=self.prefill_mgr, bootstrap_addr="2.2.2.2:8998",
                                        bootstrap_room=room, dest_tp_ranks=[0], pp_rank=0))
        req = sch.make_req(self.rt, room, rid=rid or f"HEALTH_CHECK_{room}", sender=sender)
        req.bootstrap_host = "2.2.2.2"  # SGLang's FAKE_BOOTSTRAP_HOST: a marker, never dialled
        req.metadata_buffer_index = self.scheduler.req_to_metadata_buffer_idx_allocator.alloc()
        with self._lock:
            self._pending.append(req)
        return req

    @property
    def has_fake_backend(self):
        """Whether this release has SGLang's fake KV backend (health checks and warm-up on a FakeKVSender).

        Without it (v0.4.6) a health check has a real sender and only its
        HEALTH_CHECK rid marks it, and the warm-up request is skipped in PD mode.
        """
        import importlib.util

        try:
            return importlib.util.find_spec("sglang.srt.disaggregation.fake") is not None
        except ImportError:
            return False

    def finish_health_check(self, req):
        """Lets a health check's transfer end: a fake sender is told its KV was sent; a real one finishes alone."""
        sender = req.disagg_kv_sender
        if req.rid in self.links:
            return
        import inspect

        if any(p.default is inspect.Parameter.empty for p in inspect.signature(sender.send).parameters.values()):
            sender.send(None)
        else:
            sender.send()

    def queued(self, rid):
        return any(r.rid == rid for r in list(self.scheduler.disagg_prefill_inflight_queue))

    def released(self, rid):
        """(finished_reason, streamed) once SGLang's pass let the request go, else None."""
        for req in list(self.scheduler.streamed):
            if req.rid == rid:
                return req.finished_reason
        return None

    def wait_released(self, rid, timeout=10):
        sch._until(lambda: self.released(rid) is not None, timeout, f"{rid} to leave the inflight queue")
        return self.released(rid)

    # The plugin's API -----------------------------------------------------

    @property
    def url(self):
        return f"http://127.0.0.1:{self.monitor.listener.port}"

    def listing(self):
        return get_json(self.url + "/debug/inflight")

    def listed(self, rid):
        if self.monitor is None or self.monitor.listener is None:
            return None  # not started yet: no hooked pass so far
        try:
            rooms = self.listing().get("inflight", [])
        except OSError:
            return None
        return next((room for room in rooms if room.get("rid") == rid), None)

    def post(self, path, body):
        return post_json(self.url + path, body)

    def worker(self, queue):
        """The listing's entry of one transfer worker (round 4)."""
        return self.listing()["transfer_workers"][queue]

    def wedge_order(self, queue, chunk, ttl=10.0, min_age=0.0, dry_run=False):
        return self.post("/admin/wedge_order", {"transfer_queue": queue, "chunk": chunk, "ttl_seconds": ttl,
                                                "min_age_seconds": min_age, "reason": "conformance",
                                                "dry_run": dry_run})

    def force_fail(self, req, dry_run=False):
        return self.ordered(req, {"rid": req.rid, "bootstrap_room": req.bootstrap_room, "reason": "conformance",
                                  "dry_run": dry_run})

    def ordered(self, req, body):
        """Posts a force-fail, telling the page ledger first: a release whose failure record does not carry the
        plugin's reason (the earliest releases keep none) is still counted as the lever's."""
        if not body.get("dry_run"):
            transports.ledger.order_seen(req.bootstrap_room)
        status, answer = self.post("/admin/force_fail", body)
        if status != 200 or answer.get("result") != "flipped":
            transports.ledger.order_refused(req.bootstrap_room)
        return status, answer


class Destination:
    """One decode destination: its manager, SGLang's key for it on the prefill side, and its port."""

    def __init__(self, manager, key, port):
        self.manager, self.key, self.port = manager, key, port


def destination_of(backend, manager):
    """(key, port) of a decode manager as SGLang's prefill side names it: NIXL keys ``transfer_infos`` by the
    decode agent's name and shards by the manager's ``rank_port``; Mooncake (and Ascend) by the session id
    ``host:port``, sharding by its port."""
    if backend == "nixl":
        return manager.agent.name, int(manager.rank_port)
    session = manager.get_session_id()
    return session, int(session.rsplit(":", 1)[1])


def own_session(manager, port):
    """Gives a Mooncake decode manager a session of its own: newer releases share one engine per process (a
    decode server's own), so every manager here would name the same session. The engine wrapper is copied
    and its session id set; the fake engine behind it is shared and dials nothing."""
    import copy

    engine = copy.copy(manager.engine)
    engine.session_id = f"127.0.0.1:{port}"
    manager.engine = engine


def new_destination(rt, backend, queue=None, queues=0, attn_tp=(0, 1), server_args=None):
    """A decode KV manager for one more destination; with ``queue``, one whose port SGLang shards to it."""
    if backend != "nixl":
        manager = rt.manager(backend, "decode", attn_tp, server_args)
        port = next(session_ports)
        while queue is not None and port % queues != queue:
            port = next(session_ports)
        own_session(manager, port)
        return Destination(manager, *destination_of(backend, manager))
    for _ in range(_NIXL_PORT_TRIES):
        manager = rt.manager(backend, "decode", attn_tp, server_args)
        key, port = destination_of(backend, manager)
        if queue is None or port % queues == queue:
            return Destination(manager, key, port)
    raise RuntimeError(f"no NIXL decode manager bound a port on transfer queue {queue} in {_NIXL_PORT_TRIES} tries "
                       "(Linux binds random ports odd: a room with one NIXL destination lands on an odd queue)")


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def post_json(url, body):
    """(status, body) of a JSON POST to the plugin; an HTTP error status is an answer, not an exception."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=15) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
