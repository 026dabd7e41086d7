"""What the plugin infers, played on SGLang's own code (issue 24): the listing, the verdict, the action, the aftermath.

Six scenes, each decided from the release's code, never its version:

* a Mooncake transfer worker that dies: SGLang's engine wrapper
  (``MooncakeTransferEngine``) and the manager's worker loop
  (``MooncakeKVManager.transfer_worker``, or the earliest releases' one
  ``transfer_thread``; ``disaggregation/mooncake/conn.py``) are read for the
  plainest fault they let through, and the fake engine plays exactly that: a
  failed transfer where the wrapper raises on one, else an exception the
  wrapper's and the loop's ``except`` clauses do not keep. The thread dies,
  the listing's ``kv_threads`` shows it dead, the rooms behind it wait on
  its queue with nothing in flight, the plugin's force-fail releases them
  (or says it has no lever), and another queue still serves while the dead
  one never will: only a restart clears it;
* NIXL's poll on a failed transfer: where ``NixlKVSender.poll`` raises
  ("KVSender transfer encountered an error."), SGLang's own inflight pass
  raises, which kills a real scheduler; where it answers Failed, the pass
  releases the request;
* a decode that never answers the bootstrap: the prefill bootstrap queue is
  a stand-in here (scheduler.prefill_scheduler), so the sender is built alone,
  for a room no receiver ever registers, and polled as that queue would. A
  sender whose poll() reads the manager's ``bootstrap_timeout`` (from
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``) fails after it; one that does
  not keeps its first answer for ever (Bootstrapping, or, where poll() reads
  no status before the KV is sent, WaitingForInput at once);
* a decode that dies mid-handshake: its receiver fetches the prefill's
  layout and registers its KV args (prefill's ``decode_kv_args_table``
  learns it), then never sends the room's pages. Prefill's sender for the
  room polls as in the scene above (Failed after the bootstrap timeout where
  poll() reads one, else its first answer for ever); the room is in the
  bootstrap queue, which the plugin does not list; a live decode is served;
* heartbeat loss: where decode's manager runs SGLang's ``heartbeat_checker``
  (made with SGLang's shortest interval, 2 s, and one miss a loss, as it
  reads ``SGLANG_DISAGGREGATION_HEARTBEAT_*``), its HTTP session to the
  prefill is refused below SGLang's code. SGLang fails the rooms it tracks
  under that prefill (``_handle_node_failure``), its decode pass aborts them
  and frees their pages, and the plugin's decode listing drops them; prefill
  is not told, its sender keeps the transfer;
* the staging re-queue loop: a prefill manager made with
  ``SGLANG_DISAGG_STAGING_BUFFER=1`` (its GPU staging buffers stood in:
  ``init_staging_buffers`` allocates them on CUDA), a destination that reads
  as a decode with staging and another TP size, and a chunk allocated in a
  ring round whose watermark decode never reports. SGLang's worker puts the
  chunk back (``_do_staging_transfer``) and takes it again every
  ``STAGING_WATERMARK_WAIT_S``: the listing's ``chunks_taken`` and
  ``in_flight.chunk`` climb, ``in_flight.seconds`` stays near 0, the room's
  progress stands, and a wedge order on the held chunk is void at once: the
  loop reads as worker progress (a stated limit). The bench's Mooncake
  managers have the MLA layout, which SGLang never stages: NIXL only.
"""

import ast
import contextlib
import copy
import inspect
import os
import time
import types
import unittest
from unittest import mock

from sglang_watchdog_plugin import capabilities, kv_threads
from sglang_watchdog_plugin.orders import DEFAULT_REASON
from sglang_watchdog_plugin.conformance import aftermath, pins, runtime, transports
from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance import decode_bench
from sglang_watchdog_plugin.conformance import scheduler as sch
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

_rooms = iter(range(600000, 700000))

# The bootstrap timeout the scene sets, in seconds (SGLang's default is 300): whole, as the earliest releases
# read the variable as an int.
BOOTSTRAP_TIMEOUT = 1
# How long a room on a dead worker's queue is watched to stay there: it never leaves, so any time shows it.
WATCH_SECONDS = 0.5


class EngineFault(BaseException):
    """A transfer library fault that is no ``Exception``: what an ``except Exception`` lets through."""


def _clauses(fn):
    """(caught classes, re-raises) of each except clause of ``fn``; None when its source cannot be read."""
    tree = capabilities._function_tree(fn)
    if tree is None:
        return None
    namespace = getattr(fn, "__func__", fn).__globals__
    clauses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler):
            caught = (BaseException,) if node.type is None else _resolve(node.type, namespace)
            clauses.append((caught, any(isinstance(stmt, ast.Raise) for stmt in node.body)))
    return clauses


def _resolve(node, namespace):
    if isinstance(node, ast.Tuple):
        return tuple(cls for element in node.elts for cls in _resolve(element, namespace))
    if isinstance(node, ast.Call):
        node = node.func
    try:
        value = eval(compile(ast.Expression(node), "<except>", "eval"), dict(namespace))
    except Exception:
        return ()
    return tuple(value) if isinstance(value, tuple) else (value,)


def _swallows(clauses, cls):
    """Whether one of these clauses catches ``cls`` and goes on (a clause that raises again passes it on)."""
    return any(issubclass(cls, caught) and not reraises for caught, reraises in clauses)


def _raised_on_failure(fn):
    """The classes ``fn`` raises outside its except clauses: an engine wrapper that raises on a failed transfer."""
    tree = capabilities._function_tree(fn)
    if tree is None:
        return ()
    handled = {id(node) for handler in ast.walk(tree) if isinstance(handler, ast.ExceptHandler)
               for node in ast.walk(handler)}
    namespace = getattr(fn, "__func__", fn).__globals__
    return tuple(cls for node in ast.walk(tree) if isinstance(node, ast.Raise) and node.exc is not None
                 and id(node) not in handled for cls in _resolve(node.exc, namespace) if isinstance(cls, type))


def _fatal_fault(wrappers, worker):
    """(plan, class) of the plainest fault that SGLang's engine wrappers and its worker loop both let through,
    the class being what then ends the thread; None when the worker survives every one."""
    layers = [_clauses(fn) for fn in (*wrappers, worker)]
    if any(clauses is None for clauses in layers):
        return None
    worker_clauses = layers[-1]
    raised = [_raised_on_failure(fn) for fn in wrappers]
    if wrappers and all(raised):  # a failed transfer alone raises out of the wrapper
        cls = raised[0][0]
        if not _swallows(worker_clauses, cls):
            return transports.FAIL, cls
    for cls in (RuntimeError, EngineFault):
        if not any(_swallows(clauses, cls) for clauses in layers):
            return transports.raising(cls("transfer engine fault")), cls
    return None


# The decode staging ring the scene's destination reads as having (bytes; a name only, nothing is written).
STAGING_RING_BYTES = 1 << 20


class _HostStagingBuffer:
    """Stands in for a prefill staging buffer (common/staging_buffer.py StagingBuffer, GPU memory)."""

    def get_ptr(self):
        return id(self)

    def get_size(self):
        return STAGING_RING_BYTES

    def fits(self, required_bytes):
        return required_bytes <= STAGING_RING_BYTES


def _staging_handler():
    return runtime.loader.load("sglang.srt.disaggregation.common.staging_handler")[0]


def _refusing_session():
    """A requests session that every server refuses: SGLang's HTTP client to a prefill that is gone."""
    import requests
    from requests.adapters import BaseAdapter

    class Refused(BaseAdapter):
        def send(self, request, *args, **kwargs):
            raise requests.ConnectionError(f"connection refused: {request.url}")

        def close(self):
            pass

    session = requests.Session()
    session.mount("http://", Refused())
    session.mount("https://", Refused())
    return session


def _poll_reads(sender_cls, name):
    """Whether the sender's poll(), or a method of its own that poll() calls, reads attribute ``name``."""
    poll = capabilities._function_tree(sender_cls.poll)
    if poll is None:
        return False
    own = [capabilities._function_tree(getattr(sender_cls, node.func.attr, None)) for node in ast.walk(poll)
           if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
           and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"]
    return any(name in capabilities._attributes(tree) for tree in (poll, *own) if tree is not None)


def _raises(fn):
    tree = capabilities._function_tree(fn)
    return tree is not None and any(isinstance(node, ast.Raise) for node in ast.walk(tree))


class _Inferred(aftermath.Checked):
    backend = None

    def setUp(self):
        if self._testMethodName == "test_staging_requeue_loop":
            self.bench = bench_module.Bench(test_prefill._RT, self.backend, prefill_mgr=self.staging_manager()).start()
        elif self._testMethodName == "test_heartbeat_loss":
            # SGLang reads both when it makes the decode manager: its shortest interval, and one miss is a loss.
            with mock.patch.dict(os.environ, {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
                                              "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}):
                self.bench = decode_bench.DecodeBench(test_prefill._RT, self.backend).start()
        else:
            self.bench = bench_module.Bench(test_prefill._RT, self.backend).start()
        self.addCleanup(self.bench.stop)
        self.watch_aftermath(self.bench)
        self.levers = self.bench.listing()["server"]["levers"]

    def staging_manager(self):
        """SGLang's prefill manager made with SGLANG_DISAGG_STAGING_BUFFER=1, its GPU staging buffers stood in."""
        rt = test_prefill._RT
        conn = rt.conns[self.backend]
        Manager = runtime._class_named(conn, f"{self.backend}kvmanager")
        if "enable_staging" not in inspect.getsource(Manager.__init__):
            self.skipTest(f"SGLang's {Manager.__name__} (disaggregation/{self.backend}/conn.py) has no staging")
        args = copy.copy(rt._server_args_for(self.backend))
        object.__setattr__(args, "chunked_prefill_size", args.chunked_prefill_size or 8192)
        schedule = types.SimpleNamespace(chunked_prefill_size=args.chunked_prefill_size)
        with contextlib.ExitStack() as stack:
            # As SGLang reads it: the variable, when the manager is made.
            stack.enter_context(mock.patch.dict(os.environ, {"SGLANG_DISAGG_STAGING_BUFFER": "1"}))
            if hasattr(conn, "get_schedule"):  # the scheduler's chunk size, where the release reads it there
                stack.enter_context(mock.patch.object(conn, "get_schedule", lambda: schedule))
            try:
                manager = rt.manager(self.backend, "prefill", server_args=args)
            except Exception as e:
                # Its prefill side allocates one staging buffer per transfer worker before any starts
                # (common/staging_handler.py init_staging_buffers: StagingBuffer, torch.empty on cuda:<gpu_id>,
                # registered with the transport as VRAM). Only that is stood in below: host-side buffers that
                # the loop never reaches (its gather runs once the watermark lets a chunk through).
                import torch

                self.assertFalse(torch.cuda.is_available(), f"staging failed with a GPU present: {e!r}")
                self.gpu_reason = f"{type(e).__name__}: {e}"

                def host_buffers(manager, count):
                    manager._staging_ctx.buffers = [_HostStagingBuffer() for _ in range(count)]

                # The failed manager registered with the bootstrap server first; this one registers after it.
                with mock.patch.object(Manager, "_init_staging_buffers", host_buffers):
                    manager = rt.manager(self.backend, "prefill", server_args=args)
        self.assertTrue(manager.enable_staging)
        # What ModelRunner hands it once the KV pool exists: the staged send's tensors (never read here).
        manager.set_kv_buffer_tensors([], [], manager.kv_args.page_size)
        return manager

    def tearDown(self):
        self.check_aftermath()
        self.assertEqual(self.bench.errors, [], "SGLang's pass raised: a real scheduler would have died")

    def room(self):
        return next(_rooms)

    def sender_class(self):
        return runtime._class_named(test_prefill._RT.conns[self.backend], f"{self.backend}kvsender")

    def force_fail_releases(self, req):
        status, body = self.bench.force_fail(req)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_ABORT")

    def test_a_decode_that_never_answers_the_bootstrap(self):
        Sender = self.sender_class()
        mgr = self.bench.prefill_mgr
        with self.short_bootstrap_timeout(Sender, mgr) as applies:
            self.poll_unanswered_sender(Sender, mgr, applies)

    @contextlib.contextmanager
    def short_bootstrap_timeout(self, Sender, mgr):
        """Yields whether the sender's poll() reads the manager's bootstrap timeout, set short meanwhile."""
        applies = _poll_reads(Sender, "bootstrap_timeout")
        if applies:
            # SGLang reads the variable once, into the manager, when the manager is made: the manager's
            # attribute is what poll() compares against.
            self.assertTrue(hasattr(mgr, "bootstrap_timeout"), "poll() reads a timeout its manager lacks")
            default, mgr.bootstrap_timeout = mgr.bootstrap_timeout, BOOTSTRAP_TIMEOUT
        try:
            yield applies
        finally:  # before the aftermath's new request, which bootstraps on this manager
            if applies:
                mgr.bootstrap_timeout = default

    def test_a_decode_that_dies_mid_handshake(self):
        """Decode's receiver registers its KV args with prefill, then dies before it sends the room's metadata."""
        Sender = self.sender_class()
        mgr, bench = self.bench.prefill_mgr, self.bench
        dying = bench.destination("dying")
        slot = bench.scheduler.req_to_metadata_buffer_idx_allocator.alloc()
        self.addCleanup(bench.scheduler.req_to_metadata_buffer_idx_allocator.free, slot)
        with self.short_bootstrap_timeout(Sender, mgr) as applies:
            link = sch.Link(test_prefill._RT, self.backend, self.room(), mgr, dying.manager, slot=slot)
            receiver, decode_mgr = link.receiver, dying.manager
            # Decode's prealloc up to the metadata: the prefill's layout fetched and, where the release makes it
            # a step of its own, the receiver's init (its KV args registration); the receivers of the releases
            # without send_metadata register when made. The room's pages (send_metadata, or init with the page
            # indices) are never sent: the decode is gone.
            if hasattr(decode_mgr, "try_ensure_parallel_info"):
                _until(lambda: decode_mgr.try_ensure_parallel_info(receiver.bootstrap_addr), 10,
                       "prefill parallel info")
            if hasattr(receiver, "send_metadata") and "prefill_dp_rank" in inspect.signature(receiver.init).parameters:
                receiver.init(0)
            table = getattr(mgr, "decode_kv_args_table", None)
            if table is not None:  # the half that arrived: prefill knows the decode's KV args
                _until(lambda: str(dying.key) in map(str, table), 10, "prefill to learn the decode's KV args")
            self.assertIsNone(bench.destination_keys(link.room), "prefill learnt the room's metadata")
            self.poll_until_verdict(link.sender, Sender, applies)
        # The room never left prefill's bootstrap queue (a stand-in here): the plugin lists the inflight queue only.
        self.assertNotIn(link.room, [row.get("bootstrap_room") for row in bench.listing()["inflight"]])

    def test_heartbeat_loss(self):
        """Decode's heartbeat checker stops reaching the prefill's bootstrap server while a transfer is in flight."""
        bench = self.bench
        mgr, Poll = bench.decode_mgr, test_prefill._RT.KVPoll
        heartbeat = next((t for t in kv_threads.find(mgr) if t.role == kv_threads.HEARTBEAT), None)
        if heartbeat is None:
            self.skipTest(f"SGLang's {type(mgr).__name__} (disaggregation/{self.backend}/conn.py) starts no "
                          "heartbeat_checker thread: nothing on decode watches the prefill")
        req = bench.admit(self.room(), transports.HANG)
        link = bench.links[req.rid]
        addr = link.receiver.bootstrap_addr
        self.assertIn(link.room, mgr.addr_to_rooms_tracker[addr], "SGLang tracks no room under its prefill")
        self.assertEqual(bench.listed(req.rid)["queue"], "transfer")
        # Below SGLang's code: its HTTP session to that prefill is refused from now on, as by a bootstrap server
        # that is gone. SGLang's checker counts the miss; at max_failures it handles the prefill as dead.
        with mgr.session_pool_lock:
            mgr.session_pool[addr] = _refusing_session()
        limit = mgr.heartbeat_interval * (mgr.max_failures + 1) + 5
        _until(lambda: link.receiver.poll() == Poll.Failed or not heartbeat.thread.is_alive(), limit,
               "SGLang's heartbeat checker to fail the room")
        if not heartbeat.thread.is_alive():
            # Its own handling of the lost prefill raises (v0.5.3 NIXL reads a prefill_tp_size_table its manager
            # lacks): the checker dies, the room is never failed, and no later prefill loss is ever noticed.
            self.assertNotEqual(link.receiver.poll(), Poll.Failed)
            self.assertIn(heartbeat.function, [name for name, _ in aftermath.escaped_since(self._aftermath.mark)][-1])
            self.sglang_breaks_itself("SGLang's heartbeat checker raises in its own handling of a lost prefill and "
                                      "dies; the watchdog lists it dead (kv_threads)")
            return
        # No room of the lost prefill is tracked any more (the key itself may come back empty: a defaultdict).
        self.assertFalse(mgr.addr_to_rooms_tracker.get(addr), "SGLang kept tracking the lost prefill's rooms")
        # SGLang's decode pass releases it: out of the transfer queue, aborted, never admitted to decoding.
        _until(lambda: bench.queue_of(req.rid) is None, 10, "SGLang's decode pass to release the room")
        self.assertFalse(bench.transferred(req.rid))
        self.assertIsNone(bench.listed(req.rid))
        self.assertEqual(type(req.finished_reason).__name__, "FINISH_ABORT")
        # SGLang's own failure (its record, "Lost/Losing connection with prefill instance", where the receiver's
        # failure_exception carries it; NIXL's of v0.5.11 answers "NIXL KVReceiver Exception"), not an order's.
        self.assertNotIn(DEFAULT_REASON, str(getattr(req.finished_reason, "message", "")))
        # Prefill is not told: its sender still holds the hung transfer (the aftermath's heal ends it).
        self.assertNotEqual(link.sender.poll(), Poll.Failed)

    def test_staging_requeue_loop(self):
        """Staging on, decode's watermark stalled: SGLang's worker puts the chunk back on its queue and takes it
        again (``_do_staging_transfer``, ``queue.put(kv_chunk)``), every STAGING_WATERMARK_WAIT_S."""
        bench, mgr, Poll = self.bench, self.bench.prefill_mgr, test_prefill._RT.KVPoll
        if getattr(mgr, "is_mla_backend", False):
            self.skipTest(f"SGLang's {type(mgr).__name__} sends an MLA layout over its plain path, never staged "
                          "(its worker takes staging only with another attention TP size on decode); the bench's "
                          "Mooncake managers have that layout (conformance/runtime.py)")
        # A first request teaches prefill the destination's KV args; then they read as a decode with staging on
        # and another TP size would register them (the decode's staging ring: GPU memory here stood in).
        staged = bench.destination("staged")
        served = bench.admit(self.room(), transports.COMPLETE, link="staged")
        self.assertEqual(type(bench.wait_released(served.rid)).__name__, "FINISH_LENGTH")
        info = mgr.decode_kv_args_table[staged.key]
        for name in ("decode_tp_size", "dst_attn_tp_size"):
            if hasattr(info, name):
                setattr(info, name, 2 * mgr.attn_tp_size)
        info.staging_base_ptr = info.staging_total_size = STAGING_RING_BYTES

        req = bench.admit(self.room(), transports.COMPLETE, link="staged")
        link = bench.links[req.rid]
        queue = link.queue
        # Decode's allocation of the chunk (its STAGING_RSP), in its second round of the ring: writable once
        # decode reports the first round consumed, which it never does (the watermark stalls at (0, 0)).
        _staging_handler().handle_staging_rsp(
            [b"STAGING_RSP", *(str(v).encode() for v in (link.room, 0, 0, 1, STAGING_RING_BYTES)), staged.key.encode()],
            mgr.transfer_infos)
        # The first reading once the worker holds the chunk: before its first take the room reads
        # WaitingForInput, after it Transferring (NIXL writes it as its worker takes a chunk), which is no move.
        _until(lambda: ((bench.worker(queue) or {}).get("in_flight") or {}).get("bootstrap_room") == link.room
               and (bench.listed(req.rid) or {}).get("transfer_in_flight"), 10,
               "the worker to take the staged chunk and the plugin to list it")
        first = bench.worker(queue)
        row = bench.listed(req.rid)
        time.sleep(WATCH_SECONDS)
        later, later_row = bench.worker(queue), bench.listed(req.rid)
        # The worker is busy with it for ever: every take is a new chunk number, the room never moves.
        self.assertGreater(later["chunks_taken"], first["chunks_taken"] + 10, (first, later))
        self.assertEqual(later["in_flight"]["bootstrap_room"], link.room, later)
        self.assertLess(later["in_flight"]["seconds"], WATCH_SECONDS, later)
        self.assertEqual((later_row["poll"], later_row["progress"], later_row["transfer_in_flight"]),
                         (row["poll"], row["progress"], True), later_row)
        self.assertEqual(link.receiver.poll(), Poll.WaitingForInput)
        self.assertEqual(transports.fabric.of_room(link.room), [], "a staged chunk was posted")

        # A wedge order on the chunk the worker holds: void at the next take, a millisecond on.
        held = bench.worker(queue)["in_flight"]["chunk"]
        status, body = bench.wedge_order(queue, held)

        def voided():
            listing = bench.listing()
            return listing["wedge_orders"] == [] and listing["transfer_workers"][queue]["in_flight"]["chunk"] > held

        _until(voided, 5, f"the wedge order to be void once the worker takes the chunk again ({status} {body})")
        self.assertTrue(bench.queued(req.rid), "the order failed the room")
        print(f"\nconformance: staging: queue {queue} took {later['chunks_taken'] - first['chunks_taken']} chunks "
              f"in {WATCH_SECONDS}s, all room {link.room}; wedge order on chunk {held}: {status} {body.get('result')} "
              f"(staging buffers: {'stood in, SGLang failed with ' + self.gpu_reason if hasattr(self, 'gpu_reason') else 'on the GPU'})",
              flush=True)

        # The force-fail still releases it; SGLang's worker then drops the chunk (check_status Failed).
        self.force_fail_releases(req)
        _until(lambda: bench.worker(queue)["in_flight"] is None, 5, "the worker to drop the failed room's chunk")

    def poll_unanswered_sender(self, Sender, mgr, applies):
        addr = f"127.0.0.1:{test_prefill._RT.bootstrap_server(self.backend)[1]}"
        with mock.patch.dict(os.environ, {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT)}):
            sender = Sender(**sch._accepted(Sender, mgr=mgr, bootstrap_addr=addr, bootstrap_room=self.room(),
                                            dest_tp_ranks=[0], pp_rank=0))
            self.poll_until_verdict(sender, Sender, applies)

    def poll_until_verdict(self, sender, Sender, applies):
        """Polls a sender whose room's metadata never comes, as the prefill bootstrap queue would: Failed after
        the bootstrap timeout where poll() reads one, else its first answer for ever."""
        pins.ensure_warning_once()  # SGLang's timeout path logs with it
        Poll = test_prefill._RT.KVPoll
        first = sender.poll()
        if not (_poll_reads(Sender, "check_status") or _poll_reads(Sender, "request_status")):
            # poll() reads no status before the KV is sent: the bootstrap is not seen at all, and the room
            # answers as ready though no decode ever asked for it (a stated limit: nothing times it out).
            self.assertFalse(applies)
            self.assertNotEqual(first, Poll.Bootstrapping)
        else:
            self.assertEqual(first, Poll.Bootstrapping)
        if applies:
            _until(lambda: sender.poll() == Poll.Failed, BOOTSTRAP_TIMEOUT + 5, "the bootstrap timeout")
            return
        # A stated limit: nothing in this release's poll() times the bootstrap out; pinned for ever.
        deadline = time.monotonic() + 3 * BOOTSTRAP_TIMEOUT
        while time.monotonic() < deadline:
            self.assertEqual(sender.poll(), first)
            time.sleep(0.05)


class Mooncake(_Inferred, unittest.TestCase):
    backend = "mooncake"

    def test_a_transfer_worker_that_dies(self):
        mgr = self.bench.prefill_mgr
        threads = [t for t in kv_threads.find(mgr) if t.role == kv_threads.TRANSFER_WORKER]
        self.assertTrue(threads, "no thread of SGLang's Mooncake prefill manager drains a transfer queue")
        several = len(threads) > 1
        # Several workers: one dies, on queue 1 (its destination's session port is chosen so), another serves.
        worker = next(t for t in threads if t.transfer_queue == 1) if several else threads[0]
        engine_cls = type(mgr.engine)
        wrappers = [getattr(engine_cls, name) for name in ("transfer_sync", "batch_transfer_sync")
                    if callable(getattr(engine_cls, name, None))]
        fatal = _fatal_fault(wrappers, worker.thread._target)
        if fatal is None:
            self.skipTest(f"{engine_cls.__name__} and MooncakeKVManager's {worker.function} "
                          "(disaggregation/mooncake/conn.py) catch every exception: the worker cannot die of one")
        plan, fatal_cls = fatal
        link = None
        if several:
            live = next(t for t in threads if t is not worker)
            self.bench.destination("dead", worker.transfer_queue)
            self.bench.destination("live", live.transfer_queue)
            link = "dead"

        first = self.bench.admit(self.room(), plan, link=link)
        _until(lambda: not worker.thread.is_alive(), 10, f"SGLang's {worker.function} to die")
        escaped = [e for name, e in aftermath.escaped_since(self._aftermath.mark) if name == worker.thread.name]
        # What ends it: the fault, or SGLang's RuntimeError around it ("Transfer thread failed because of ...").
        self.assertTrue(escaped and isinstance(escaped[0], (fatal_cls, RuntimeError)), escaped)

        dead_row = worker.json()
        self.assertFalse(dead_row["alive"])
        # The listing is the snapshot of the scheduler's last pass: one made after the worker died.
        passes = self.bench.passes
        _until(lambda: self.bench.passes > passes + 1, 10, "two scheduler passes")
        listing = self.bench.listing()
        self.assertIn(dead_row, listing["kv_threads"])
        if several:
            self.assertIn(live.json(), listing["kv_threads"])
            self.assertTrue(live.json()["alive"])
        # The room whose transfer killed the worker: nothing queued; in flight only by SGLang's own per-room
        # count of outstanding chunks, which the dead worker raised and never lowered.
        # The plugin re-reads every room's transfer every 100 ms (REOBSERVE_INTERVAL_S), not at every pass.
        counts = getattr(mgr, "_staging_outstanding", None)
        expected = counts is not None and counts.get(first.bootstrap_room, 0) > 0
        _until(lambda: self.bench.listed(first.rid)["transfer_in_flight"] == expected, 5,
               f"the listing to read transfer_in_flight {expected} as SGLang's own count says")

        later = self.bench.admit(self.room(), transports.COMPLETE, link=link)
        time.sleep(WATCH_SECONDS)
        row = self.bench.listed(later.rid)
        self.assertTrue(self.bench.queued(later.rid), "a room behind the dead worker left the queue")
        self.assertEqual((row["transfer_queue"], row["transfer_in_flight"]), (worker.transfer_queue, False), row)
        if row["chunks_queued"] is not None:  # None: the plugin sees no worker queues on this release
            self.assertGreaterEqual(row["chunks_queued"], 1, row)
        self.assertEqual(transports.fabric.of_room(later.bootstrap_room), [], "the engine was asked for its KV")

        if self.levers:
            self.force_fail_releases(later)
            self.force_fail_releases(first)
        else:  # the plugin knows no lever that releases this sender: it says so, and nothing moves
            status, body = self.bench.force_fail(later)
            self.assertEqual((status, body["result"]), (501, "unsupported"), body)
            self.assertTrue(self.bench.queued(later.rid))

        # The aftermath: another queue's worker still serves a new request; the dead one's queue never will.
        if several:
            served = self.bench.admit(self.room(), transports.COMPLETE, link="live")
            self.assertEqual(type(self.bench.wait_released(served.rid, aftermath.SERVE_SECONDS)).__name__,
                             "FINISH_LENGTH")
        stuck = self.bench.admit(self.room(), transports.COMPLETE, link=link)
        time.sleep(WATCH_SECONDS)
        self.assertTrue(self.bench.queued(stuck.rid))
        self.assertEqual(transports.fabric.of_room(stuck.bootstrap_room), [])
        self.sglang_breaks_itself(
            f"SGLang's Mooncake {worker.function} died of {type(escaped[0]).__name__} and nothing in SGLang starts "
            f"it again: {'its' if several else 'the one'} transfer queue is never drained; only a restart clears it")


class Nixl(_Inferred, unittest.TestCase):
    backend = "nixl"

    def test_a_failed_transfer(self):
        Sender = self.sender_class()
        req = self.bench.admit(self.room(), transports.fail_after(0.3))
        if not _raises(Sender.poll):
            self.assertEqual(type(self.bench.wait_released(req.rid)).__name__, "FINISH_ABORT")
            self.assertEqual(self.bench.listed(req.rid), None)
            return
        _until(lambda: self.bench.errors, 10, "SGLang's inflight pass to raise")
        self.bench.hold()
        poll_source = inspect.getsource(Sender.poll)
        for error in self.bench.errors:
            self.assertIn(str(error), poll_source, f"{type(error).__name__}: {error}")
        self.assertTrue(self.bench.queued(req.rid), "the pass raised, yet let the request go")
        self.assertIsNotNone(self.bench.listed(req.rid), "the plugin stopped listing the request")
        self.assertIsNone(self.bench.released(req.rid))
        self.bench.errors.clear()
        self.sglang_breaks_itself("SGLang's NixlKVSender.poll (disaggregation/nixl/conn.py) raises on a failed "
                                  "transfer, out of the scheduler's inflight pass: a real scheduler process dies")


def setUpModule():
    test_prefill.setUpModule()


if __name__ == "__main__":
    unittest.main()
