"""Loads the hook into SGLang releases that predate the plugin framework.

sglang_watchdog_plugin.pth imports this module at every interpreter start,
including SGLang's spawned scheduler processes. All it does there is put a
finder on sys.meta_path that ignores every module except
``sglang.srt.disaggregation.prefill``, ``sglang.srt.disaggregation.decode``
and ``sglang.srt.managers.scheduler_pp_mixin``; once one of them has
executed, the hooks are installed on its mixin (on the PP mixin, only the
PP decode passes it has: releases before v0.5.10 have no PP decode loop). Processes that never import SGLang are left
alone, and no failure here may break interpreter start or SGLang.

Where SGLang's plugin framework exists and this package's entry point is
installed, the framework loads the hook instead (honouring SGLANG_PLUGINS),
so the method is never wrapped twice. A SGLANG_PLUGINS whitelist that does
not name sglang_watchdog keeps the framework from loading it; this loader
honours that too, and says so on SGLang's log, since the sidecar then finds
no plugin.
"""

import sys

# Module -> (mixin class, hooked methods, whether each must exist).
_TARGETS = {
    "sglang.srt.disaggregation.prefill": ("SchedulerDisaggregationPrefillMixin",
                                          ("process_disagg_prefill_inflight_queue",), True),
    "sglang.srt.disaggregation.decode": ("SchedulerDisaggregationDecodeMixin", ("process_decode_queue",), True),
    "sglang.srt.managers.scheduler_pp_mixin": ("SchedulerPPMixin",
                                               ("process_prealloc_queue", "process_decode_transfer_queue"), False),
}


class _DisaggregationFinder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TARGETS:
            return None
        try:
            spec = self._find_elsewhere(fullname, path, target)
            if spec is None or not hasattr(spec.loader, "exec_module"):
                return None
            spec.loader = _HookingLoader(spec.loader)
            return spec
        except Exception:
            return None  # let the import machinery carry on as if we were not there

    def _find_elsewhere(self, fullname, path, target):
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


class _HookingLoader:
    """Delegates to the real loader and installs the hook once the module has run."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            framework = _plugin_framework()
            if framework == _EXCLUDED:
                import logging

                logging.getLogger("sglang_watchdog_plugin").warning(
                    "SGLANG_PLUGINS=%s does not name sglang_watchdog, so SGLang's plugin framework skips the "
                    "sglang-watchdog plugin and %s runs without it: add sglang_watchdog to SGLANG_PLUGINS, or "
                    "unset it to load every installed plugin", _whitelist_text(), module.__name__)
            elif framework == _ABSENT:
                from .hook import install

                mixin, methods, required = _TARGETS[module.__name__]
                cls = getattr(module, mixin)
                for method in methods:
                    if required or hasattr(cls, method):
                        install(cls, method)
        except Exception:
            import logging

            logging.getLogger("sglang_watchdog_plugin").exception(
                "could not hook %s; SGLang runs without the watchdog plugin", module.__name__
            )


_ABSENT, _LOADS, _EXCLUDED = "absent", "loads", "excluded"


def _plugin_framework():
    """Whether SGLang's plugin framework loads this plugin: _LOADS, _EXCLUDED (its SGLANG_PLUGINS
    whitelist leaves it out, as sglang/srt/plugins/__init__.py reads it in v0.5.18) or _ABSENT (no
    framework, or our entry point is not installed: this loader hooks instead)."""
    import importlib.util
    from importlib.metadata import entry_points

    if importlib.util.find_spec("sglang.srt.plugins") is None:
        return _ABSENT
    if not any(ep.name == "sglang_watchdog" for ep in entry_points(group="sglang.srt.plugins")):
        return _ABSENT
    allowed = {name.strip() for name in _whitelist_text().split(",") if name.strip()}
    return _EXCLUDED if allowed and "sglang_watchdog" not in allowed else _LOADS


def _whitelist_text():
    import os

    return os.environ.get("SGLANG_PLUGINS", "")


if not any(isinstance(finder, _DisaggregationFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _DisaggregationFinder())
