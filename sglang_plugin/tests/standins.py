"""Structural stand-ins for the parts of SGLang the plugin touches.

They copy the shapes and behaviour described in /work/shared/sglang-facts.md
(sections 3, 8 and 10): KVPoll; the newest NIXL sender and manager
(``_send_failed``, ``_staging_outstanding``, queues keyed by destination
ports), the mid-2025 NIXL pair (no ``_send_failed``, a max()-only
update_status, a poll() that ignores conclude_state), Mooncake and fake
senders with their abort(); Req with time_stats; both scheduler layouts
(``ps`` object vs plain attributes) and three eras of the inflight pass
(newest, v0.4/v0.5, and the earliest whose Failed branch raises); and PP
stages that release a request only once every stage reports it terminal. The lever attributes are properties that record the thread
of every write, so tests can prove that only the scheduler thread changes
them.
"""

import collections
import threading
import time


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class TransferInfo:
    """What decode registers per destination (nixl/conn.py TransferInfo, trimmed)."""

    def __init__(self, endpoint, dst_port):
        self.endpoint = endpoint
        self.dst_port = dst_port


class KVManager:
    """CommonKVManager (newest) with Mooncake's transfer queues.

    check_status raises KeyError for unknown rooms; update_status does not
    resurrect a cleared room with Failed, lets Failed override any status,
    and merges the others with max(). Chunks are sharded over the transfer
    queues by the sum of the destination session ports, and counted per room
    in ``_staging_outstanding`` until a worker settles them.
    """

    def __init__(self, queues=4):
        self.request_status = {}
        self.failure_records = {}
        self.transfer_infos = {}
        self.transfer_queues = [[] for _ in range(queues)]
        self._staging_outstanding = collections.defaultdict(int)

    def check_status(self, room):
        return self.request_status[room]

    def update_status(self, room, status):
        if room not in self.request_status:
            if status == KVPoll.Failed:
                return  # do not resurrect a cleared entry with Failed
            self.request_status[room] = status
        elif status == KVPoll.Failed:
            self.request_status[room] = status
        else:
            self.request_status[room] = max(self.request_status[room], status)

    def record_failure(self, room, reason):
        self.failure_records[room] = reason

    def register_destinations(self, room, ports, host="10.0.0.9"):
        self.transfer_infos[room] = {f"{host}:{port}": TransferInfo(host, port) for port in ports}

    def add_transfer_request(self, bootstrap_room, is_last=False):
        dst_infos = self.transfer_infos[bootstrap_room].keys()
        session_port_sum = sum(int(session.rsplit(":", 1)[1]) for session in dst_infos)
        shard_idx = session_port_sum % len(self.transfer_queues)
        self._enqueue(shard_idx, bootstrap_room)
        return shard_idx

    def _enqueue(self, shard_idx, room):
        self._staging_outstanding[room] += 1
        self.transfer_queues[shard_idx].append(room)

    def settle(self, room):
        """A transfer worker finished one chunk of the room (its handle reached DONE or ERR)."""
        self._staging_outstanding[room] -= 1
        if self._staging_outstanding[room] <= 0:
            del self._staging_outstanding[room]
        for queue in self.transfer_queues:
            if room in queue:
                queue.remove(room)
                break


class NewestNixlKVManager(KVManager):
    """Newest NIXL manager: unknown or cleared rooms read as WaitingForInput; chunks go to the
    queue picked by the sum of the destination decode ports."""

    def check_status(self, room):
        return self.request_status.get(room, KVPoll.WaitingForInput)

    def register_destinations(self, room, ports, host="10.0.0.9"):
        self.transfer_infos[room] = {f"agent-{port}": TransferInfo(host, port) for port in ports}

    def add_transfer_request(self, bootstrap_room, is_last=False):
        session_port_sum = sum(info.dst_port for info in self.transfer_infos[bootstrap_room].values())
        shard_idx = session_port_sum % len(self.transfer_queues)
        self._enqueue(shard_idx, bootstrap_room)
        return shard_idx


class Mid2025NixlKVManager:
    """Mid-2025 NIXL manager: synchronous transfers (no worker queues) and a pure max() update_status,
    so Failed (0) never overrides an existing status; no failure records."""

    def __init__(self):
        self.request_status = {}

    def check_status(self, room):
        return self.request_status[room]

    def update_status(self, room, status):
        if room not in self.request_status:
            self.request_status[room] = status
        else:
            self.request_status[room] = max(self.request_status[room], status)

    def record_failure(self, room, reason):
        pass


class FakeKVManager:
    """BaseKVManager: no status table, no failure records."""


class _RecordedWrites:
    """Thread ids of every write to a lever attribute after construction."""

    def __init__(self):
        self.write_threads = []

    def _recorded(self, name, value):
        self.write_threads.append(threading.get_ident())
        setattr(self, name, value)


class CommonKVSender(_RecordedWrites):
    """CommonKVSender: conclude_state, and the abort() that Scheduler.abort_request calls."""

    def __init__(self, mgr, bootstrap_room):
        super().__init__()
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.__conclude_state = None

    @property
    def conclude_state(self):
        return self.__conclude_state

    @conclude_state.setter
    def conclude_state(self, value):
        self._recorded("_CommonKVSender__conclude_state", value)

    def abort(self):
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def _enter(self, status):
        # The real constructor registers the room as Bootstrapping; the
        # stand-in then moves it straight to the status a test asks for.
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)
        self.kv_mgr.update_status(self.bootstrap_room, status)

    def _cache_conclusion(self, status):
        self.__conclude_state = status  # poll()'s own caching is not a lever write


class NixlKVSender(CommonKVSender):
    """Newest NIXL sender: poll() reads _send_failed, then the manager's status; never conclude_state."""

    def __init__(self, mgr, bootstrap_room, status=KVPoll.Transferring, chunk_id=0, dst_ports=(17000,)):
        super().__init__(mgr, bootstrap_room)
        self.__send_failed = False
        self.chunk_id = chunk_id
        self.curr_idx = chunk_id * 16
        self.has_sent = True
        if hasattr(mgr, "register_destinations"):
            mgr.register_destinations(bootstrap_room, dst_ports)
        self._enter(status)

    @property
    def _send_failed(self):
        return self.__send_failed

    @_send_failed.setter
    def _send_failed(self, value):
        self._recorded("_NixlKVSender__send_failed", value)

    def poll(self):
        if self._send_failed:
            return KVPoll.Failed
        return self.kv_mgr.check_status(self.bootstrap_room)

    def failure_exception(self):
        raise RuntimeError("NIXL KVSender Exception")


class Mid2025NixlKVSender(CommonKVSender):
    """Mid-2025 NIXL sender: no _send_failed; poll() reads the manager's status until the last chunk
    was sent, then only the transfer handles, and ignores conclude_state. abort() is CommonKVSender's."""

    def __init__(self, mgr, bootstrap_room, status=KVPoll.Transferring, chunk_id=0):
        super().__init__(mgr, bootstrap_room)
        self.chunk_id = chunk_id
        self.has_sent = False
        self.xfer_states = []  # "PROC", "DONE" or "ERR" per handle
        self._enter(status)

    def poll(self):
        if not self.has_sent:
            return self.kv_mgr.check_status(self.bootstrap_room)
        if all(state == "DONE" for state in self.xfer_states):
            return KVPoll.Success
        return KVPoll.WaitingForInput

    def failure_exception(self):
        raise RuntimeError("NIXL KVSender Exception")


class MooncakeKVSender(CommonKVSender):
    def __init__(self, mgr, bootstrap_room, status=KVPoll.Transferring, curr_idx=0, dst_ports=(17000,)):
        super().__init__(mgr, bootstrap_room)
        self.curr_idx = curr_idx
        if hasattr(mgr, "register_destinations"):
            mgr.register_destinations(bootstrap_room, dst_ports)
        self._enter(status)

    def poll(self):
        # Caches terminal states like the real sender; this side effect is why
        # the plugin never calls poll().
        if self.conclude_state is None:
            status = self.kv_mgr.check_status(self.bootstrap_room)
            if status in (KVPoll.Success, KVPoll.Failed):
                self._cache_conclusion(status)
            return status
        return self.conclude_state

    def abort(self):
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.conclude_state = KVPoll.Failed

    def failure_exception(self):
        reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, "Failed due to an unknown reason")
        raise RuntimeError(f"KVTransferError(bootstrap_room={self.bootstrap_room}): {reason}")


class FakeKVSender(CommonKVSender):
    def __init__(self, mgr, has_sent=False):
        super().__init__(mgr, 0)
        self.has_sent = has_sent

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.has_sent:
            return KVPoll.WaitingForInput
        self._cache_conclusion(KVPoll.Success)
        return KVPoll.Success

    def abort(self):
        self.conclude_state = KVPoll.Failed

    def failure_exception(self):
        raise RuntimeError("Fake KVSender Exception")


class TimeStats:
    def __init__(self, prefill_transfer_queue_entry_time=0.0):
        self.prefill_transfer_queue_entry_time = prefill_transfer_queue_entry_time


class Req:
    def __init__(self, rid, bootstrap_room, sender, *, host="10.0.0.7", port=8998, prompt_tokens=128, entered=None):
        self.rid = rid
        self.bootstrap_room = bootstrap_room
        self.bootstrap_host = host
        self.bootstrap_port = port
        self.origin_input_ids = [0] * prompt_tokens
        self.time_stats = TimeStats(time.perf_counter() if entered is None else entered)
        self.disagg_kv_sender = sender
        self.finished_reason = None


class BootstrapQueue:
    def __init__(self, kv_manager=None):
        self.queue = []
        self.kv_manager = kv_manager


class _PrefillPass:
    """What every era's inflight pass shares; the poll branches stay inline in each era's method,
    where the plugin reads them."""

    pp_group = None

    def _polls(self):
        return [_poll(req) for req in self.disagg_prefill_inflight_queue]

    def _release_allowed(self, polls):
        """PP: the rids every stage reports terminal; None without PP."""
        if self.pp_group is None:
            return None
        terminal = {req.rid for req, poll in zip(self.disagg_prefill_inflight_queue, polls)
                    if poll in (KVPoll.Success, KVPoll.Failed)}
        return self.pp_group.agree(self.pp_rank_of_stage, terminal)

    def _release_failed(self, req):
        try:
            req.disagg_kv_sender.failure_exception()
        except Exception as e:
            req.finished_reason = f"Prefill transfer failed for request {req.rid=} with exception {e}"
        self.num_transfer_failed_reqs += 1

    def _finish(self, undone, done):
        self.released.extend(done)
        self.disagg_prefill_inflight_queue = undone
        return done


def _poll(req):
    # SGLang itself would crash on an entry without a sender, or on a status
    # lookup for a cleared room; the stand-in keeps such entries so that tests
    # exercise the plugin's tolerance, not SGLang's.
    try:
        return req.disagg_kv_sender.poll()
    except (AttributeError, KeyError):
        return KVPoll.WaitingForInput


class PrefillMixin(_PrefillPass):
    """Newest shape: may be called with an empty queue, returns the released requests."""

    def process_disagg_prefill_inflight_queue(self, rids_to_check=None):
        if len(self.disagg_prefill_inflight_queue) == 0:
            return []
        polls = self._polls()
        allowed = self._release_allowed(polls)
        undone, done = [], []
        for req, poll in zip(self.disagg_prefill_inflight_queue, polls):
            if allowed is not None and req.rid not in allowed:
                undone.append(req)  # PP: not every stage reports it terminal yet
            elif poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                undone.append(req)
            elif poll == KVPoll.Success:
                req.finished_reason = "length"
                done.append(req)
            elif poll == KVPoll.Failed:
                self._release_failed(req)
                done.append(req)
            else:
                undone.append(req)
        return self._finish(undone, done)


class OldPrefillMixin(_PrefillPass):
    """v0.4/v0.5 shape: called only while the queue is non-empty, returns None."""

    def process_disagg_prefill_inflight_queue(self):
        assert len(self.disagg_prefill_inflight_queue) > 0
        undone, done = [], []
        for req, poll in zip(self.disagg_prefill_inflight_queue, self._polls()):
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                undone.append(req)
            elif poll == KVPoll.Success:
                req.finished_reason = "length"
                done.append(req)
            elif poll == KVPoll.Failed:
                self._release_failed(req)
                done.append(req)
            else:
                undone.append(req)  # v0.5: "Unexpected polling state ... treating as undone"
        self._finish(undone, done)


class EarlyPrefillMixin(_PrefillPass):
    """The earliest shape (about v0.4.5): the Failed branch raises and would crash the scheduler."""

    def process_disagg_prefill_inflight_queue(self):
        assert len(self.disagg_prefill_inflight_queue) > 0
        undone, done = [], []
        for req, poll in zip(self.disagg_prefill_inflight_queue, self._polls()):
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                undone.append(req)
            elif poll == KVPoll.Success:
                req.finished_reason = "length"
                done.append(req)
            elif poll == KVPoll.Failed:
                raise Exception("Transferring failed")
        self._finish(undone, done)


class PPGroup:
    """The stages of one DP rank agreeing on which requests to release.

    Like event_loop_pp_disagg_prefill: each stage reports the rids it polls
    terminal; a rid is released, on every stage, once all stages have
    reported it terminal (the intersection circulates as rids_to_check).
    """

    def __init__(self, size):
        self._terminal = [set() for _ in range(size)]
        self._agreed = set()
        self._lock = threading.Lock()

    def agree(self, stage, terminal):
        with self._lock:
            self._terminal[stage] = set(terminal)
            self._agreed |= set.intersection(*self._terminal)
            return set(self._agreed)


class ServerArgs:
    def __init__(self, backend):
        self.disaggregation_transfer_backend = backend


class ParallelState:
    def __init__(self, tp_rank=0, dp_rank=0, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_cp_rank=0):
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.attn_tp_rank = attn_tp_rank
        self.attn_cp_rank = attn_cp_rank


class _SchedulerState:
    def __init__(self, mode, backend):
        self.disaggregation_mode = mode
        self.server_args = ServerArgs(backend)
        self.disagg_prefill_inflight_queue = []
        self.disagg_prefill_bootstrap_queue = BootstrapQueue()
        self.waiting_queue = []
        self.num_transfer_failed_reqs = 0
        self.released = []


class NewScheduler(PrefillMixin, _SchedulerState):
    """Newest layout: ranks in self.ps."""

    def __init__(self, mode="prefill", backend="nixl", **ranks):
        _SchedulerState.__init__(self, mode, backend)
        self.ps = ParallelState(**ranks)


class OldScheduler(OldPrefillMixin, _SchedulerState):
    """Older layout: ranks as plain attributes, dp_rank None without DP."""

    def __init__(self, mode="prefill", backend="mooncake", tp_rank=0, dp_rank=None, pp_rank=0, pp_size=1,
                 attn_tp_rank=0):
        _SchedulerState.__init__(self, mode, backend)
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.attn_tp_rank = attn_tp_rank


class EarlyScheduler(EarlyPrefillMixin, _SchedulerState):
    """The earliest era: plain rank attributes, Failed branch raises."""

    def __init__(self, mode="prefill", backend="nixl", tp_rank=0, dp_rank=None, pp_rank=0, pp_size=1):
        _SchedulerState.__init__(self, mode, backend)
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.pp_size = pp_size


class PPStageScheduler(NewScheduler):
    """One PP stage of a DP rank: its own queue and senders, releases agreed with the other stages."""

    def __init__(self, group, pp_rank, pp_size=2, backend="nixl", dp_rank=0):
        super().__init__(backend=backend, dp_rank=dp_rank, pp_rank=pp_rank, pp_size=pp_size)
        self.pp_group = group
        self.pp_rank_of_stage = pp_rank


class SchedulerLoop:
    """Drives a scheduler's inflight pass on its own thread, like SGLang's event loop.

    ``before_pass`` runs on the loop thread ahead of every pass (scenario
    ticks); ``pause()`` returns once the loop is parked between passes.
    """

    def __init__(self, scheduler, interval=0.002, before_pass=None):
        self.scheduler = scheduler
        self.interval = interval
        self.before_pass = before_pass
        self.passes = 0
        self._run = threading.Event()
        self._run.set()
        self._parked = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="standin-scheduler", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def _loop(self):
        s = self.scheduler
        while not self._stop.is_set():
            if not self._run.is_set():
                self._parked.set()
                self._run.wait(0.05)
                continue
            self._parked.clear()
            if self.before_pass is not None:
                self.before_pass()
            # Older loops only call the pass while the queue is non-empty.
            if isinstance(s, PrefillMixin) or s.disagg_prefill_inflight_queue:
                s.process_disagg_prefill_inflight_queue()
            self.passes += 1
            time.sleep(self.interval)

    def pause(self):
        self._run.clear()
        self._parked.wait(5)

    def resume(self):
        self._parked.clear()
        self._run.set()

    def stop(self):
        self._stop.set()
        self._run.set()
        self.thread.join(5)

    def wait_passes(self, count=3, timeout=5.0):
        """Blocks until `count` more passes have completed."""
        target = self.passes + count
        deadline = time.monotonic() + timeout
        while self.passes < target:
            if time.monotonic() > deadline:
                raise TimeoutError("the stand-in scheduler loop stalled")
            time.sleep(0.001)
