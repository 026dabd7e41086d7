"""A TP2 prefill group made of SGLang's own PD code, both ranks in this process, with the plugin on each.

Two prefill KV managers (engine ranks 0 and 1 of an attention TP group of 2)
register with a bootstrap server of their own, as SGLang's prefill ranks do;
two decode KV managers (a TP2 decode) fetch the group's layout from it, and
each decode rank's receiver handshakes with its prefill peer (SGLang's rank
mapping: equal TP sizes, decode rank r pulls from prefill rank r). A room's
KV is sent by both prefill ranks, each its own share into its own decode
peer's pages, from its own transfer workers, counted in its own manager's
``_staging_outstanding``.

Each rank has its own scheduler object whose inflight pass is SGLang's own,
hooked by the plugin as that release loads it: rank 0 is the plugin's
leader (listener), rank 1 (attn_tp_rank=1, attn_tp_size=2) is a non-leader
prefill rank, which the hook starts publishing its transfers (peers.py).

What cannot be had in one process is torch.distributed's collective: the
pass MIN-reduces its polls over the attention TP group
(``poll_and_all_reduce_attn_cp_tp_group``), and torch.distributed holds one
rank per process (a gloo group of two needs two processes). ``PairGroup``
stands in for that one collective: each rank's scheduler thread runs its
pass, and the all-reduce over the TP group meets the other rank's at a
barrier and takes the element-wise MIN of both, which is what gloo's
all_reduce(MIN) returns on every rank. The CP group is the process's real
one-rank gloo group. Both ranks take newly admitted requests at the same
pass (a barrier at the start of each pass), as SGLang's ranks receive the
same requests in the same order.
"""

import os
import tempfile
import threading
import time

from . import bench, runtime
from . import scheduler as sch
from . import transports

_BARRIER_TIMEOUT_S = 60.0  # a rank that never comes back: fail the scene, never hang the suite


class _Member:
    """One rank's handle on a PairGroup: what SGLang's code passes as its attention TP cpu group."""

    def __init__(self, pair, rank):
        self.pair, self.rank = pair, rank

    def all_reduce(self, tensor, op):
        import torch
        import torch.distributed as dist

        if op != dist.ReduceOp.MIN:
            raise NotImplementedError(f"the in-process pair group only MIN-reduces, not {op}")
        pair = self.pair
        pair.slots[self.rank] = tensor.clone()
        pair.barrier.wait()
        result = torch.stack(list(pair.slots)).min(dim=0).values
        pair.barrier.wait()  # nobody writes the next call's slot before both have read this one's
        tensor.copy_(result)


class PairGroup:
    """torch.distributed's all_reduce over a group of ``size`` ranks that are threads of this process."""

    def __init__(self, size=2):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=_BARRIER_TIMEOUT_S)
        self.slots = [None] * size

    def member(self, rank):
        return _Member(self, rank)


def _install_all_reduce():
    """Routes torch.distributed.all_reduce on a PairGroup member to it; every other group as before."""
    import torch.distributed as dist

    original = dist.all_reduce
    if getattr(original, "__pair_group__", False):
        return

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if isinstance(group, _Member):
            group.all_reduce(tensor, op)
            return None
        return original(tensor, op=op, group=group, async_op=async_op)

    all_reduce.__pair_group__ = True
    dist.all_reduce = all_reduce


class Tp2Group:
    """The two prefill ranks (and their decode peers) of one prefill server, and their scheduler loops."""

    size = 2

    def __init__(self, rt, backend, pass_interval=0.005):
        _install_all_reduce()
        self.rt, self.backend, self.pass_interval = rt, backend, pass_interval
        self._server, self.bootstrap_port, args = rt.own_bootstrap_server(backend, self.size)
        self.prefill_mgrs = [rt.manager(backend, "prefill", (r, self.size), args) for r in range(self.size)]
        self.decode_mgrs = [rt.manager(backend, "decode", (r, self.size), args) for r in range(self.size)]
        for rank, mgr in enumerate(self.decode_mgrs):
            agent = getattr(getattr(mgr, "agent", None), "name", None)
            if agent is not None:  # NIXL: a transfer names the decode agent it writes to
                transports.fabric.tag_agent(agent, rank)
        if backend != "nixl":
            # Each decode rank is its own destination, as separate decode processes are (newer releases share
            # one Mooncake engine, so one session, per process).
            for mgr in self.decode_mgrs:
                bench.own_session(mgr, next(bench.session_ports))
        # SGLang's key of each rank's decode peer (/scenario/link's "rank" sets that link's speed).
        self.destinations = [bench.destination_of(backend, mgr)[0] for mgr in self.decode_mgrs]
        # The plugin's peers share a folder per SGLang server port: one of this group's own, in a folder of
        # this group's own, so no other scene's files are read.
        self.peer_dir = tempfile.mkdtemp(prefix="sglang-watchdog-tp2-peers-")
        self.http_port = runtime.free_port()
        pair = PairGroup(self.size)
        self.schedulers = [self._scheduler(rank, pair) for rank in range(self.size)]
        self.needs_requests = rt.pass_needs_requests()
        self.errors = []  # exceptions SGLang's passes raised: each would kill a real scheduler
        self.links = []
        self._pending = []  # [req per rank], admitted at the start of the next pass of both ranks
        self._batch = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._start_barrier = threading.Barrier(self.size, action=self._take_pending, timeout=_BARRIER_TIMEOUT_S)
        self._pair = pair
        self._threads = []
        self.passes = 0  # rank 0's
        self.after_pass = []  # callables run on rank 0's scheduler thread after each pass (the server's stats)

    @property
    def scheduler(self):
        """The leader's scheduler: what the real-code server reads SGLang's metrics and queue from."""
        return self.schedulers[0]

    def _scheduler(self, rank, pair):
        s = sch.prefill_scheduler(self.rt, self.backend, self.prefill_mgrs[rank])
        ranks = dict(tp_rank=rank, tp_size=self.size, attn_tp_rank=rank, attn_tp_size=self.size)
        for key, value in ranks.items():
            setattr(s.ps, key, value)
            setattr(s, key, value)
        s.attn_tp_cpu_group = s.tp_cpu_group = pair.member(rank)
        s.server_args.port = self.http_port  # the peers' folder is per SGLang server port
        return s

    # Loops ----------------------------------------------------------------

    def start(self):
        self._env = os.environ.get("SGLANG_WATCHDOG_PLUGIN_PEER_DIR")
        os.environ["SGLANG_WATCHDOG_PLUGIN_PEER_DIR"] = self.peer_dir  # read once, at each rank's first pass
        os.environ.setdefault("SGLANG_WATCHDOG_PLUGIN_HOST", "127.0.0.1")
        os.environ["SGLANG_WATCHDOG_PLUGIN_PORT"] = "0"
        for rank in range(self.size):
            thread = threading.Thread(target=self._loop, args=(rank,), name=f"tp2-scheduler-{rank}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.needs_requests:
            # The plugin starts at its first hooked pass, which such an event loop makes only for a request.
            self.admit(next(_first_rooms), rid="tp2-first-request")
        sch._until(lambda: self.monitor is not None and self.publisher is not None, 30,
                   "the plugin's first hooked pass on both ranks")
        return self

    def stop(self):
        transports.fabric.end_hangs(link.room for link in self.links)
        for key in self.destinations:
            transports.fabric.destination_speed(key, None)
        self._stop.set()
        self._start_barrier.abort()
        self._pair.barrier.abort()
        for thread in self._threads:
            thread.join(5)
        monitor = self.monitor
        if monitor is not None and monitor.listener is not None:
            monitor.listener.close()
        publisher = self.publisher
        if publisher is not None:
            publisher.stop()
        if self._env is None:
            os.environ.pop("SGLANG_WATCHDOG_PLUGIN_PEER_DIR", None)
        else:
            os.environ["SGLANG_WATCHDOG_PLUGIN_PEER_DIR"] = self._env

    def _take_pending(self):
        with self._lock:
            self._batch, self._pending = self._pending, []

    def _loop(self, rank):
        s = self.schedulers[rank]
        while not self._stop.is_set():
            try:
                self._start_barrier.wait()
                s.disagg_prefill_inflight_queue.extend(reqs[rank] for reqs in self._batch)
                if s.disagg_prefill_inflight_queue or not self.needs_requests:
                    s.process_disagg_prefill_inflight_queue()
            except threading.BrokenBarrierError:
                if not self._stop.is_set():
                    self.errors.append(RuntimeError(f"rank {rank}: the other rank left the group"))
                return
            except Exception as e:  # a real scheduler process dies here
                self.errors.append(e)
                self._pair.barrier.abort()
                self._start_barrier.abort()
                return
            if rank == 0:
                for fn in self.after_pass:
                    try:
                        fn()
                    except Exception as e:
                        self.errors.append(e)
                self.passes += 1
            time.sleep(self.pass_interval)

    # The plugin on each rank --------------------------------------------------

    @property
    def monitor(self):
        """The leader's (rank 0) monitor once its first hooked pass ran."""
        from .. import hook

        return hook.monitor_for(self.schedulers[0])

    @property
    def publisher(self):
        """Rank 1's publisher, which the hook started at its first pass (None before)."""
        from .. import hook

        return hook._publishers.get(self.schedulers[1])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.monitor.listener.port}"

    # Requests -------------------------------------------------------------

    def admit(self, room, behaviour=transports.COMPLETE, per_rank=None, rid=None):
        """A request both ranks sent their share of, in both inflight queues from the same pass on.

        ``per_rank``: {rank: behaviour} for one rank's share, over ``behaviour``.
        """
        transports.fabric.plan(room, behaviour)
        for rank, plan in (per_rank or {}).items():
            transports.fabric.plan(room, plan, rank=rank)
        reqs = []
        for rank, s in enumerate(self.schedulers):
            slot = s.req_to_metadata_buffer_idx_allocator.alloc()
            link = sch.Link(self.rt, self.backend, room, self.prefill_mgrs[rank], self.decode_mgrs[rank], slot=slot,
                            bootstrap_port=self.bootstrap_port, rank=rank)
            link.bootstrap()
            self.links.append(link)
            reqs.append((link, slot))
        out = []
        for link, slot in reqs:
            link.send(1)
            req = sch.make_req(self.rt, room, rid=rid or f"tp2-{room}", sender=link.sender)
            req.metadata_buffer_index = slot
            out.append(req)
        with self._lock:
            self._pending.append(out)
        sch._until(lambda: all(req in s.disagg_prefill_inflight_queue or req in s.streamed
                               for req, s in zip(out, self.schedulers)), 10, f"{out[0].rid} to be queued")
        return out

    def released(self, rank, rid):
        for req in list(self.schedulers[rank].streamed):
            if req.rid == rid:
                return req.finished_reason
        return None

    def queued(self, rank, rid):
        return any(r.rid == rid for r in list(self.schedulers[rank].disagg_prefill_inflight_queue))


_first_rooms = iter(range(950000, 960000))
