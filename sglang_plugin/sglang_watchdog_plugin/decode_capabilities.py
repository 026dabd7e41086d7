"""Decode side, capabilities: which decode lever works on this SGLang, and when a release is safe, read from its code.

As on the prefill side (capabilities.py), decided from the code itself, never
from the version string: whether the decode queues' Failed branches release
a request, whether a receiver's ``abort()`` latches Failed and its ``poll()``
returns it, and whether a request still resolving its prefill peer can be
released without killing the scheduler.
"""

import ast
import types

from . import capabilities, kv_threads
from .capabilities import ABORT, Capabilities
from .observe import FAILED, as_poll_code


def pass_problem(scheduler):
    """Why the decode queues' Failed branches cannot be trusted, or ""."""
    transfer = type(getattr(scheduler, "disagg_decode_transfer_queue", None))
    problem = capabilities.failed_branch_problem(
        getattr(transfer, "pop_transferred", None), "DecodeTransferQueue.pop_transferred", "decode transfer queue")
    if problem:
        return problem
    prealloc = type(getattr(scheduler, "disagg_decode_prealloc_queue", None))
    # The handshake's Failed branch moved out of pop_preallocated in newer releases.
    for name in ("_update_handshake_waiters", "pop_preallocated"):
        fn = getattr(prealloc, name, None)
        if fn is None:
            continue
        problem = capabilities.failed_branch_problem(fn, f"DecodePreallocQueue.{name}", "decode prealloc queue")
        if not problem or "raises" in problem:
            return problem
    return problem or "the decode prealloc queue has no pass the plugin can read"


def detect(receiver_cls, problem):
    """Capabilities of a receiver class: ["abort"] when abort() latches Failed and poll() returns it."""
    name = receiver_cls.__name__
    if problem:
        return Capabilities((), problem)
    if getattr(receiver_cls, "abort", None) is None:
        return Capabilities((), f"{name} has no abort()")
    latches = _abort_latches(receiver_cls)
    if latches is None:
        return Capabilities((), f"{name}.abort() cannot be read nor safely probed; no lever is known to work")
    if not latches:
        return Capabilities((), f"{name}.abort() does not latch conclude_state = Failed")
    reads = _poll_returns_latch(receiver_cls)
    if not reads:
        return Capabilities((), f"{name}.poll() does not return a latched conclude_state"
                            if reads is False else f"{name}.poll() cannot be read")
    return Capabilities((ABORT,), "")


def _abort_latches(receiver_cls):
    """Whether abort() sets conclude_state = Failed: True, False or None (unknown).

    Read from the source along the MRO (an override may call super().abort());
    without source, probed on a blank instance whose abort has nobody to notify.
    """
    for cls in receiver_cls.__mro__:
        fn = cls.__dict__.get("abort")
        if fn is None:
            continue
        tree = capabilities._function_tree(fn)
        if tree is None:
            return _probe_abort(receiver_cls)
        if _assigns(tree, "conclude_state") and capabilities._mentions(tree, "Failed"):
            return True
        if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "abort"
                   for n in ast.walk(tree)):
            return False
    return False


def _probe_abort(receiver_cls):
    try:
        blank = object.__new__(receiver_cls)
        blank.__dict__.update({
            "conclude_state": None, "bootstrap_room": 7, "abort_notified": True, "bootstrap_infos": None,
            "kv_mgr": types.SimpleNamespace(record_failure=lambda *a: None, update_status=lambda *a: None,
                                            failure_records={}, enable_deferred_decode_kv_release=False),
        })
        receiver_cls.abort(blank)
        return as_poll_code(blank.__dict__.get("conclude_state")) == FAILED
    except Exception:
        return None


def _poll_returns_latch(receiver_cls):
    tree = capabilities._function_tree(getattr(receiver_cls, "poll", None))
    if tree is not None:
        return "conclude_state" in capabilities._attributes(tree)
    try:
        blank = object.__new__(receiver_cls)
        blank.__dict__["conclude_state"] = capabilities._kvpoll("Failed", FAILED)
        return as_poll_code(receiver_cls.poll(blank)) == FAILED
    except Exception:
        return None


def _assigns(tree, attr):
    return any(isinstance(t, ast.Attribute) and t.attr == attr
               for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets)


_pending_problems = {}


def pending_release_problem(prealloc_cls):
    """Why releasing a request still in ``pending_reqs`` would kill the decode scheduler, or "".

    From v0.5.10 a prealloc request whose prefill peer is not resolved yet
    sits in ``DecodePreallocQueue.pending_reqs`` too, and each pass's
    ``_resolve_pending_reqs`` calls its receiver (``init``, or ``abort()``
    after 15 failed attempts, ``_ensure_prefill_info``). Once released, the
    failed request leaves ``queue`` in ``pop_preallocated``. Where that pass
    also sets its ``kv_receiver`` to None but leaves it in ``pending_reqs``
    (SGLang v0.5.14), the next call on the receiver raises AttributeError and
    the scheduler dies, about 14 s later; SGLang's own ``abort_request`` does
    the same there. v0.5.10 and v0.5.11 keep the receiver (``pop_preallocated``
    clears nothing), v0.5.18 drops the failed request from ``pending_reqs``
    too ("DecodeRequest is shared between self.queue and self.pending_reqs").
    Read from the code, not from the version: a pass that cannot be read is
    a problem.
    """
    known = _pending_problems.get(prealloc_cls)
    if known is not None:
        return known
    name = "DecodePreallocQueue.pop_preallocated"
    tree = capabilities._function_tree(getattr(prealloc_cls, "pop_preallocated", None))
    if tree is None:
        problem = (f"{name} cannot be read, so whether a released request still in pending_reqs keeps a receiver "
                   "for SGLang's next _resolve_pending_reqs is unknown")
    elif _assigns_none(tree, "kv_receiver") and not _assigns(tree, "pending_reqs"):
        problem = (f"{name} sets a failed request's kv_receiver to None but leaves it in pending_reqs, where "
                   "SGLang's next _resolve_pending_reqs calls that receiver (AttributeError: the decode scheduler "
                   "dies); a request still resolving its prefill peer cannot be released on this SGLang")
    else:
        problem = ""
    _pending_problems[prealloc_cls] = problem
    return problem


def _assigns_none(tree, attr):
    return any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is None
               and any(isinstance(t, ast.Attribute) and t.attr == attr for t in node.targets)
               for node in ast.walk(tree))


_ABORT_FRAMES = (b"ABORT", "ABORT")
_abort_frame_problems = {}


def abort_frame_problem(receiver_cls, manager_cls):
    """Why calling this receiver's ``abort()`` once it knows its prefill peers would stop prefill serving, or "".

    SGLang's own receiver ``abort()`` tells the prefill ranks it bootstrapped
    from with an ``ABORT`` frame on their bootstrap socket
    (``CommonKVReceiver._send_abort_notification``, ``disaggregation/common/conn.py``,
    v0.5.18), as its ``abort_request`` and its waiting timeout do. A prefill
    manager whose bootstrap thread has no branch for that frame takes it for a
    registration: NIXL's asserts ("First message should be b'NixlMsgGuard'.
    Foreign traffic?", ``NixlKVManager._start_bootstrap_thread``,
    ``disaggregation/nixl/conn.py``) and the thread dies, so that every later
    request to that prefill rank waits in its bootstrap queue for ever. SGLang
    shipped that pair between v0.5.11 (no frame sent) and v0.5.18 (NIXL reads
    it, ``_handle_abort_notification``). Read from the code, never from a
    version: the frame in the receiver's ``abort()`` (or a method of the
    receiver it calls), and a comparison with it in the manager's bootstrap
    thread (or a method of the manager it calls). The prefill side is taken to
    run the same SGLang as this decode server, as SGLang's PD deployments do.
    """
    key = (receiver_cls, manager_cls)
    known = _abort_frame_problems.get(key)
    if known is None:
        known = _abort_frame_problems[key] = _abort_frame_problem(receiver_cls, manager_cls)
    return known


def _abort_frame_problem(receiver_cls, manager_cls):
    name = receiver_cls.__name__
    sends = _reaches_frame(receiver_cls, getattr(receiver_cls, "abort", None), compared=False)
    if sends is False:
        return ""
    if sends is None:
        return (f"{name}.abort() cannot be read, so whether it sends prefill an ABORT frame that prefill's bootstrap "
                "thread can read is unknown; a request that knows its prefill peers is not released")
    starters = bootstrap_starters(manager_cls)
    reads = None
    for starter in starters:
        reads = _reaches_frame(manager_cls, starter, compared=True)
        if reads is not False:
            break
    if reads:
        return ""
    manager = getattr(manager_cls, "__name__", "the KV manager")
    if reads is None:
        return (f"{name}.abort() sends prefill an ABORT frame and {manager}'s bootstrap thread cannot be read, so "
                "whether the frame would kill it is unknown; a request that knows its prefill peers is not released")
    return (f"{name}.abort() sends prefill an ABORT frame that {manager}'s bootstrap thread does not read: on this "
            "SGLang the frame kills prefill's bootstrap thread (its assert on the first part of every frame), and "
            "every later request to that prefill rank waits in its bootstrap queue for ever. SGLang's own "
            "abort_request does the same here; a request that knows its prefill peers is not released, leave it "
            "to SGLang's waiting timeout or restart the prefill server")


def bootstrap_starters(manager_cls):
    """The manager's methods that start its prefill bootstrap thread: those that define a function SGLang runs as
    one (``bootstrap_thread`` in NIXL's ``_start_bootstrap_thread`` and Mooncake's ``start_prefill_thread``)."""
    found, seen = [], set()
    for cls in getattr(manager_cls, "__mro__", ()):
        if not cls.__module__.startswith("sglang."):
            continue
        for name, fn in vars(cls).items():
            if name in seen or not callable(fn):
                continue
            seen.add(name)
            tree = capabilities._function_tree(fn)
            if tree is not None and any(isinstance(node, ast.FunctionDef) and node is not tree and
                                        kv_threads.role_of(node.name) == kv_threads.BOOTSTRAP
                                        for node in ast.walk(tree)):
                found.append(fn)
    return found


def _reaches_frame(cls, fn, compared):
    """Whether ``fn``, or a method of ``cls`` it calls on ``self`` (once removed), holds the ABORT frame.

    ``compared``: only a comparison with the frame counts (a reader), else any
    use of it (a sender). None when ``fn`` cannot be read.
    """
    tree = capabilities._function_tree(fn)
    if tree is None:
        return None
    if _holds_frame(tree, compared):
        return True
    for called in _self_calls(tree):
        sub = capabilities._function_tree(getattr(cls, called, None))
        if sub is not None and _holds_frame(sub, compared):
            return True
    return False


def _holds_frame(tree, compared):
    for node in ast.walk(tree):
        if compared and isinstance(node, ast.Compare):
            if any(isinstance(side, ast.Constant) and side.value in _ABORT_FRAMES
                   for side in (node.left, *node.comparators)):
                return True
        elif not compared and isinstance(node, ast.Constant) and node.value in _ABORT_FRAMES:
            return True
    return False


def _self_calls(tree):
    return {node.func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"}
