"""Structural stand-ins for the parts of SGLang the plugin touches.

They copy the shapes and behaviour of SGLang's own code under
``python/sglang/srt/`` (read in v0.4.6, v0.4.10, v0.5.3 and v0.5.18): KVPoll; the newest NIXL sender and manager
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
import os
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
    def __init__(self, tp_rank=0, dp_rank=0, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_cp_rank=0, attn_tp_size=1,
                 attn_cp_size=1):
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.attn_tp_rank = attn_tp_rank
        self.attn_cp_rank = attn_cp_rank
        self.attn_tp_size = attn_tp_size
        self.attn_cp_size = attn_cp_size


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
    """Drives a scheduler's inflight pass (prefill) or decode queue pass on its own thread, like SGLang's
    event loop.

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
            if isinstance(s, DecodeMixin):
                s.process_decode_queue()
            # Older loops only call the pass while the queue is non-empty.
            elif isinstance(s, PrefillMixin) or s.disagg_prefill_inflight_queue:
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


# -- decode -----------------------------------------------------------------
#
# The decode side (SGLang v0.5.18's disaggregation/decode.py, common/conn.py,
# nixl/conn.py, fake/conn.py; deferred release is later upstream code): DecodeRequests wait in the prealloc queue
# until their handshake is done and pages are free, send their metadata and
# move to the transfer queue, which polls their receivers until Success or
# Failed. A Failed receiver in the prealloc queue is a bootstrap failure; in
# the transfer queue a transfer failure that answers the client with a 500
# and frees the pages at once, or, with deferred release on and an ABORT
# sent to prefill, once the prefill peer acknowledged it (ABORT_ACK) or
# DEFERRED_RELEASE_TIMEOUT_S passed.

DEFERRED_RELEASE_TIMEOUT_S = 30.0
WAITING_TIMEOUT_S = 300.0


PREFILL_RANK_PORT = 40001


class PrefillPeer:
    """The prefill side of ABORT messages: acknowledges an abort once it has no chunk of the room in flight.

    ``acks=False`` is a peer that never answers (a wedged or dead prefill).
    """

    def __init__(self, acks=True):
        self.acks = acks
        self.aborts = []  # rooms an ABORT arrived for
        self.writing = set()  # rooms with a chunk still in flight
        self._waiting = {}  # room -> manager, ABORTs not yet acknowledged

    def abort(self, room, manager):
        self.aborts.append(room)
        self._waiting[room] = manager
        self._maybe_ack(room)

    def settle(self, room):
        """The room's last in-flight chunk settled."""
        self.writing.discard(room)
        self._maybe_ack(room)

    def _maybe_ack(self, room):
        if self.acks and room not in self.writing and room in self._waiting:
            self._waiting.pop(room).note_abort_ack(room)


class DecodeKVManager(KVManager):
    """CommonKVManager on decode: status table, failure records, waiting timeout and the deferred-abort tracker.

    ``deferred=None`` is a release without deferred decode KV release.
    """

    def __init__(self, deferred=True):
        super().__init__(queues=0)
        self.waiting_timeout = WAITING_TIMEOUT_S
        if deferred is not None:
            self.enable_deferred_decode_kv_release = deferred
        self._deferred_abort_ack_tracker = set()  # rooms registered as deferred aborts
        self._abort_acks = set()  # rooms whose ABORT_ACK arrived, registered or not yet

    def register_deferred_abort_room(self, room):
        # Idempotent, and an ack that raced ahead of the registration still counts.
        self._deferred_abort_ack_tracker.add(room)

    def note_abort_ack(self, room):
        self._abort_acks.add(room)

    def is_abort_release_safe(self, room):
        return room in self._deferred_abort_ack_tracker and room in self._abort_acks

    def clear_deferred_abort_state(self, room):
        self._deferred_abort_ack_tracker.discard(room)
        self._abort_acks.discard(room)


class NoAckDecodeKVManager(DecodeKVManager):
    """A backend whose prefill side never acks a drain, so SGLang keeps deferred release off for it."""

    supports_deferred_decode_kv_release = False


class OlderDecodeKVManager(DecodeKVManager):
    """A release whose register_deferred_abort_room also wants a generation and the expected ranks."""

    def register_deferred_abort_room(self, room, generation, expected_ranks):
        super().register_deferred_abort_room(room)


class TransferStatus:
    """NIXL's per-room transfer status on decode (nixl/conn.py TransferStatus, trimmed)."""

    def __init__(self):
        self.received_kvs_per_pp = collections.defaultdict(set)
        self.expected_kvs_per_pp = {}
        self.num_pp_ranks_expected = None
        self.received_aux = False
        self.failed = False

    def is_done(self):
        if not self.received_aux or self.num_pp_ranks_expected is None:
            return False
        if len(self.expected_kvs_per_pp) < self.num_pp_ranks_expected:
            return False
        return all(len(self.received_kvs_per_pp[pp]) >= n for pp, n in self.expected_kvs_per_pp.items())

    def is_failed(self):
        return self.failed


class NixlDecodeKVManager(DecodeKVManager):
    def __init__(self, deferred=True):
        super().__init__(deferred)
        self.transfer_statuses = collections.defaultdict(TransferStatus)

    def receive_chunk(self, room, chunk_id, pp_rank=0, last_of=None, pp_ranks=1):
        """Prefill wrote one chunk; ``last_of`` gives the stage's chunk count with its last chunk."""
        status = self.transfer_statuses[room]
        status.received_kvs_per_pp[pp_rank].add(chunk_id)
        status.num_pp_ranks_expected = pp_ranks
        if last_of is not None:
            status.expected_kvs_per_pp[pp_rank] = last_of

    def receive_aux(self, room):
        self.transfer_statuses[room].received_aux = True


class CommonKVReceiver(_RecordedWrites):
    """CommonKVReceiver: latched conclude_state, the waiting timeout, abort() with its ABORT to prefill."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, peer=None):
        super().__init__()
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.peer = peer
        self.__conclude_state = None
        self.init_time = None
        self.abort_notified = False
        self.bootstrap_infos = None
        mgr.update_status(bootstrap_room, KVPoll.Bootstrapping)

    @property
    def conclude_state(self):
        return self.__conclude_state

    @conclude_state.setter
    def conclude_state(self, value):
        self._recorded("_CommonKVReceiver__conclude_state", value)

    def _latch(self, status):
        self.__conclude_state = status  # poll()'s own latching is not a lever write

    def init(self, prefill_dp_rank=0):
        # What the bootstrap server's /route answers, as decode keeps it: one prefill rank, on the bootstrap
        # server's host.
        host = self.bootstrap_addr.rsplit(":", 1)[0]
        self.bootstrap_infos = [{"peer": self.peer, "rank_ip": host, "rank_port": PREFILL_RANK_PORT}]
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)

    def send_metadata(self, *args, **kwargs):
        self.init_time = time.time()

    def _check_waiting_timeout(self):
        if self.init_time is None or time.time() - self.init_time < self.kv_mgr.waiting_timeout:
            return None
        self.kv_mgr.record_failure(self.bootstrap_room, "timed out in KVPoll.WaitingForInput")
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self._notify_abort()
        return KVPoll.Failed

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.check_status(self.bootstrap_room)
        if status in (KVPoll.Success, KVPoll.Failed):
            self._latch(status)
            return status
        if status == KVPoll.WaitingForInput:
            return self._check_waiting_timeout() or status
        return status

    def abort(self):
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed
        self._notify_abort()

    def _notify_abort(self):
        if not self.abort_notified and self.bootstrap_infos is not None:
            for info in self.bootstrap_infos:
                if info["peer"] is not None:
                    info["peer"].abort(self.bootstrap_room, self.kv_mgr)
            self.abort_notified = True

    def failure_exception(self):
        reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, "Failed due to an unknown reason")
        raise RuntimeError(f"KVTransferError(bootstrap_room={self.bootstrap_room}): {reason}")

    def clear(self):
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)


class MooncakeKVReceiver(CommonKVReceiver):
    """Mooncake: Transferring once prefill started writing, and never timed out there (upstream PR #31800)."""

    def start_transfer(self):
        """Prefill's first chunk landed."""
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Transferring)

    def finish_transfer(self):
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)


class NixlKVReceiver(CommonKVReceiver):
    """Newest NIXL: started_transfer once metadata is sent; WaitingForInput until every chunk and the aux
    arrived (with the waiting timeout), then Success."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, peer=None):
        self.started_transfer = False
        super().__init__(mgr, bootstrap_addr, bootstrap_room, peer)

    def send_metadata(self, *args, **kwargs):
        super().send_metadata()
        self.started_transfer = True

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.check_status(self.bootstrap_room)
        if status in (KVPoll.Success, KVPoll.Failed):
            self._latch(status)
            return status
        if not self.started_transfer:
            return status
        if self._check_waiting_timeout():
            self._latch(KVPoll.Failed)
            return KVPoll.Failed
        transfer = self.kv_mgr.transfer_statuses.get(self.bootstrap_room)
        if transfer is not None and transfer.is_done():
            self._latch(KVPoll.Failed if transfer.is_failed() else KVPoll.Success)
            del self.kv_mgr.transfer_statuses[self.bootstrap_room]
            return self.conclude_state
        return KVPoll.WaitingForInput

    def failure_exception(self):
        raise RuntimeError("NIXL KVReceiver Exception")


class FakeKVReceiver(_RecordedWrites):
    """Health checks and warm-ups: no room, no transfer; the newest release hands it the real manager."""

    def __init__(self, mgr=None, bootstrap_addr="", bootstrap_room=None):
        super().__init__()
        if mgr is not None:
            self.kv_mgr = mgr
            self.abort_notified = False
        self.bootstrap_done = False
        self.has_sent_metadata = False
        self.conclude_state = None

    def init(self, prefill_dp_rank=0):
        self.bootstrap_done = True

    def send_metadata(self, *args, **kwargs):
        self.has_sent_metadata = True

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.bootstrap_done:
            return KVPoll.Bootstrapping
        if not self.has_sent_metadata:
            return KVPoll.WaitingForInput
        self.conclude_state = KVPoll.Success
        return KVPoll.Success

    def abort(self):
        self.conclude_state = KVPoll.Failed

    def failure_exception(self):
        raise RuntimeError("Fake KVReceiver Exception")

    def clear(self):
        pass


class DecodeRequest:
    def __init__(self, req, kv_receiver):
        self.req = req
        self.kv_receiver = kv_receiver
        self.waiting_for_input = False
        self.metadata_buffer_index = -1


class PagePool:
    """Decode KV page slots: one per request, the most recently freed handed out first."""

    def __init__(self, slots=64):
        self.free_slots = list(range(slots))
        self.owner = {}  # slot -> rid

    def alloc(self, rid):
        if not self.free_slots:
            return None
        slot = self.free_slots.pop()
        self.owner[slot] = rid
        return slot

    def free(self, slot):
        del self.owner[slot]
        self.free_slots.append(slot)


def _abort_req(req, message):
    req.finished_reason = ("abort", 500, message)


class DecodePreallocQueue:
    def __init__(self, scheduler, kv_manager, transfer_queue, pages):
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.transfer_queue = transfer_queue
        self.pages = pages
        self.queue = []
        self.retracted_queue = []
        self.pending_reqs = []
        self.held_rebootstrap_reqs = []

    def _update_handshake_waiters(self):
        if not self.queue:
            return
        # Still poll if any receiver was aborted, otherwise it stays stuck.
        if all(d.waiting_for_input for d in self.queue) and not any(
                d.kv_receiver.conclude_state == KVPoll.Failed for d in self.queue):
            return
        for decode_req in self.queue:
            poll = decode_req.kv_receiver.poll()
            if poll == KVPoll.Bootstrapping:
                pass
            elif poll == KVPoll.WaitingForInput:
                decode_req.waiting_for_input = True
            elif poll == KVPoll.Failed:
                message = f"Decode handshake failed for request {decode_req.req.rid=}"
                try:
                    decode_req.kv_receiver.failure_exception()
                except Exception as e:
                    message += f" with exception {e}"
                _abort_req(decode_req.req, message)
                self.scheduler.num_bootstrap_failed_reqs += 1
            else:
                raise ValueError(f"Unexpected poll case: {poll}")

    def pop_preallocated(self):
        self._update_handshake_waiters()
        failed, preallocated, keep = [], [], []
        for decode_req in self.queue:
            if decode_req.req.finished_reason is not None:
                self.scheduler.client_answers.append((decode_req.req.rid, 500))
                decode_req.kv_receiver.clear()
                decode_req.kv_receiver = None
                failed.append(decode_req)
            elif decode_req.waiting_for_input and self.pages.free_slots:
                decode_req.metadata_buffer_index = self.pages.alloc(decode_req.req.rid)
                decode_req.kv_receiver.send_metadata()
                preallocated.append(decode_req)
            else:
                keep.append(decode_req)
        self.queue = keep
        return preallocated, failed


def _deferred_setting_on():
    # Upstream after v0.5.18, the transfer queue reads the setting itself; the manager's flag does not decide
    # (Mooncake's forces its own on).
    return os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "").strip().lower() in ("1", "true")


class DecodeTransferQueue:
    def __init__(self, scheduler, pages):
        self.scheduler = scheduler
        self.pages = pages
        self.queue = []
        self.deferred_kv_release_timeout = DEFERRED_RELEASE_TIMEOUT_S
        self.clock = time.monotonic
        self._deferred_releases = []  # (decode_req, room, deadline, manager)

    def extend(self, decode_reqs):
        self.queue.extend(decode_reqs)

    def pop_transferred(self):
        if not self.queue:
            return []
        transferred, keep = [], []
        for decode_req in self.queue:
            poll = decode_req.kv_receiver.poll()
            if poll == KVPoll.Failed:
                message = f"Decode transfer failed for request {decode_req.req.rid=}"
                try:
                    decode_req.kv_receiver.failure_exception()
                except Exception as e:
                    message += f" with exception {e}"
                _abort_req(decode_req.req, message)
                self.scheduler.client_answers.append((decode_req.req.rid, 500))
                receiver = decode_req.kv_receiver
                manager = getattr(receiver, "kv_mgr", None)
                if _deferred_setting_on() and getattr(manager, "enable_deferred_decode_kv_release", False) and getattr(
                        receiver, "abort_notified", False):
                    # Prefill may still write into these pages: hold them until it acknowledged the ABORT.
                    self._deferred_releases.append(
                        (decode_req, decode_req.req.bootstrap_room, self.clock() + self.deferred_kv_release_timeout,
                         manager))
                else:
                    self._release(decode_req)
                receiver.clear()
                decode_req.kv_receiver = None
                self.scheduler.num_transfer_failed_reqs += 1
            elif poll == KVPoll.Success:
                decode_req.kv_receiver.clear()
                decode_req.kv_receiver = None
                transferred.append(decode_req.req)
                self._release(decode_req)  # the stand-in decodes at once
            elif poll in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(decode_req)
            else:
                raise ValueError(f"Unexpected poll case: {poll}")
        self.queue = keep
        return transferred

    def _release(self, decode_req):
        if decode_req.metadata_buffer_index is not None and decode_req.metadata_buffer_index >= 0:
            self.pages.free(decode_req.metadata_buffer_index)
            decode_req.metadata_buffer_index = -1
        self.scheduler.released_pages.append(decode_req.req.rid)

    def resolve_deferred_releases(self):
        held = []
        now = self.clock()
        for entry in self._deferred_releases:
            decode_req, room, deadline, manager = entry
            if not manager.is_abort_release_safe(room):
                if now < deadline:
                    held.append(entry)
                    continue
                self.scheduler.deferred_timeouts.append(decode_req.req.rid)
            self._release(decode_req)
            manager.clear_deferred_abort_state(room)
        self._deferred_releases = held


class DecodeMixin:
    """process_decode_queue as the decode event loops call it, once per unpaused pass."""

    def process_decode_queue(self):
        self.disagg_decode_transfer_queue.resolve_deferred_releases()
        if len(self.disagg_decode_prealloc_queue.retracted_queue) > 0:
            return
        if not hasattr(self, "polling_count"):
            self.polling_count = 0
            self.polling_interval = self.server_args.disaggregation_decode_polling_interval
        self.polling_count = (self.polling_count + 1) % self.polling_interval
        if self.polling_count % self.polling_interval == 0:
            req_conns, _ = self.disagg_decode_prealloc_queue.pop_preallocated()
            self.disagg_decode_transfer_queue.extend(req_conns)
            self.waiting_queue.extend(self.disagg_decode_transfer_queue.pop_transferred())


class _DecodeState:
    def __init__(self, backend, manager, pages, polling_interval):
        self.disaggregation_mode = "decode"
        self.server_args = ServerArgs(backend)
        self.server_args.disaggregation_decode_polling_interval = polling_interval
        self.pages = pages if pages is not None else PagePool()
        if manager is None:
            manager = NixlDecodeKVManager() if backend == "nixl" else DecodeKVManager()
        self.disagg_decode_transfer_queue = DecodeTransferQueue(self, self.pages)
        self.disagg_decode_prealloc_queue = DecodePreallocQueue(
            self, manager, self.disagg_decode_transfer_queue, self.pages)
        self.waiting_queue = []
        self.num_bootstrap_failed_reqs = 0
        self.num_transfer_failed_reqs = 0
        self.client_answers = []  # (rid, HTTP status) of requests answered with an error
        self.released_pages = []  # rids whose pages were freed, in order
        self.deferred_timeouts = []  # rids whose deferred release ran out of time

    @property
    def kv_manager(self):
        return self.disagg_decode_prealloc_queue.kv_manager

    def add_request(self, rid, room, receiver_cls=None, *, host="10.0.0.7", port=8998, peer=None, handshake=True):
        """A request arrives (process_input_requests): a receiver is made and the request queued for prealloc."""
        req = Req(rid, room, None, host=host, port=port)
        if host == FAKE_BOOTSTRAP_HOST:
            receiver = FakeKVReceiver(self.kv_manager)
            req.bootstrap_room = room
        else:
            cls = receiver_cls or (NixlKVReceiver if self.server_args.disaggregation_transfer_backend == "nixl"
                                   else MooncakeKVReceiver)
            receiver = cls(self.kv_manager, f"{host}:{port}", room, peer)
        decode_req = DecodeRequest(req, receiver)
        self.disagg_decode_prealloc_queue.queue.append(decode_req)
        if handshake:
            receiver.init(0)
        return decode_req


class DecodeScheduler(DecodeMixin, _DecodeState):
    """Newest layout: ranks in self.ps."""

    def __init__(self, backend="nixl", manager=None, pages=None, polling_interval=1, **ranks):
        _DecodeState.__init__(self, backend, manager, pages, polling_interval)
        self.ps = ParallelState(**ranks)


class OldDecodeScheduler(DecodeMixin, _DecodeState):
    """Older layout: plain rank attributes, dp_rank None without DP."""

    def __init__(self, backend="mooncake", manager=None, pages=None, polling_interval=1, tp_rank=0, dp_rank=None,
                 pp_rank=0, pp_size=1, attn_tp_rank=0):
        _DecodeState.__init__(self, backend, manager, pages, polling_interval)
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.attn_tp_rank = attn_tp_rank
