"""sglang-watchdog's plugin for SGLang prefill and decode schedulers.

It hooks ``process_disagg_prefill_inflight_queue`` (prefill),
``process_decode_queue`` (decode) and, for SGLang's PP decode loop,
``process_prealloc_queue`` and ``process_decode_transfer_queue``, serves the requests waiting there as
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
    from .hook import (
        DECODE_TARGET,
        PP_TARGETS,
        TARGET,
        around_decode_pass,
        around_inflight_pass,
        around_pp_prealloc_pass,
        around_pp_transfer_pass,
    )

    HookRegistry.register(TARGET, around_inflight_pass, HookType.AROUND)
    HookRegistry.register(DECODE_TARGET, around_decode_pass, HookType.AROUND)
    # Every release with the framework (v0.5.11 on) has SGLang's PP decode loop and both of its passes.
    for target, around in zip(PP_TARGETS, (around_pp_prealloc_pass, around_pp_transfer_pass)):
        HookRegistry.register(target, around, HookType.AROUND)
    # SGLang loads plugins before it builds the scheduler and its KV managers, whose transfer workers
    # call FastQueue.get at once: watched from here, each worker is tracked from its first chunk.
    transfer_watch.install()
