"""A decode server made of SGLang's own decode code, with the plugin loaded, for scenarios.

``DecodeBench`` owns one backend's prefill and decode KV managers (real,
over the fake transports), and a decode scheduler derived from the release's
``SchedulerDisaggregationDecodeMixin`` whose ``disagg_decode_prealloc_queue``
and ``disagg_decode_transfer_queue`` are the release's own
``DecodePreallocQueue`` and ``DecodeTransferQueue``, built by reading their
constructor signatures. A loop thread runs the release's own
``process_decode_queue`` (hooked by the plugin as that release loads it)
every few milliseconds, as the decode event loop does between batches.

What stands in, and why:

* the decode KV manager is handed to the prealloc queue instead of being
  built by its ``_init_kv_manager`` from a GPU KV pool (the manager is the
  same class, made from the same KVArgs fields);
* the request and token pools: a pool that is full (no free request slot),
  so a request that finished its handshake waits in the prealloc queue as
  it does on a loaded server. The allocation step of ``pop_preallocated``
  needs a GPU KV pool; a request bound for the transfer queue is therefore
  put there as ``pop_preallocated`` hands it over: its receiver initialised
  and its page indices sent to prefill (``send_metadata``) with the
  metadata slot from SGLang's own allocator, then ``DecodeTransferQueue.extend``
  on the scheduler thread;
* the radix tree (``cache_finished_req`` records what SGLang's release path
  hands back), the stream to the tokenizer (recorded) and the metrics
  collector (counted), as on prefill;
* the prefill server: its inflight pass polls each sender every pass, which
  the bench's loop does before each decode pass;
* the prefill's metadata write: the fake transports move no bytes, so when
  every transfer of a room is done the bench writes the room and a first
  token into SGLang's own ``MetadataBuffers`` slot, as prefill's last chunk
  does.
"""

import copy
import inspect
import logging
import os
import queue
import threading
import types

from . import bench as bench_module
from . import runtime as runtime_module
from . import scheduler as sch
from . import transports


class FullPool:
    """The request-slot and token pools of a decode server that has no room left: prealloc waits."""

    page_size = 1
    size = 0

    def __init__(self):
        self.freed = []

    def available_size(self, *args, **kwargs):
        return 0

    def free(self, indices=None, *args, **kwargs):
        self.freed.append(indices)

    def alloc(self, *args, **kwargs):
        return None

    def get_kvcache(self):
        return types.SimpleNamespace(page_size=1, get_contiguous_buf_infos=lambda: ([], [], []))

    def translate_kv_indices_for_transfer(self, indices):
        return indices

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: 0


class _Args:
    """The scheduler's server args: the bench's overrides, then the release's own ServerArgs."""

    def __init__(self, base, **overrides):
        self.__dict__.update(overrides)
        self._base = base

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._base, name, None)


def construct(cls, values, what):
    """cls(**values) for every parameter its constructor declares; a required one the bench lacks is an error."""
    kwargs = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in values:
            kwargs[name] = values[name]
        elif param.default is inspect.Parameter.empty:
            raise TypeError(f"{what}: this release's constructor needs {name!r}, which the bench does not know")
    return cls(**kwargs)


class DecodeBench(bench_module.Bench):
    def __init__(self, rt, backend, pass_interval=0.005, metadata_slots=32, prealloc_methods=None, prefill_mgr=None):
        """``prealloc_methods`` replace methods of the release's DecodePreallocQueue (a scenario that derives
        another release's shape from this one's code)."""
        self._awaiting_metadata = {}  # room -> (DecodeRequest, slot)
        self._metadata_lock = threading.Lock()
        self.bootstrap_port = rt.bootstrap_server(backend)[1]  # each backend has its own bootstrap server here
        self.metadata_slots = metadata_slots
        self.prealloc_methods = prealloc_methods or {}
        super().__init__(rt, backend, pass_interval, prefill_mgr)

    def _pass_needs_requests(self):
        return False  # the decode event loops run the queue pass on every iteration

    # Construction ----------------------------------------------------------

    def _scheduler(self):
        import torch

        metadata_slots = self.metadata_slots
        rt = self.rt
        decode = rt.decode
        cls = type("DecodeScheduler", self._mixins(),
                   {"stream_output": sch._record_stream, "__init__": lambda self: None})
        s = cls()
        sch._common(s, rt, self.backend, rt.Mode.DECODE)
        s.server_args = _Args(rt.server_args, disaggregation_transfer_backend=self.backend,
                              disaggregation_mode="decode", disaggregation_decode_polling_interval=1,
                              disaggregation_decode_enable_offload_kvcache=False,
                              disaggregation_decode_enable_radix_cache=False, disable_radix_cache=True,
                              enable_dp_attention=False, disaggregation_ib_device=None)
        s.waiting_queue = []
        s.last_batch = None
        s.running_batch = types.SimpleNamespace(reqs=[], is_empty=lambda: True)
        s.enable_hisparse = s.enable_decode_hicache = s.enable_priority_scheduling = False
        s.enable_overlap = False
        s.num_tokens_pre_allocated = 0
        s.spec_algorithm = _spec_algorithm()
        s.tp_worker = types.SimpleNamespace(is_hybrid_swa=False)
        s.model_config = _Args(None, num_hidden_layers=1, is_hybrid=False, is_hybrid_swa=False)
        s.ps.gpu_id = 0
        s.gpu_id = 0
        pool = FullPool()
        s.req_to_token_pool = pool
        s.token_to_kv_pool_allocator = pool
        self.pool = pool
        metadata_allocator = rt.utils.ReqToMetadataIdxAllocator(metadata_slots)
        s.req_to_metadata_buffer_idx_allocator = metadata_allocator
        _runtime_dtypes(torch)
        if hasattr(rt.utils, "MetadataBuffers"):
            self.metadata_buffers = construct(rt.utils.MetadataBuffers, dict(
                size=metadata_slots, hidden_size=16, dtype=torch.float32, hidden_states_dtype=torch.float32,
                device="cpu"), "MetadataBuffers")
        else:  # the oldest releases: a list of tensors, the first holding each slot's output id (Scheduler.__init__)
            self.metadata_buffers = [torch.zeros((metadata_slots, 16), dtype=torch.int32, device="cpu")]
        Backend = getattr(rt.utils, "TransferBackend", None)
        backend_value = next((v for v in Backend if str(v.value).lower() == self.backend), self.backend) \
            if Backend is not None else self.backend
        manager = self.decode_mgr
        transfer = construct(decode.DecodeTransferQueue, dict(
            gloo_group=rt.group, req_to_metadata_buffer_idx_allocator=metadata_allocator, tp_rank=0,
            metadata_buffers=self.metadata_buffers, scheduler=s, tree_cache=s.tree_cache,
            token_to_kv_pool_allocator=pool, spec_algorithm=s.spec_algorithm), "DecodeTransferQueue")
        s.disagg_decode_transfer_queue = transfer
        # The prealloc queue takes the bench's decode manager instead of building one from a GPU KV pool.
        Prealloc = decode.DecodePreallocQueue
        if "_init_kv_manager" not in _members(Prealloc):
            raise RuntimeError("this release's DecodePreallocQueue builds its KV manager inline (no "
                               "_init_kv_manager): it needs a GPU KV pool, which the bench cannot give it")
        Prealloc = type("DecodePreallocQueue", (Prealloc,),
                        {**self.prealloc_methods, "_init_kv_manager": lambda self: manager})
        s.disagg_decode_prealloc_queue = None  # read by DecodeTransferQueue.extend on newer releases
        prealloc = construct(Prealloc, dict(
            req_to_token_pool=pool, token_to_kv_pool_allocator=pool, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=metadata_allocator, metadata_buffers=self.metadata_buffers,
            scheduler=s, transfer_queue=transfer, tree_cache=s.tree_cache, gloo_group=rt.group, tp_rank=0,
            tp_size=1, dp_size=1, gpu_id=0, bootstrap_port=self.bootstrap_port, max_total_num_tokens=4096,
            prefill_pp_size=1, pp_rank=0, num_reserved_decode_tokens=16, transfer_backend=backend_value,
            aux_dtype=torch.int32, token_to_kv_pool=pool), "DecodePreallocQueue")
        prealloc.kv_manager = manager
        s.disagg_decode_prealloc_queue = prealloc
        return s

    def _mixins(self):
        return (self.rt.decode.SchedulerDisaggregationDecodeMixin,)

    # The loop ------------------------------------------------------------

    def _pass(self, pending):
        self._join(pending)
        self._poll_senders()
        self._write_arrived_metadata()
        try:
            self.scheduler.process_decode_queue()
        except Exception:
            logging.getLogger(__name__).exception("SGLang's decode pass raised")
            raise

    def _join(self, pending):
        for kind, item in pending:
            if kind == "prealloc":
                self.scheduler.disagg_decode_prealloc_queue.add(item)
            else:
                self.scheduler.disagg_decode_transfer_queue.extend([item])

    def _poll_senders(self):
        """The prefill server's inflight pass polls its senders every pass; some releases' NIXL senders settle
        their transfers (and so notify decode) only when polled."""
        for link in list(self.links.values()):
            if getattr(link, "settled", False):
                continue
            try:
                state = self.rt.poll_names.get(int(link.sender.poll()))
            except Exception:
                state = "Failed"
            link.settled = state in ("Success", "Failed")

    def _write_arrived_metadata(self):
        """Prefill's metadata write, which the fake transports do not move: once every transfer of a room is done."""
        for room in list(self._awaiting_metadata):
            self._metadata_landed(room)

    def _metadata_landed(self, room):
        """Writes the room's metadata once every transfer of it is done. Also called by the fabric from the thread
        that saw a transfer of the room land, before anyone is told of it: on real hardware the metadata (the aux
        data) lands with the KV, before decode's receiver can read Success, and SGLang's decode passes poll
        behind that metadata gate (``_poll_with_metadata_gate``)."""
        with self._metadata_lock:
            entry = self._awaiting_metadata.get(room)
            transfers = transports.fabric.of_room(room)
            if entry is None or not transfers or any(t.state != "DONE" for t in transfers):
                return
            decode_req, slot = entry
            buffers = self.metadata_buffers
            if isinstance(buffers, list):
                buffers[0][slot].fill_(1)
            for name, value in (("output_ids", 1), ("bootstrap_room", room), ("cached_tokens", 0)):
                tensor = getattr(buffers, name, None)
                if tensor is not None and hasattr(tensor, "shape"):
                    tensor[slot].fill_(0)
                    tensor[slot][0] = value
            del self._awaiting_metadata[room]

    # Requests -------------------------------------------------------------

    def admit_prealloc(self, room, rid=None, bootstrap_port=None):
        """A new request handed to SGLang's own DecodePreallocQueue.add, which makes its receiver.

        ``bootstrap_port``: where its prefill peer's bootstrap server is (default: the bench's own); a port nobody
        listens on keeps the request resolving its peer, in ``pending_reqs`` from v0.5.10.
        """
        req = sch.make_req(self.rt, room, rid=rid)
        req.bootstrap_port = self.bootstrap_port if bootstrap_port is None else bootstrap_port
        req.req_pool_idx = None
        if hasattr(req, "kv"):
            req.kv = None
        with self._lock:
            self._pending.append(("prealloc", req))
        sch._until(lambda: self.listed(req.rid) is not None, 10, f"{req.rid} to be listed")
        return req

    def admit(self, room, behaviour=transports.COMPLETE, chunks=1, rid=None):
        """A request whose pages were allocated and sent to prefill, handed to the transfer queue; prefill then sends.

        ``chunks=0``: prefill sends nothing yet (its forward pass still runs), so no chunk of the room is in flight."""
        decode_req, link = self.prepare(room, behaviour, rid)
        req = decode_req.req
        with self._lock:
            self._pending.append(("transfer", decode_req))
        sch._until(lambda: self.listed(req.rid) is not None, 10, f"{req.rid} to be listed")
        if chunks:
            link.send(chunks)
        return req

    def prepare(self, room, behaviour=transports.COMPLETE, rid=None):
        """The request as ``pop_preallocated`` hands it over (pages allocated, sent to prefill), not yet in the
        transfer queue and its prefill not yet sending: (DecodeRequest, Link). ``admit`` queues it through the
        loop; the cost measurement, which runs the passes itself, extends the queue directly."""
        transports.fabric.plan(room, behaviour)
        allocator = self.scheduler.req_to_metadata_buffer_idx_allocator
        slot = allocator.alloc()
        if slot is None:
            raise RuntimeError("no free metadata slot: more requests in flight than the bench's pool holds")
        link = sch.Link(self.rt, self.backend, room, self.prefill_mgr, self.decode_mgr, slot=slot)
        link.bootstrap()
        req = sch.make_req(self.rt, room, rid=rid)
        req.bootstrap_port = self.bootstrap_port
        req.req_pool_idx = slot
        decode_req = construct(self.rt.decode.DecodeRequest, dict(req=req, kv_receiver=link.receiver),
                               "DecodeRequest")
        decode_req.waiting_for_input = True
        decode_req.metadata_buffer_index = slot
        req.decode_request = decode_req
        self.links[req.rid] = link
        self._awaiting_metadata[room] = (decode_req, slot)
        transports.fabric.on_landed(room, self._metadata_landed)
        return decode_req, link

    def queued(self, rid):
        return self.queue_of(rid) is not None

    def queue_of(self, rid):
        s = self.scheduler
        for name, queue in (("prealloc", s.disagg_decode_prealloc_queue), ("transfer", s.disagg_decode_transfer_queue)):
            if any(d.req.rid == rid for d in list(queue.queue)):
                return name
        return None

    def transferred(self, rid):
        return any(r.rid == rid for r in list(self.scheduler.waiting_queue))

    def listed(self, rid):
        try:
            rows = self.listing().get("decode_requests", [])
        except OSError:
            return None
        return next((row for row in rows if row.get("rid") == rid), None)

    def force_fail(self, req, dry_run=False, prefill_stopped=None):
        body = {"rid": req.rid, "bootstrap_room": req.bootstrap_room, "reason": "conformance", "dry_run": dry_run}
        if prefill_stopped is not None:
            body["prefill_stopped"] = prefill_stopped
        return self.ordered(req, body)


def _runtime_dtypes(torch):
    """Dtypes MetadataBuffers reads when built (``torch.uint64`` for the room) that an older torch lacks.

    The loader stands in missing attributes at import time; these are read at run time, so the same stand-in
    (the nearest dtype the torch has: int64, wide enough for the rooms used here) is set before.
    """
    loader = runtime_module.loader
    for name in ("uint64", "uint32", "uint16"):
        if not hasattr(torch, name):
            setattr(torch, name, loader._stand_in_attribute(torch, name))
            loader.loaded.attributes.add(f"torch.{name}")


def _spec_algorithm():
    try:
        spec = runtime_module.loader.load("sglang.srt.speculative.spec_info")[0]
        return spec.SpeculativeAlgorithm.NONE
    except Exception:
        return types.SimpleNamespace(is_none=lambda: True, is_eagle=lambda: False)


def _members(cls):
    return {name for klass in cls.__mro__ for name in vars(klass)}


class PPChannels:
    """SGLang's pyobj messages from each PP stage to the next (point_to_point_pyobj over torch.distributed between
    processes), as one FIFO per pair: messages are matched by order, as there."""

    def __init__(self, size):
        self.size = size
        self._queues = {src: queue.Queue() for src in range(size)}

    def send(self, src, data):
        self._queues[src].put(copy.deepcopy(data))
        return []  # no P2PWork to wait for: the message is delivered

    def recv(self, dst, stopped):
        source = self._queues[(dst - 1) % self.size]
        while True:
            try:
                return source.get(timeout=0.05)
            except queue.Empty:
                if stopped():
                    raise _Stopped() from None


class _Stopped(BaseException):
    """The bench stops while a stage waits for its previous stage."""


class PPDecodeStage(DecodeBench):
    """One stage of a PP decode server: the scheduler also derives from the release's ``SchedulerPPMixin``, and
    its loop runs, per iteration, the decode-queue work of the release's ``event_loop_pp_disagg_decode`` for every
    microbatch, in that loop's order, through SGLang's own methods: ``_pp_pd_get_prealloc_ids`` and
    ``_pp_pd_get_decode_transferred_ids`` (each stage polls its receivers, then intersects with the previous
    stage's rids), ``_pp_pd_send_consensus_bootstrapped_ids`` and ``_pp_pd_send_consensus_release_ids`` (the last
    stage's consensus goes round the ring), and ``process_prealloc_queue`` and ``process_decode_transfer_queue``
    (the passes the plugin hooks there) on the consensus that came round. What stands in: the messages between
    stages (``PPChannels``) and everything of the loop that is not about the decode queues (input requests,
    retraction, batches and their tensors), which a request that never finishes its transfer does not reach.
    """

    def __init__(self, rt, backend, pp_rank, channels, **kwargs):
        self.pp_rank, self.channels = pp_rank, channels
        self.loop_size = channels.size  # pp_size + pp_async_batch_depth, which is 0 by default
        self._pmbs = [None] * self.loop_size
        self._tmbs = [None] * self.loop_size
        self._consensus_prealloc = None
        self._release = None
        super().__init__(rt, backend, **kwargs)

    def _mixins(self):
        pp = runtime_module.loader.load("sglang.srt.managers.scheduler_pp_mixin")[0]
        return (pp.SchedulerPPMixin,) + super()._mixins()

    def _scheduler(self):
        s = super()._scheduler()
        size = self.channels.size
        for target in (s, s.ps):
            target.pp_rank, target.pp_size = self.pp_rank, size
        s.pp_group = types.SimpleNamespace(is_first_rank=self.pp_rank == 0, is_last_rank=self.pp_rank == size - 1,
                                           rank_in_group=self.pp_rank, world_size=size)
        s._pp_send_pyobj_to_next_stage = lambda data, async_send=False: self.channels.send(self.pp_rank, data)
        s._pp_recv_pyobj_from_prev_stage = lambda: self.channels.recv(self.pp_rank, self._stop.is_set)
        return s

    def start(self):
        """Starts the loop without waiting for the plugin: a stage's first hooked pass needs the others running."""
        os.environ.setdefault("SGLANG_WATCHDOG_PLUGIN_HOST", "127.0.0.1")
        os.environ["SGLANG_WATCHDOG_PLUGIN_PORT"] = "0"
        self._thread = threading.Thread(target=self._loop, name=f"bench-pp{self.pp_rank}-scheduler", daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        try:
            super()._loop()
        except _Stopped:
            pass

    def call(self, fn):
        """Runs ``fn`` on the scheduler thread before the next iteration, as SGLang handles its inputs there;
        returns once it ran."""
        done = threading.Event()

        def run():
            try:
                fn()
            finally:
                done.set()

        with self._lock:
            self._calls.append(run)
        if not done.wait(10):
            raise RuntimeError(f"PP stage {self.pp_rank} did not run the call within 10 s")

    def _pass(self, pending):
        self._join(pending)
        self._poll_senders()
        self._write_arrived_metadata()
        for mb_id in range(self.loop_size):
            try:
                self._microbatch(mb_id)
            except Exception:
                logging.getLogger(__name__).exception("SGLang's PP decode queue work raised")
                raise

    def _microbatch(self, mb_id):
        s = self.scheduler
        size = self.channels.size
        next_first_rank_mb_id = (mb_id + size) % self.loop_size
        next_mb_id = (mb_id + 1) % self.loop_size
        prealloc_rids = s._pp_pd_get_prealloc_ids()
        self._pmbs[mb_id] = prealloc_rids
        transferred_rids = s._pp_pd_get_decode_transferred_ids()
        self._tmbs[mb_id] = transferred_rids
        _, self._consensus_prealloc = s._pp_pd_send_consensus_bootstrapped_ids(
            self._pmbs, next_first_rank_mb_id, self._consensus_prealloc, prealloc_rids)
        _, self._release = s._pp_pd_send_consensus_release_ids(
            self._tmbs, next_first_rank_mb_id, self._release, transferred_rids)
        next_consensus_prealloc = next_release = None
        if self._pmbs[next_mb_id] is not None:
            next_consensus_prealloc = s.process_prealloc_queue(s._pp_recv_pyobj_from_prev_stage())
        if self._tmbs[next_mb_id] is not None:
            next_release = s.process_decode_transfer_queue(s._pp_recv_pyobj_from_prev_stage())
        if not s.pp_group.is_last_rank:
            s._pp_send_pyobj_to_next_stage(prealloc_rids, async_send=True)
            s._pp_send_pyobj_to_next_stage(transferred_rids, async_send=True)
        self._release, self._consensus_prealloc = next_release, next_consensus_prealloc
