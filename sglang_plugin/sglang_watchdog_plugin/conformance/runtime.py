"""One SGLang release, loaded and set up to run its PD code in this process on CPU.

``Runtime`` brings up what SGLang's scheduler process would have around the
disaggregation code (server args, a one-rank gloo group, the parallel sizes
and ranks, the attention-DP globals, a PP group), then builds SGLang's own
KV managers, bootstrap server, senders and receivers over the fake
transports, and a scheduler object whose passes are SGLang's own mixin
methods. Where a release keeps its process state is found by looking (the
newest keep it in ``runtime_context``, older ones in globals), never by a
version number.
"""

import copy
import dataclasses
import inspect
import os
import socket
import sys
import time
import types
import typing

from . import loader, transports


BACKENDS = ("nixl", "mooncake")
# Backends of some releases only, in the conformance suite alone: Ascend (from v0.4.10) is Mooncake's
# manager, sender and receiver over another engine (disaggregation/ascend/conn.py).
OPTIONAL_BACKENDS = ("ascend",)
MOONCAKE_LIKE = ("mooncake", "ascend")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runtime:
    """A loaded SGLang and the process state its PD code needs."""

    def __init__(self, src=None, plugin=True):
        folder = loader.use_source(src)
        transports.install()
        # How this release loads plugins: its own framework (entry points,
        # hook registry) where sglang.srt.plugins exists, else the .pth
        # autoloader, which must be in place before the mixins are imported.
        self.plugin_framework = os.path.isfile(os.path.join(folder, "srt", "plugins", "__init__.py"))
        if plugin and not self.plugin_framework:
            _pth_autoload()
        self.prefill, self.decode, self.base, self.utils = loader.load(
            "sglang.srt.disaggregation.prefill",
            "sglang.srt.disaggregation.decode",
            "sglang.srt.disaggregation.base.conn",
            "sglang.srt.disaggregation.utils",
        )
        self.conns = dict(zip(BACKENDS, loader.load(*(f"sglang.srt.disaggregation.{b}.conn" for b in BACKENDS))))
        self.missing = {}  # optional backend -> why this release has none
        for backend in OPTIONAL_BACKENDS:
            try:
                self.conns[backend] = loader.load(f"sglang.srt.disaggregation.{backend}.conn")[0]
            except ImportError as e:
                self.missing[backend] = f"this release has no {backend} backend that imports ({e})"
        if plugin and self.plugin_framework:
            _entry_point()
            loader.load("sglang.srt.plugins")[0].load_plugins()
        self.KVPoll = self.base.KVPoll
        self.poll_names = {int(v): k for k, v in vars(self.KVPoll).items()
                           if not k.startswith("_") and isinstance(v, int)}
        self.Mode = self.utils.DisaggregationMode
        self.version = loader.loaded.version
        self.bootstrap_port = free_port()
        self.server_args = self._server_args()
        self._process_state()
        self._bootstrap_servers = {}
        self._extra_bootstrap_servers = []

    def pass_needs_requests(self):
        """Whether this release's event loop calls the inflight pass only with requests queued.

        Read from the loaded event loop: older ones guard the call with
        ``len(self.disagg_prefill_inflight_queue) > 0`` (and their pass asserts
        it); newer ones call it on every iteration.
        """
        Mixin = self.prefill.SchedulerDisaggregationPrefillMixin
        for name in dir(Mixin):
            if name.startswith("event_loop") and "prefill" in name:
                try:
                    source = inspect.getsource(inspect.unwrap(getattr(Mixin, name)))
                except (OSError, TypeError):
                    continue
                if "len(self.disagg_prefill_inflight_queue) > 0" in source:
                    return True
        return False

    # Process state --------------------------------------------------------

    def _server_args(self):
        server_args_module = loader.load("sglang.srt.server_args")[0]
        ServerArgs = server_args_module.ServerArgs
        fields = dict(
            model_path="dummy", host="127.0.0.1", port=free_port(), device="cpu",
            disaggregation_bootstrap_port=self.bootstrap_port, tp_size=1, pp_size=1, dp_size=1,
            disaggregation_mode="prefill",
        )
        fields = {k: v for k, v in fields.items() if k in ServerArgs.__dataclass_fields__}
        context = self._runtime_context()
        if context is not None and hasattr(context.get_context(), "override_server_args"):
            # Kept referenced: the override is undone when collected.
            self._server_args_override = context.get_context().override_server_args(
                **{k: v for k, v in fields.items() if k != "model_path"})
            return self._server_args_override.install()
        # Older releases: a ServerArgs without __post_init__ (it would load a model config).
        args = object.__new__(ServerArgs)
        for field in dataclasses.fields(ServerArgs):
            if field.default is not dataclasses.MISSING:
                value = field.default
            elif field.default_factory is not dataclasses.MISSING:
                value = field.default_factory()
            else:
                value = None
            object.__setattr__(args, field.name, value)
        for key, value in fields.items():
            object.__setattr__(args, key, value)
        for module in ("sglang.srt.managers.schedule_batch", "sglang.srt.server_args"):
            setter = getattr(sys.modules.get(module), "set_global_server_args_for_scheduler", None)
            if setter is not None:
                setter(args)
        return args

    def _runtime_context(self):
        try:
            return loader.load("sglang.srt.runtime_context")[0]
        except ImportError:
            return None

    def _process_state(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
        self.group = dist.new_group([0], backend="gloo")
        context = self._runtime_context()
        if context is not None and hasattr(context, "get_parallel"):
            parallel = context.get_parallel()
            fields = getattr(context, "_PARALLEL_FIELDS", ())
            values = {name: (1 if name.endswith("_size") else 0) for name in fields
                      if name.endswith(("_size", "_rank"))}
            # Kept referenced: collecting the context manager undoes the override.
            self._parallel_override = parallel.override(**values)
            self._parallel_override.__enter__()
        dp_attention = loader.load("sglang.srt.layers.dp_attention")[0]
        for name in dir(dp_attention):
            if name.startswith("_ATTN_") and name.endswith(("_SIZE", "_RANK")):
                setattr(dp_attention, name, 1 if name.endswith("_SIZE") else 0)
            if name in ("_ENABLE_DP_ATTENTION_FLAG",):
                setattr(dp_attention, name, False)
        parallel_state = loader.load("sglang.srt.distributed.parallel_state")[0]
        coordinator = types.SimpleNamespace(
            world_size=1, rank_in_group=0, rank=0, cpu_group=self.group, device_group=self.group,
            is_first_rank=True, is_last_rank=True, first_rank=0, last_rank=0, ranks=[0],
        )
        for name in ("_PP", "_TP", "_ATTN_TP", "_ATTN_CP", "_MOE_EP", "_MOE_TP"):
            if hasattr(parallel_state, name) and getattr(parallel_state, name) is None:
                setattr(parallel_state, name, coordinator)

    # KV managers ----------------------------------------------------------

    # Requests in flight at once per bench: metadata slots, and 4 KV pages each.
    slots = 64

    def kv_args(self, backend, mode, page_size=1):
        """SGLang's KVArgs for a one-layer CPU pool: every field it declares, with the ones that matter filled in."""
        import numpy as np

        KVArgs = self.base.KVArgs
        args = KVArgs()
        for name, hint in (_hints(KVArgs) or {}).items():
            setattr(args, name, _default_for(hint))
        item_len, aux_slots = 256, self.slots
        pages = 4 * aux_slots
        self._buffers = getattr(self, "_buffers", [])
        kv = np.zeros(pages * page_size * item_len, dtype=np.uint8)
        aux = np.zeros(aux_slots * 64, dtype=np.uint8)
        self._buffers += [kv, aux]
        values = dict(
            engine_rank=0, kv_data_ptrs=[kv.ctypes.data], kv_data_lens=[kv.nbytes], kv_item_lens=[item_len],
            kv_layer_ids=[0], aux_data_ptrs=[aux.ctypes.data], aux_data_lens=[aux.nbytes], aux_item_lens=[64],
            page_size=page_size, kv_head_num=1, total_kv_head_num=1, gpu_id=0, ib_device=None, ib_traffic_class=None,
            system_dp_rank=0, pp_rank=0, prefill_start_layer=0, prefill_end_layer=1, kv_cache_dtype_str="bfloat16",
            decode_tp_size=1, prefill_pp_size=1, state_types=[], state_data_ptrs=[], state_data_lens=[],
            state_item_lens=[], state_layer_ids=[], state_dim_per_tensor=[], state_slice_outer_counts=[],
            state_conv_shard_groups=[], is_hybrid_mla_backend=False, state_type="none",
        )
        for key, value in values.items():
            setattr(args, key, value)
        return args

    def manager(self, backend, mode, attn_tp=(0, 1), server_args=None):
        """SGLang's KV manager of this backend and mode.

        ``attn_tp=(rank, size)`` builds the manager of that rank of an attention
        TP group (its engine rank too, as the schedulers set it), with the ranks
        in place while SGLang reads them; ``server_args`` names another bootstrap
        server (a group of another size registers with one of its own).
        """
        conn = self.conns[backend]
        Manager = _class_named(conn, f"{backend}kvmanager")
        if server_args is None:
            self.bootstrap_server(backend)
            server_args = self._server_args_for(backend)
        mode = self.Mode.PREFILL if mode == "prefill" else self.Mode.DECODE
        if backend == "mooncake":
            self._shared_mooncake_engine()  # Ascend's manager makes its own engine (init_engine)
        kv_args = self.kv_args(backend, mode)
        kv_args.engine_rank = attn_tp[0]
        # is_mla_backend on Mooncake (and Ascend, its subclass): its MHA layout splits the pool's buffers into K
        # and V halves, which leaves the one-buffer pool here no layer to send, so its KV would never reach the
        # transport;
        # the MLA layout sends that buffer as the one layer it is. NIXL sends it either way.
        args = [kv_args, mode, server_args, backend in MOONCAKE_LIKE]
        args = args[: len(inspect.signature(Manager).parameters)]
        with self.attn_tp(*attn_tp):
            return self._build(Manager, args)

    def _build(self, Manager, args):
        try:
            return Manager(*args)
        except ValueError as e:
            if "max_workers" not in str(e):
                raise
            # A pool sized from the CPU count that comes out 0 on a small machine (v0.4.6 Mooncake:
            # min(os.cpu_count() // 4, 16)); a serving host has the CPUs, so build it as on 4.
            real = os.cpu_count
            os.cpu_count = lambda: max(4, real() or 1)
            try:
                return Manager(*args)
            finally:
                os.cpu_count = real

    def attn_tp(self, rank, size):
        """A context in which SGLang reads this attention TP rank and size, where the release keeps them.

        The newest releases read them from runtime_context's parallel state,
        older ones from dp_attention's globals; both are set (where they
        exist) and put back on exit. The process runs one rank of each group:
        only what SGLang reads while building a manager is changed.
        """
        import contextlib

        stack = contextlib.ExitStack()
        context = self._runtime_context()
        if context is not None and hasattr(context, "get_parallel"):
            values = {k: v for k, v in dict(attn_tp_rank=rank, attn_tp_size=size, tp_rank=rank, tp_size=size).items()
                      if k in getattr(context, "_PARALLEL_FIELDS", ())}
            stack.enter_context(context.get_parallel().override(**values))
        dp_attention = loader.load("sglang.srt.layers.dp_attention")[0]
        saved = {}
        for name, value in (("_ATTN_TP_RANK", rank), ("_ATTN_TP_SIZE", size)):
            if hasattr(dp_attention, name):
                saved[name] = getattr(dp_attention, name)
                setattr(dp_attention, name, value)
        stack.callback(lambda: [setattr(dp_attention, k, v) for k, v in saved.items()])
        # Releases in between read them from parallel_state's attention TP group (world_size, rank_in_group):
        # the stand-in group _process_state put there, as that rank sees it.
        parallel_state = loader.load("sglang.srt.distributed.parallel_state")[0]
        group = getattr(parallel_state, "_ATTN_TP", None)
        if isinstance(group, types.SimpleNamespace):
            parallel_state._ATTN_TP = types.SimpleNamespace(**{**vars(group), "world_size": size, "rank_in_group": rank})
            stack.callback(lambda: setattr(parallel_state, "_ATTN_TP", group))
        return stack

    def own_bootstrap_server(self, backend, tp_size):
        """A bootstrap server of this backend for one more prefill server (a group of ``tp_size`` ranks),
        and the server args that name it: SGLang's server takes its attention TP size from its first
        registration, so a TP2 group cannot share the TP1 benches' server."""
        Server = _class_named(self.conns[backend], f"{backend}kvbootstrapserver")
        kwargs = {"host": "127.0.0.1"} if "host" in inspect.signature(Server).parameters else {}
        port = free_port()
        server = Server(port=port, **kwargs)
        _wait_listening(port)
        args = copy.copy(self.server_args)
        object.__setattr__(args, "disaggregation_bootstrap_port", port)
        if hasattr(args, "tp_size"):
            object.__setattr__(args, "tp_size", tp_size)
        self._extra_bootstrap_servers.append(server)  # kept referenced, as the per-backend ones
        return server, port, args

    def _server_args_for(self, backend):
        """The server args with this backend's bootstrap port: each backend has its own bootstrap server here."""
        port = self.bootstrap_server(backend)[1]
        if port == self.server_args.disaggregation_bootstrap_port:
            return self.server_args
        args = copy.copy(self.server_args)
        object.__setattr__(args, "disaggregation_bootstrap_port", port)  # past the published args' write guard
        return args

    def _shared_mooncake_engine(self):
        """Newer releases share one Mooncake engine per process, set up by parallel_state; older ones make their own."""
        for name in ("sglang.srt.distributed.device_communicators.mooncake_transfer_engine",
                     "sglang.srt.distributed.parallel_state"):
            try:
                module = loader.load(name)[0]
            except ImportError:
                continue
            init = getattr(module, "init_mooncake_transfer_engine", None)
            if init is not None:
                params = inspect.signature(init).parameters
                init(**{k: v for k, v in dict(hostname="127.0.0.1", gpu_id=0, ib_device=None).items() if k in params})
                return

    def bootstrap_server(self, backend):
        if backend not in self._bootstrap_servers:
            conn = self.conns[backend]
            Server = _class_named(conn, f"{backend}kvbootstrapserver")
            params = inspect.signature(Server).parameters
            kwargs = {"host": "127.0.0.1"} if "host" in params else {}
            port = self.bootstrap_port if not self._bootstrap_servers else free_port()
            self._bootstrap_servers[backend] = (Server(port=port, **kwargs), port)
            _wait_listening(port)
        return self._bootstrap_servers[backend]


_PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pth_autoload():
    """Processes the plugin's .pth as site does at interpreter start, unless the installed one already did."""
    import site

    if any(type(finder).__name__ == "_DisaggregationFinder" for finder in sys.meta_path):
        return
    pth = os.path.join(_PLUGIN_DIR, "sglang_watchdog_plugin.pth")
    if not os.path.isfile(pth):
        raise FileNotFoundError(f"{pth} is missing: the plugin cannot be loaded as SGLang releases without a "
                                "plugin framework load it")
    site.addsitedir(_PLUGIN_DIR)


def _entry_point():
    """Declares the plugin's entry point as pip would, where the package is not installed (a source checkout)."""
    from importlib.metadata import entry_points

    if any(ep.name == "sglang_watchdog" for ep in entry_points(group="sglang.srt.plugins")):
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="sglang-watchdog-plugin-dist-")
    info = os.path.join(folder, "sglang_watchdog_plugin-0.0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: sglang-watchdog-plugin\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\nsglang_watchdog = sglang_watchdog_plugin:register\n")
    sys.path.append(folder)


def _wait_listening(port, timeout=10.0):
    """Older bootstrap servers return before their thread listens; a manager registering then is refused."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang's bootstrap server on 127.0.0.1:{port} did not start listening")
            time.sleep(0.02)


def _hints(cls):
    try:
        return typing.get_type_hints(cls)
    except Exception:
        return None


def _default_for(hint):
    origin = typing.get_origin(hint)
    if origin in (list, typing.List):
        return []
    if hint is int:
        return 0
    if hint is bool:
        return False
    if hint is str:
        return ""
    return None


def _class_named(module, lowered):
    for name, value in vars(module).items():
        if isinstance(value, type) and name.lower() == lowered:
            return value
    raise AttributeError(f"{module.__name__} has no {lowered}")
