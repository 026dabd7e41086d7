"""Decode side, deferred release: whether SGLang holds a released request's pages until prefill's writes drained.

Where it does, a decode order registers the room as a deferred abort, as
``Scheduler.abort_request`` does; where it does not, a release frees the
pages at once, and only a request whose transfer never started (or whose
prefill peer stopped sending) may be released.
"""

import inspect
import os
import sys


DEFERRED_SETTING = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


def deferred_release(manager, env=None):
    """Whether SGLang's decode transfer queue will hold a released request's pages until prefill acks that its
    writes drained (deferred decode KV release); None where this SGLang has no such thing.

    No release up to v0.5.18 has it (no ``enable_deferred_decode_kv_release`` on the managers). In upstream
    main (2026-08-23) the manager's flag (``CommonKVManager.__init__``, disaggregation/common/conn.py) and the
    transfer queue's hold (``DecodeTransferQueue.enable_deferred_kv_release``, disaggregation/decode.py) both
    read SGLang's setting (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, off by default) when built,
    so flag and setting agree; conformance_tests/test_deferred.py plays it on and off. The rule still asks the
    setting and a class opt-out (``supports_deferred_decode_kv_release``) as well as the flag, against a
    manager whose flag says on while the transfer queue frees at once (issue 18 point 6 describes such earlier
    upstream code; that snapshot has neither). So it is on only when the flag, the class and the setting all
    say so; a setting that cannot be read counts as off, under which a release frees the pages at once.
    """
    value = getattr(manager, "enable_deferred_decode_kv_release", None)
    if not isinstance(value, bool):
        return None
    if getattr(manager, "supports_deferred_decode_kv_release", True) is not True:
        return False
    return value and deferred_setting(env) is True


def deferred_setting(env=None):
    """SGLang's deferred-release setting as its code reads it: from SGLang's ``envs`` where loaded (its default
    included), else the variable as SGLang's EnvBool parses it; None when neither says."""
    envs = getattr(sys.modules.get("sglang.srt.environ"), "envs", None)
    get = getattr(getattr(envs, DEFERRED_SETTING, None), "get", None)
    if callable(get):
        try:
            value = get()
        except Exception:
            return None
        return value if isinstance(value, bool) else None
    text = (os.environ if env is None else env).get(DEFERRED_SETTING)
    if text is None:
        return None
    text = text.strip().lower()
    if text in ("1", "true", "yes", "y", "on"):
        return True
    if text in ("0", "false", "no", "n", "off", ""):
        return False
    return None


def can_register_deferred(manager):
    """Whether register_deferred_abort_room(room) can be called the way Scheduler.abort_request calls it."""
    register = getattr(manager, "register_deferred_abort_room", None)
    if not callable(register):
        return False
    try:
        inspect.signature(register).bind(0)
        return True
    except (TypeError, ValueError):
        return False
