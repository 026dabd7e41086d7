"""sglang-watchdog's plugin for SGLang prefill schedulers.

It hooks ``process_disagg_prefill_inflight_queue``, serves the inflight queue
as ``GET /debug/inflight`` and accepts ``POST /admin/force_fail`` orders that
it applies on the scheduler thread (see docs/plugin.md).

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

    from .hook import TARGET, around_inflight_pass

    HookRegistry.register(TARGET, around_inflight_pass, HookType.AROUND)
