"""sglang-watchdog's plugin for SGLang prefill and decode schedulers.

It hooks ``process_disagg_prefill_inflight_queue`` (prefill) and
``process_decode_queue`` (decode), serves the requests waiting there as
``GET /debug/inflight`` and accepts ``POST /admin/force_fail`` and
``POST /admin/wedge_order`` orders that it applies on the scheduler thread
(see docs/plugin.md).

This module stays import-free: the .pth loader imports the package in every
Python process, most of which never run SGLang.
"""

__version__ = "0.1.0"


def register():
    """Entry point of SGLang's plugin framework (group ``sglang.srt.plugins``)."""
    import logging

    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        logging.getLogger("sglang_watchdog_plugin").warning(
            "SGLang's plugin framework is not importable; the watchdog hook is not registered"
        )
        return

    from . import transfer_watch
    from .hook import DECODE_TARGET, TARGET, around_decode_pass, around_inflight_pass

    HookRegistry.register(TARGET, around_inflight_pass, HookType.AROUND)
    HookRegistry.register(DECODE_TARGET, around_decode_pass, HookType.AROUND)
    # SGLang loads plugins before it builds the scheduler and its KV managers, whose transfer workers
    # call FastQueue.get at once: watched from here, each worker is tracked from its first chunk.
    transfer_watch.install()
