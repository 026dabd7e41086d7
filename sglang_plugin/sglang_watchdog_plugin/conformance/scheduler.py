"""SGLang's own prefill and decode passes, run on a scheduler object with just the state they read.

``PrefillScheduler`` and ``DecodeScheduler`` derive from SGLang's
``SchedulerDisaggregationPrefillMixin`` / ``SchedulerDisaggregationDecodeMixin``,
so ``process_disagg_prefill_inflight_queue`` and the decode passes are the
release's own code, hooked by the plugin exactly as that release loads it.
What stands in is what lies outside the disaggregation code: the radix tree
(``cache_finished_req`` records the release and clears the request's pool
slots, as SGLang's ChunkCache does), the stream to the tokenizer (recorded),
and the metrics collector (counting ``increment_transfer_failed_reqs``).
The metadata buffer allocator is SGLang's own.
"""

import inspect
import threading
import time
import types

import numpy as np

from . import runtime as runtime_module
from . import transports


class TreeCache:
    """Stands in for the radix tree: what SGLang's release path hands back, and when (told to the page ledger)."""

    def __init__(self, side="prefill", scheduler=None):
        self.released = []  # rids, in order
        self.lock = threading.Lock()
        self.side = side
        self.scheduler = scheduler  # whose rank (in a TP group) the freed pages are

    def cache_finished_req(self, req, *args, **kwargs):
        with self.lock:
            self.released.append(req.rid)
        s = self.scheduler
        rank = getattr(s, "tp_rank", None) if getattr(s, "tp_size", 1) > 1 else None
        transports.ledger.freed(self.side, req, getattr(s, "transfer_backend", None), rank)
        req.req_pool_idx = None
        if hasattr(req, "kv"):
            req.kv = None

    def supports_mamba(self):
        return False

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class Metrics:
    """SGLang's scheduler metrics collector, as far as the PD passes use it: the counters they bump."""

    def __init__(self):
        self.transfer_failed_reqs = 0
        self.enable_metrics = True

    def increment_transfer_failed_reqs(self, *args, **kwargs):
        self.transfer_failed_reqs += 1

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class Link:
    """One request's prefill sender and decode receiver, handshaken through SGLang's bootstrap server."""

    def __init__(self, rt, backend, room, prefill_mgr, decode_mgr, slot, pages=4, bootstrap_port=None, rank=None):
        """``bootstrap_port``: another bootstrap server than the backend's; ``rank``: the prefill rank of a TP
        group this link is the share of (its decode memory is tagged with it, so a plan can target it)."""
        conn = rt.conns[backend]
        addr = f"127.0.0.1:{bootstrap_port or rt.bootstrap_server(backend)[1]}"
        Sender = runtime_module._class_named(conn, f"{backend}kvsender")
        Receiver = runtime_module._class_named(conn, f"{backend}kvreceiver")
        self.rt, self.room, self.pages = rt, room, pages
        self.sender = Sender(**_accepted(Sender, mgr=prefill_mgr, bootstrap_addr=addr, bootstrap_room=room,
                                          dest_tp_ranks=[0], pp_rank=0))
        self.receiver = Receiver(**_accepted(Receiver, mgr=decode_mgr, bootstrap_addr=addr, bootstrap_room=room,
                                             prefill_dp_rank=0, data_parallel_rank=0))
        # Each request writes its own decode pages and metadata slot, so a transfer is known by where it writes.
        self.dtype = _index_dtype(self.receiver)
        self.kv_indices = np.arange(slot * pages, (slot + 1) * pages, dtype=self.dtype)
        self.aux_index = slot
        args = decode_mgr.kv_args
        item = args.kv_item_lens[0]
        transports.fabric.claim(room, args.kv_data_ptrs[0] + slot * pages * item, pages * item, rank=rank)
        transports.fabric.claim(room, args.aux_data_ptrs[0] + slot * args.aux_item_lens[0], args.aux_item_lens[0],
                                aux=True, rank=rank)
        # The page ledger: decode pages are the pool's (its manager's) pages this receiver gives prefill.
        self.rank, self.pool = rank, id(decode_mgr)
        transports.ledger.owns("decode", room, ((self.pool, int(p)) for p in self.kv_indices), rank)

    def bootstrap(self, timeout=10.0):
        """What decode's prealloc does: fetch the prefill's layout, then send the destination pages."""
        receiver, mgr = self.receiver, self.receiver.kv_mgr
        if hasattr(mgr, "try_ensure_parallel_info"):
            _until(lambda: mgr.try_ensure_parallel_info(receiver.bootstrap_addr), timeout, "prefill parallel info")
        if hasattr(receiver, "send_metadata"):
            if "prefill_dp_rank" in inspect.signature(receiver.init).parameters:
                receiver.init(0)
            receiver.send_metadata(self.kv_indices, self.aux_index)
        else:
            receiver.init(self.kv_indices, self.aux_index)
        Poll = self.rt.KVPoll
        _until(lambda: self.sender.poll() != Poll.Bootstrapping, timeout, "the prefill sender to leave Bootstrapping")

    def send(self, chunks=1):
        """What the scheduler's send_kv_chunk does at the end of a forward pass: init, then the chunks."""
        init = self.sender.init
        params = inspect.signature(init).parameters
        init(*[self.pages, self.aux_index][: len(params)])
        per = max(1, self.pages // chunks)
        transports.fabric.chunk_pages(self.room, [min(per, self.pages - start) for start in range(0, self.pages, per)])
        # The page ledger: each chunk reads its slice of the request's prefill pages and writes the same slice of
        # the decode pages the receiver gave.
        transports.ledger.owns("prefill", self.room, range(self.pages), self.rank)
        transports.fabric.chunk_indices(self.room, [
            (range(start, min(self.pages, start + per)),
             [(self.pool, int(p)) for p in self.kv_indices[start:start + per]]) for start in range(0, self.pages, per)],
            self.rank)
        # Earliest releases: send(kv_indices, index_slice, is_last), the page slice and the last-chunk flag
        # given by the caller (send_kv_chunk) rather than counted by the sender.
        sliced = "index_slice" in inspect.signature(self.sender.send).parameters
        for start in range(0, self.pages, per):
            end = min(self.pages, start + per)
            indices = np.arange(start, end, dtype=self.dtype)
            if sliced:
                self.sender.send(indices, slice(start, end), end >= self.pages)
            else:
                self.sender.send(indices)


def _index_dtype(receiver):
    """The dtype the release's receiver declares for KV indices (it ships their bytes; the peer reads them so).

    v0.4.6 declares and reads int64, later releases int32.
    """
    for name in ("send_metadata", "init"):
        fn = getattr(receiver, name, None)
        param = inspect.signature(fn).parameters.get("kv_indices") if fn is not None else None
        if param is not None and param.annotation is not inspect.Parameter.empty:
            text = str(param.annotation)
            if "int64" in text:
                return np.int64
            if "int32" in text:
                return np.int32
    return np.int32


class PrefillScheduler:
    """Built by ``prefill_scheduler``: a class derived from the release's prefill mixin."""


def prefill_scheduler(rt, backend, manager):
    Mixin = rt.prefill.SchedulerDisaggregationPrefillMixin
    cls = type("PrefillScheduler", (Mixin,), {
        "stream_output": _record_stream,
        "__init__": lambda self: None,
    })
    s = cls()
    _common(s, rt, backend, rt.Mode.PREFILL)
    s.disagg_prefill_inflight_queue = []
    s.req_to_metadata_buffer_idx_allocator = rt.utils.ReqToMetadataIdxAllocator(rt.slots)
    # The bootstrap queue holds the allocator too: the earliest releases free metadata slots through it.
    s.disagg_prefill_bootstrap_queue = types.SimpleNamespace(
        kv_manager=manager, queue=[], req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator)
    s.kv_manager = manager
    return s


def _common(s, rt, backend, mode):
    s.disaggregation_mode = mode
    s.transfer_backend = backend
    s.server_args = types.SimpleNamespace(disaggregation_transfer_backend=backend,
                                          disaggregation_mode=mode.value if hasattr(mode, "value") else mode)
    ranks = dict(tp_rank=0, pp_rank=0, dp_rank=0, pp_size=1, tp_size=1, attn_tp_rank=0, attn_cp_rank=0,
                 attn_tp_size=1, attn_cp_size=1, attn_dp_rank=0, moe_ep_rank=0)
    s.ps = types.SimpleNamespace(**ranks)
    for key, value in ranks.items():
        setattr(s, key, value)
    s.attn_tp_cpu_group = s.attn_cp_cpu_group = s.tp_cpu_group = rt.group
    s.tree_cache = TreeCache("prefill" if mode == rt.Mode.PREFILL else "decode", s)
    s.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=1, free=lambda *a, **k: None)
    s.streamed = []
    s.output_streamer = types.SimpleNamespace(stream_output=lambda reqs, *a, **k: _record_stream(s, reqs))
    s.metrics_collector = Metrics()
    s.metrics_reporter = types.SimpleNamespace(enable_metrics=True, kv_transfer_latency_ms=None,
                                               kv_transfer_speed_gb_s=None)
    s.enable_metrics = True
    s.enable_trace = False


def _record_stream(self, reqs, *args, **kwargs):
    self.streamed.extend(reqs)


def make_req(rt, room, rid=None, sender=None, input_len=4):
    """A real ``Req`` of the release, in the state the prefill forward pass leaves it in."""
    schedule_batch = runtime_module.loader.load("sglang.srt.managers.schedule_batch")[0]
    sampling = runtime_module.loader.load("sglang.srt.sampling.sampling_params")[0]
    Req = schedule_batch.Req
    req = Req(**_accepted(Req, rid=rid or f"req-{room}", origin_input_text="", origin_input_ids=list(range(input_len)),
                          sampling_params=sampling.SamplingParams(), bootstrap_host="127.0.0.1",
                          bootstrap_port=rt.bootstrap_port, bootstrap_room=room))
    req.disagg_kv_sender = sender
    req.metadata_buffer_index = -1
    req.req_pool_idx = 0
    if "kv" in vars(req) or hasattr(type(req), "kv"):
        req.kv = types.SimpleNamespace(kv_allocated_len=input_len)
    return req


def _accepted(fn, **kwargs):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.01)
