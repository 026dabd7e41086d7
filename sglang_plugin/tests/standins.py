"""Structural stand-ins for the parts of SGLang the plugin touches.

They copy the shapes and behaviour described in /work/shared/sglang-facts.md
(sections 3 and 8): KVPoll, the NIXL / Mooncake / Fake senders, Req with
time_stats, both scheduler layouts (``ps`` object vs plain attributes) and
both method signatures, and the inflight pass with its Success and Failed
release branches. The lever attributes are properties that record the thread
of every write, so tests can prove that only the scheduler thread changes
them.
"""

import threading
import time


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class KVManager:
    """CommonKVManager: check_status raises KeyError for unknown rooms."""

    def __init__(self):
        self.request_status = {}
        self.failure_records = {}

    def check_status(self, room):
        return self.request_status[room]

    def update_status(self, room, status):
        self.request_status[room] = status

    def record_failure(self, room, reason):
        self.failure_records[room] = reason


class NewestNixlKVManager(KVManager):
    """Newest NIXL manager: unknown or cleared rooms read as WaitingForInput."""

    def check_status(self, room):
        return self.request_status.get(room, KVPoll.WaitingForInput)


class FakeKVManager:
    """BaseKVManager: no status table, no failure records."""


class _RecordedWrites:
    """Thread ids of every write to a lever attribute after construction."""

    def __init__(self):
        self.write_threads = []

    def _recorded(self, name, value):
        self.write_threads.append(threading.get_ident())
        setattr(self, name, value)


class NixlKVSender(_RecordedWrites):
    def __init__(self, mgr, bootstrap_room, status=KVPoll.Transferring, chunk_id=0):
        super().__init__()
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.__send_failed = False
        self.chunk_id = chunk_id
        self.curr_idx = chunk_id * 16
        self.has_sent = True
        self.conclude_state = None  # inherited from CommonKVSender, ignored by poll()
        mgr.update_status(bootstrap_room, status)

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


class MooncakeKVSender(_RecordedWrites):
    def __init__(self, mgr, bootstrap_room, status=KVPoll.Transferring, curr_idx=0):
        super().__init__()
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.__conclude_state = None
        self.curr_idx = curr_idx
        mgr.update_status(bootstrap_room, status)

    @property
    def conclude_state(self):
        return self.__conclude_state

    @conclude_state.setter
    def conclude_state(self, value):
        self._recorded("_MooncakeKVSender__conclude_state", value)

    def poll(self):
        # Caches terminal states like the real sender; this side effect is why
        # the plugin never calls poll().
        if self.conclude_state is None:
            status = self.kv_mgr.check_status(self.bootstrap_room)
            if status in (KVPoll.Success, KVPoll.Failed):
                self.__conclude_state = status
            return status
        return self.conclude_state

    def failure_exception(self):
        reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, "Failed due to an unknown reason")
        raise RuntimeError(f"KVTransferError(bootstrap_room={self.bootstrap_room}): {reason}")


class FakeKVSender(_RecordedWrites):
    def __init__(self, mgr, has_sent=False):
        super().__init__()
        self.kv_mgr = mgr
        self.has_sent = has_sent
        self.__conclude_state = None

    @property
    def conclude_state(self):
        return self.__conclude_state

    @conclude_state.setter
    def conclude_state(self, value):
        self._recorded("_FakeKVSender__conclude_state", value)

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.has_sent:
            return KVPoll.WaitingForInput
        self.__conclude_state = KVPoll.Success
        return KVPoll.Success

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
    def __init__(self):
        self.queue = []


class _PrefillPass:
    """The body of SGLang's process_disagg_prefill_inflight_queue."""

    def _inflight_pass(self):
        undone, done = [], []
        for req in self.disagg_prefill_inflight_queue:
            poll = _poll(req)
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                undone.append(req)
            elif poll == KVPoll.Success:
                req.finished_reason = "length"
                done.append(req)
            elif poll == KVPoll.Failed:
                try:
                    req.disagg_kv_sender.failure_exception()
                except Exception as e:
                    req.finished_reason = f"Prefill transfer failed for request {req.rid=} with exception {e}"
                done.append(req)
                self.num_transfer_failed_reqs += 1
            else:
                undone.append(req)
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
        return self._inflight_pass()


class OldPrefillMixin(_PrefillPass):
    """v0.4/v0.5 shape: called only while the queue is non-empty, returns None."""

    def process_disagg_prefill_inflight_queue(self):
        assert len(self.disagg_prefill_inflight_queue) > 0
        self._inflight_pass()


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
