"""One PP stage of a prefill server, running the release's own PP prefill event loop, for scenarios.

``PPPrefillStage`` builds a scheduler derived from the release's
``SchedulerPPMixin`` (where it has one) and ``SchedulerDisaggregationPrefillMixin``
and runs, on its own thread, the release's own ``event_loop_pp_disagg_prefill``
(``managers/scheduler_pp_mixin.py`` from v0.5.10, ``disaggregation/prefill.py``
in v0.5.3): every microbatch, in that loop's order, the stage's transferred
rids (each stage polls its own senders and intersects with the previous
stage's), the last stage's consensus sent round the ring, and
``process_disagg_prefill_inflight_queue(rids)`` on the consensus that came
round, which the plugin hooks. Each stage has its own prefill and decode KV
managers, registered with a bootstrap server of its own (SGLang's bootstrap
server holds one prefill manager per rank).

What stands in, and why:

* the PP group's point-to-point pyobj messages (``point_to_point_pyobj`` over
  torch.distributed between processes): ``decode_bench.PPChannels``, one FIFO
  per pair of stages, matched by order as there;
* everything of the loop that is about batches, not the PD queues (no request
  is ever scheduled here: the requests join the inflight queue as a finished
  forward pass leaves them): ``recv_requests`` (nothing comes in on the first
  stage, whose loop paces itself here; a later stage receives the previous
  stage's, as SGLang's does there), ``process_input_requests`` (where the bench's
  admissions and SGLang's input handling, e.g. an abort, run on the scheduler
  thread), ``process_prefill_chunk``, ``get_new_batch_prefill`` (no batch),
  the MLP sync, the output tensors' send and receive, and the idle self-check
  (memory and tree checks);
* the bootstrap queue: empty (``pop_bootstrapped`` returns nothing), as every
  request here has finished its handshake before its forward pass;
* as on the other benches: the radix tree, the stream to the tokenizer, the
  metrics collector (scheduler.py).
"""

import inspect
import threading
import types

from . import bench as bench_module
from . import decode_bench
from . import runtime as runtime_module
from . import scheduler as sch

LOOP = "event_loop_pp_disagg_prefill"


def pp_mixin():
    try:
        module = runtime_module.loader.load("sglang.srt.managers.scheduler_pp_mixin")[0]
    except ImportError:
        return None
    return getattr(module, "SchedulerPPMixin", None)


def loop_owner(rt):
    """The class whose ``event_loop_pp_disagg_prefill`` the release runs, or None."""
    for cls in (pp_mixin(), rt.prefill.SchedulerDisaggregationPrefillMixin):
        if cls is not None and LOOP in vars(cls):
            return cls
    return None


def cannot_run(owner):
    """Why the release's loop cannot run here, or None: the modules it imports when it starts must load on CPU.

    (v0.5.3's loop imports ``GenerationBatchResult`` from ``sglang.srt.managers.scheduler``, a module whose
    imports reach ``from sglang import ServerArgs``, which the loader cannot give from a source folder.)
    """
    import ast

    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(inspect.unwrap(getattr(owner, LOOP)))))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        try:
            module = runtime_module.loader.load(node.module)[0]
            for alias in node.names:
                getattr(module, alias.name)
        except Exception as e:
            return (f"this release's {LOOP} imports {', '.join(a.name for a in node.names)} from {node.module} "
                    f"when it starts, which cannot be imported on CPU here ({type(e).__name__}: {e})")
    return None


class _LoopStandIns:
    """The scheduler methods of the loop that are about batches and inputs, not the PD queues (see above)."""

    def recv_requests(self):
        return self._stage._next_iteration()

    def process_input_requests(self, recv_reqs):
        self._stage._inputs()

    def process_prefill_chunk(self, *args, **kwargs):
        return None

    def get_new_batch_prefill(self, *args, **kwargs):
        if self._stage.plans:  # releases whose loop reads a plan: .batch_to_run, .running_batch
            running = args[0] if args else kwargs.get("running_batch", self.running_batch)
            return types.SimpleNamespace(batch_to_run=None, running_batch=running)
        return None

    def maybe_prepare_mlp_sync_batch(self, batch, *args, **kwargs):
        return batch

    def _pp_commit_send_output_work_and_preprocess_output_tensors(self, *args, **kwargs):
        return None, None, None  # (outputs, batch result, d2h event): no batch ran

    def on_idle(self, *args, **kwargs):
        return None

    def self_check_during_idle(self, *args, **kwargs):
        return None

    def check_memory(self, *args, **kwargs):
        return None

    def check_tree_cache(self, *args, **kwargs):
        return None


class PPPrefillStage(bench_module.Bench):
    def __init__(self, rt, backend, pp_rank, channels, pass_interval=0.005):
        self.rt, self.backend = rt, backend
        self.pp_rank, self.channels = pp_rank, channels
        self.owner = loop_owner(rt)
        if self.owner is None:
            raise RuntimeError(f"this release has no {LOOP}")
        self.plans = "batch_to_run" in inspect.getsource(getattr(self.owner, LOOP))
        _, self.bootstrap_port, args = rt.own_bootstrap_server(backend, 1)
        self.prefill_mgr = rt.manager(backend, "prefill", server_args=args)
        self.decode_mgr = rt.manager(backend, "decode", server_args=args)
        self.pass_interval = pass_interval
        self.passes = 0  # microbatch iterations of the stage's loop
        self.errors = []  # exceptions SGLang's loop raised: each would kill a real scheduler
        self._pending = []
        self._calls = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.links = {}
        self.destinations = {}  # a stage writes to its one decode manager only
        self.after_pass = []
        self.scheduler = self._scheduler()

    def _scheduler(self):
        rt = self.rt
        mixins = tuple(c for c in (pp_mixin(), rt.prefill.SchedulerDisaggregationPrefillMixin) if c is not None)
        cls = type("PPPrefillScheduler", (_LoopStandIns,) + mixins,
                   {"stream_output": sch._record_stream, "__init__": lambda self: None})
        s = cls()
        s._stage = self
        sch._common(s, rt, self.backend, rt.Mode.PREFILL)
        s.server_args = decode_bench._Args(rt.server_args, disaggregation_transfer_backend=self.backend,
                                           disaggregation_mode="prefill")
        s.disagg_prefill_inflight_queue = []
        s.req_to_metadata_buffer_idx_allocator = rt.utils.ReqToMetadataIdxAllocator(rt.slots)
        s.disagg_prefill_bootstrap_queue = types.SimpleNamespace(
            kv_manager=self.prefill_mgr, queue=[],
            req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
            pop_bootstrapped=lambda *a, **k: ([], []) if k.get("return_failed_reqs") else [])
        s.kv_manager = self.prefill_mgr
        s.waiting_queue = []
        s.last_batch = s.cur_batch = None
        s.new_token_ratio = s.init_new_token_ratio = 0.0
        s.request_receiver = types.SimpleNamespace(recv_requests=s.recv_requests)
        s.dp_attn_adapter = types.SimpleNamespace(maybe_prepare_mlp_sync_batch=lambda batch, *a, **k: batch)
        s.tp_worker = types.SimpleNamespace(get_tp_group=lambda: types.SimpleNamespace(cpu_group=self.rt.group))
        s.enable_staging = False
        size = self.channels.size
        for target in (s, s.ps):
            target.pp_rank, target.pp_size = self.pp_rank, size
        s.pp_group = types.SimpleNamespace(is_first_rank=self.pp_rank == 0, is_last_rank=self.pp_rank == size - 1,
                                           rank_in_group=self.pp_rank, world_size=size)
        send = lambda data, *a, **k: self.channels.send(self.pp_rank, data)
        recv = lambda *a, **k: self.channels.recv(self.pp_rank, self._stop.is_set)
        s._pp_send_pyobj_to_next_stage = s.send_pyobj_to_next_stage = send
        s._pp_recv_pyobj_from_prev_stage = s.recv_pyobj_from_prev_stage = recv
        return s

    # The loop ------------------------------------------------------------

    def start(self):
        """Starts the stage's loop without waiting for the plugin: its first hooked pass needs the other stages."""
        import os

        os.environ.setdefault("SGLANG_WATCHDOG_PLUGIN_HOST", "127.0.0.1")
        os.environ["SGLANG_WATCHDOG_PLUGIN_PORT"] = "0"
        self._thread = threading.Thread(target=self._run, name=f"pp{self.pp_rank}-prefill-scheduler", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        try:
            getattr(self.scheduler, LOOP)()
        except decode_bench._Stopped:
            pass
        except Exception as e:  # a real scheduler process dies here
            self.errors.append(e)

    def _next_iteration(self):
        """The start of a microbatch iteration (the loop's recv_requests): nothing comes in on the first stage;
        a later stage receives what the previous stage passed on (SGLang's recv_requests there), which paces it."""
        if self._stop.is_set():
            raise decode_bench._Stopped()
        self.passes += 1
        if self.pp_rank == 0:
            self._stop.wait(self.pass_interval)
            return []
        return self.channels.recv(self.pp_rank, self._stop.is_set)

    def _inputs(self):
        """The loop's process_input_requests: the bench's calls, then its admissions join the inflight queue."""
        with self._lock:
            pending, self._pending = self._pending, []
            calls, self._calls = self._calls, []
        for fn in calls:
            fn()
        self.scheduler.disagg_prefill_inflight_queue.extend(pending)

    def hold(self):
        raise NotImplementedError("a PP stage cannot hold alone: the other stages wait on its messages")

    # Requests -------------------------------------------------------------

    def prepare(self, room, behaviour=None, chunks=1, rid=None, link=None):
        from . import transports

        if link is not None:
            raise ValueError("a PP stage has no decode destinations besides its own decode manager")

        transports.fabric.plan(room, behaviour or transports.COMPLETE)
        slot = self.scheduler.req_to_metadata_buffer_idx_allocator.alloc()
        if slot is None:
            raise RuntimeError("no free metadata slot: more requests in flight than the bench's pool holds")
        link = sch.Link(self.rt, self.backend, room, self.prefill_mgr, self.decode_mgr, slot=slot,
                        bootstrap_port=self.bootstrap_port)
        link.bootstrap()
        link.send(chunks)
        req = sch.make_req(self.rt, room, rid=rid, sender=link.sender)
        req.metadata_buffer_index = slot
        self.links[req.rid] = link
        return req

    def free_metadata_slots(self):
        allocator = self.scheduler.req_to_metadata_buffer_idx_allocator
        size = getattr(allocator, "available_size", None)
        return size() if callable(size) else len(allocator.free_slots)
