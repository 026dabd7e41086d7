"""The AROUND hook on SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue.

It works with both signatures: ``(self)`` (older releases, called only while
the queue is non-empty) and ``(self, rids_to_check=None) -> List[Req]``
(newest); arguments and the return value pass through untouched. Nothing it
does may raise into the scheduler: the Monitor catches its own failures, and
a scheduler the plugin cannot set up runs unhooked.
"""

import functools
import logging
import threading
import weakref

from .config import Config
from .identity import identify
from .monitor import Monitor
from .server import start_listener

logger = logging.getLogger("sglang_watchdog_plugin")

METHOD = "process_disagg_prefill_inflight_queue"
TARGET = f"sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.{METHOD}"

# Scheduler -> Monitor, or None for schedulers that run unhooked (not prefill,
# not the attention-TP leader, disabled, or the listener could not start).
_monitors = weakref.WeakKeyDictionary()
_monitors_lock = threading.Lock()


def around_inflight_pass(original_fn, scheduler, *args, **kwargs):
    """AROUND hook in the shape of SGLang's HookRegistry: fn(original_fn, *args, **kwargs)."""
    monitor = _monitor_for_pass(scheduler, original_fn)
    if monitor is None:
        return original_fn(scheduler, *args, **kwargs)
    monitor.before_pass(scheduler)
    result = original_fn(scheduler, *args, **kwargs)
    monitor.after_pass(scheduler)
    return result


def install(mixin_class):
    """Patches the method directly, for SGLang releases without the plugin framework.

    Returns False when the class already carries this hook.
    """
    original = getattr(mixin_class, METHOD)
    if getattr(original, "__sglang_watchdog_hook__", False):
        return False

    @functools.wraps(original)
    def process_disagg_prefill_inflight_queue(self, *args, **kwargs):
        return around_inflight_pass(original, self, *args, **kwargs)

    process_disagg_prefill_inflight_queue.__sglang_watchdog_hook__ = True
    setattr(mixin_class, METHOD, process_disagg_prefill_inflight_queue)
    return True


def monitor_for(scheduler):
    """The scheduler's Monitor once its first hooked pass has run, else None."""
    return _monitors.get(scheduler)


def _monitor_for_pass(scheduler, original_fn):
    try:
        return _monitors[scheduler]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: nothing to attach state to
        return None
    with _monitors_lock:
        if scheduler not in _monitors:
            _monitors[scheduler] = _start(scheduler, original_fn)
        return _monitors[scheduler]


def _start(scheduler, original_fn):
    try:
        config = Config.from_env()
        if config.disabled:
            logger.info("sglang-watchdog plugin disabled by SGLANG_WATCHDOG_PLUGIN_DISABLE")
            return None
        identity = identify(scheduler)
        if not identity.serves_listener:
            logger.debug("sglang-watchdog plugin idle on this scheduler: %s", identity)
            return None
        monitor = Monitor(identity)
        monitor.configure(scheduler, original_fn)
        monitor.listener = start_listener(monitor, config)
        return monitor if monitor.listener is not None else None
    except Exception:
        logger.exception("sglang-watchdog plugin could not start; the scheduler runs without it")
        return None
