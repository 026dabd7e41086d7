"""The AROUND hooks on the prefill inflight pass and the decode queue passes.

Prefill: ``SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue``,
with both signatures: ``(self)`` (older releases, called only while the
queue is non-empty) and ``(self, rids_to_check=None) -> List[Req]`` (newest).
Decode: ``SchedulerDisaggregationDecodeMixin.process_decode_queue(self)``,
which the decode event loops without PP call once per unpaused pass and
which polls both the prealloc and the transfer queue. SGLang's PP decode
loop (``SchedulerPPMixin.event_loop_pp_disagg_decode``,
``managers/scheduler_pp_mixin.py``, v0.5.10 to v0.5.18) never calls it: per
microbatch it runs ``process_prealloc_queue(rids)`` then
``process_decode_transfer_queue(rids)`` on the stages' consensus. There the
two hooks make one pass of the pair: it opens before the prealloc pass and
closes after the transfer pass. Arguments and return values pass
through untouched. Nothing the hooks do may raise into the scheduler: the
monitors catch their own failures, and a scheduler the plugin cannot set up
runs unhooked.
"""

import functools
import logging
import threading
import weakref

from . import peers, transfer_watch
from .config import Config
from .decode_monitor import DecodeMonitor
from .identity import identify
from .monitor import Monitor
from .server import start_listener

logger = logging.getLogger("sglang_watchdog_plugin")

METHOD = "process_disagg_prefill_inflight_queue"
TARGET = f"sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.{METHOD}"
DECODE_METHOD = "process_decode_queue"
DECODE_TARGET = f"sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.{DECODE_METHOD}"
PP_PREALLOC_METHOD = "process_prealloc_queue"
PP_TRANSFER_METHOD = "process_decode_transfer_queue"
PP_MIXIN = "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin"
PP_TARGETS = (f"{PP_MIXIN}.{PP_PREALLOC_METHOD}", f"{PP_MIXIN}.{PP_TRANSFER_METHOD}")

# Who holds a decode monitor's pass open: process_decode_queue, or the PP loop's pair.
_QUEUE_PASS, _PP_PASS = "queue", "pp"

# Per hooked method, scheduler -> its monitor, or None for schedulers that
# run unhooked there (another mode, not the attention-TP leader, disabled,
# or the listener could not start). Kept apart so that a scheduler of one
# mode that also calls the other mode's method (some forks run the decode
# queue pass outside decode mode) is still hooked in its own.
_monitors = {"prefill": weakref.WeakKeyDictionary(), "decode": weakref.WeakKeyDictionary()}
_monitors_lock = threading.Lock()
# Non-leader prefill rank -> the thread publishing its transfers to its group's leader.
_publishers = weakref.WeakKeyDictionary()


def around_inflight_pass(original_fn, scheduler, *args, **kwargs):
    """AROUND hook in the shape of SGLang's HookRegistry: fn(original_fn, *args, **kwargs)."""
    return _around("prefill", original_fn, scheduler, args, kwargs)


def around_decode_pass(original_fn, scheduler, *args, **kwargs):
    """AROUND hook on process_decode_queue, in the same shape."""
    monitor = _monitor_for_pass(scheduler, original_fn, "decode")
    if monitor is None or monitor.pass_owner is not None:
        return original_fn(scheduler, *args, **kwargs)
    return _pass(monitor, scheduler, _QUEUE_PASS, original_fn, args, kwargs)


def around_pp_prealloc_pass(original_fn, scheduler, *args, **kwargs):
    """AROUND hook on SchedulerPPMixin.process_prealloc_queue: opens the PP decode pass."""
    monitor = _pp_monitor(original_fn, scheduler)
    if monitor is not None:
        if monitor.pass_owner == _PP_PASS:  # the last pair never reached its transfer pass
            monitor.pass_owner = None
            monitor.after_pass(scheduler)
        monitor.pass_owner = _PP_PASS
        monitor.before_pass(scheduler)
    return original_fn(scheduler, *args, **kwargs)


def around_pp_transfer_pass(original_fn, scheduler, *args, **kwargs):
    """AROUND hook on SchedulerPPMixin.process_decode_transfer_queue: closes the PP decode pass."""
    monitor = _pp_monitor(original_fn, scheduler)
    if monitor is None:
        return original_fn(scheduler, *args, **kwargs)
    if monitor.pass_owner is None:  # a transfer pass without its prealloc pass is a pass of its own
        monitor.before_pass(scheduler)
    return _pass(monitor, scheduler, _PP_PASS, original_fn, args, kwargs, opened=True)


def _pp_monitor(original_fn, scheduler):
    """The decode monitor, unless a process_decode_queue pass holds it (a loop that calls both)."""
    monitor = _monitor_for_pass(scheduler, original_fn, "decode")
    return None if monitor is None or monitor.pass_owner == _QUEUE_PASS else monitor


def _pass(monitor, scheduler, owner, original_fn, args, kwargs, opened=False):
    if not opened:
        monitor.before_pass(scheduler)
    monitor.pass_owner = owner
    try:
        result = original_fn(scheduler, *args, **kwargs)
    finally:
        # SGLang's own exception goes up untouched; the next pass opens afresh.
        monitor.pass_owner = None
    monitor.after_pass(scheduler)
    return result


def _around(mode, original_fn, scheduler, args, kwargs):
    monitor = _monitor_for_pass(scheduler, original_fn, mode)
    if monitor is None:
        return original_fn(scheduler, *args, **kwargs)
    monitor.before_pass(scheduler)
    result = original_fn(scheduler, *args, **kwargs)
    monitor.after_pass(scheduler)
    return result


_HOOKS = {METHOD: around_inflight_pass, DECODE_METHOD: around_decode_pass,
          PP_PREALLOC_METHOD: around_pp_prealloc_pass, PP_TRANSFER_METHOD: around_pp_transfer_pass}


def install(mixin_class, method=METHOD):
    """Patches the method directly, for SGLang releases without the plugin framework.

    Returns False when the class already carries this hook.
    """
    original = getattr(mixin_class, method)
    if getattr(original, "__sglang_watchdog_hook__", False):
        return False
    around = _HOOKS[method]

    @functools.wraps(original)
    def hooked(self, *args, **kwargs):
        return around(original, self, *args, **kwargs)

    hooked.__sglang_watchdog_hook__ = True
    setattr(mixin_class, method, hooked)
    if method == METHOD:
        transfer_watch.install()  # before SGLang builds its KV managers, whose workers start at once
    return True


def monitor_for(scheduler):
    """The scheduler's monitor once its first hooked pass has run, else None."""
    return _monitors["prefill"].get(scheduler) or _monitors["decode"].get(scheduler)


def _monitor_for_pass(scheduler, original_fn, mode):
    monitors = _monitors[mode]
    try:
        return monitors[scheduler]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: nothing to attach state to
        return None
    with _monitors_lock:
        if scheduler not in monitors:
            monitors[scheduler] = _start(scheduler, original_fn, mode)
        return monitors[scheduler]


def _start(scheduler, original_fn, mode):
    try:
        identity = identify(scheduler)
        if identity.mode != mode:
            logger.debug("sglang-watchdog plugin idle on this scheduler: %s", identity)
            return None
        config = Config.from_env()
        if config.disabled:
            logger.info("sglang-watchdog plugin disabled by SGLANG_WATCHDOG_PLUGIN_DISABLE")
            return None
        if identity.publishes_transfers:
            _publish(scheduler, identity)
            return None
        if not identity.serves_listener:
            logger.debug("sglang-watchdog plugin idle on this scheduler: %s", identity)
            return None
        monitor = (DecodeMonitor if mode == "decode" else Monitor)(identity)
        monitor.configure(scheduler, original_fn)
        monitor.listener = start_listener(monitor, config)
        return monitor if monitor.listener is not None else None
    except Exception:
        logger.exception("sglang-watchdog plugin could not start; the scheduler runs without it")
        return None


def _publish(scheduler, identity):
    """A non-leader prefill rank: its outstanding chunks, for the leader's listing (peers.py)."""
    manager = getattr(getattr(scheduler, "disagg_prefill_bootstrap_queue", None), "kv_manager", None)
    folder = peers.directory(scheduler, identity)
    queues = getattr(manager, "transfer_queues", None)
    for queue in queues if isinstance(queues, list) else ():
        transfer_watch.bind_links(queue, manager)
    try:
        _publishers[scheduler] = peers.Publisher(folder, identity, manager).start()
    except peers.UnsafeFolder as e:
        logger.error("sglang-watchdog plugin does not publish the transfers of attn_tp_rank=%d attn_cp_rank=%d: %s; "
                     "the leader counts this rank as unwatched", identity.attn_tp_rank, identity.attn_cp_rank, e)
        return
    logger.info("sglang-watchdog plugin publishes the transfers of attn_tp_rank=%d attn_cp_rank=%d to %s",
                identity.attn_tp_rank, identity.attn_cp_rank, folder)
