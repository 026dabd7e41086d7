"""Which levers release a request on this SGLang, worked out from the code itself.

Decided once per sender class (and once per process for the inflight pass),
never from the version string: what counts is whether the sender's
``poll()`` would read a lever, whether the manager's ``update_status`` lets
Failed stick, and whether the scheduler's Failed branch releases the request
rather than raising (the earliest prefill.py raises there). Where the code
cannot be read and no harmless probe decides, the answer is "no lever", and
``note`` says why: a force-fail must never answer "flipped" when nothing will
happen.

The probes run on blank instances made with ``object.__new__``: they never
touch a live sender or manager.
"""

import ast
import inspect
import logging
import sys
import textwrap
import types
from typing import NamedTuple

from .observe import FAILED, TRANSFERRING

logger = logging.getLogger("sglang_watchdog_plugin")

ABORT = "abort"
SEND_FAILED = "_send_failed"

_PROBE_ROOM = 7


class Capabilities(NamedTuple):
    levers: tuple  # in the order they are pulled
    note: str  # why levers is empty or partial; "" when every lever works


class QueueKey(NamedTuple):
    """How the KV manager picks a transfer worker queue for a room."""

    count: int | None  # number of queues, None if unknown
    rule: str | None  # "dst_port_sum", "session_port_sum", "room" or None (unknown)


def failed_branch_problem(pass_fn, name="process_disagg_prefill_inflight_queue", what="inflight pass"):
    """Why a pass's Failed branch cannot be trusted, or "" if it releases the request."""
    tree = _function_tree(pass_fn)
    if tree is None:
        return (f"the source of {name} cannot be read, so whether its "
                "Failed branch releases the request or raises is unknown")
    branches = [node for node in ast.walk(tree) if isinstance(node, ast.If) and _mentions(node.test, "Failed")]
    if not branches:
        return f"{name} has no KVPoll.Failed branch that the plugin can find"
    for branch in branches:
        if any(isinstance(node, ast.Raise) for stmt in branch.body for node in ast.walk(stmt)):
            return (f"this SGLang's {what} raises in its KVPoll.Failed branch, which would crash the "
                    "scheduler: no lever is pulled")
    return ""


def detect(sender_cls, manager_cls, pass_problem):
    """The levers that make a sender of this class poll Failed, given the inflight pass's verdict."""
    name = sender_cls.__name__
    if pass_problem:
        return Capabilities((), pass_problem)
    poll = _function_tree(getattr(sender_cls, "poll", None))
    if poll is None:
        reads = _probe_poll(sender_cls)
        if reads is None:
            return Capabilities((), f"{name}.poll() cannot be read nor safely probed; no lever is known to work")
    else:
        reads = _attributes(poll)

    levers, missing = [], []
    abort_note = _abort_works(sender_cls, manager_cls, reads)
    if abort_note:
        missing.append(abort_note)
    else:
        levers.append(ABORT)
    if SEND_FAILED in reads:
        levers.append(SEND_FAILED)
    elif _has_send_failed(sender_cls):
        missing.append(f"{name}.poll() does not read _send_failed")
    if not levers:
        return Capabilities((), "; ".join(missing or [f"no lever makes {name}.poll() return Failed"]))
    return Capabilities(tuple(levers), "; ".join(missing))


def _abort_works(sender_cls, manager_cls, poll_reads):
    """"" when abort() alone makes poll() read Failed, else why not."""
    name = sender_cls.__name__
    if getattr(sender_cls, "abort", None) is None:
        return f"{name} has no abort()"
    trees = _reached(sender_cls, "abort")
    if not trees:
        return f"{name}.abort() cannot be read"
    if all(_inert(tree) for tree in trees):
        return f"{name}.abort() does nothing"
    sets = {t.attr for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Attribute)}
    if "conclude_state" in sets and "conclude_state" in poll_reads:
        return ""
    if any("update_status" in _attributes(tree) for tree in trees) and "check_status" in poll_reads:
        sticks = _failed_sticks(manager_cls)
        if sticks:
            return ""
        if sticks is None:
            return f"whether {getattr(manager_cls, '__name__', 'the manager')}.update_status keeps Failed is unknown"
        return (f"{name}.poll() ignores conclude_state and {manager_cls.__name__}.update_status "
                "does not let Failed override an existing status")
    return f"{name}.poll() reads nothing that abort() sets"


def _reached(cls, method):
    """The function trees a call to cls.method runs: its own body, every ``super().method()`` up the MRO,
    and the sender's own methods it calls on ``self`` (MooncakeKVSender.abort in v0.5.18 is
    ``super().abort()`` plus tracing; CommonKVSender.abort does the work). None where one cannot be read."""
    trees, seen = [], set()
    pending = [(cls, method, None)]
    while pending:
        owner, name, after = pending.pop()
        defining, fn = _resolve(owner, name, after)
        if fn is None or (defining, name) in seen:
            continue
        seen.add((defining, name))
        tree = _function_tree(fn)
        if tree is None:
            return None
        trees.append(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
                pending.append((cls, node.func.attr, defining))
            elif isinstance(target, ast.Name) and target.id == "self" and callable(getattr(cls, node.func.attr, None)):
                pending.append((cls, node.func.attr, None))
    return trees


def _resolve(cls, name, after=None):
    """(class defining cls.name, the function), looking up the MRO past ``after`` when given."""
    mro = cls.__mro__
    start = mro.index(after) + 1 if after in mro else 0
    for klass in mro[start:]:
        if name in vars(klass):
            return klass, vars(klass)[name]
    return None, None


def _inert(tree):
    """A body that changes nothing SGLang reads: pass, docstrings, and calls that are only tracing or logging."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and _is_trace_or_log(stmt.value):
            continue
        return False
    return True


def _is_trace_or_log(call):
    names = []
    node = call.func
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return any(n in ("logger", "logging", "log", "trace_ctx", "tracer", "warning", "debug", "info") or
               n.startswith("trace") for n in names)


def _failed_sticks(manager_cls):
    """Whether update_status(room, Failed) overrides Transferring: True, False or None (unknown)."""
    update = getattr(manager_cls, "update_status", None)
    if update is None:
        return None
    try:
        blank = object.__new__(manager_cls)
        blank.request_status = {_PROBE_ROOM: _kvpoll("Transferring", TRANSFERRING)}
        update(blank, _PROBE_ROOM, _kvpoll("Failed", FAILED))
        return int(blank.request_status[_PROBE_ROOM]) == FAILED
    except Exception:  # needs state a blank instance lacks: the source may still tell
        pass
    tree = _function_tree(update)
    if tree is None:
        return None
    if _mentions(tree, "Failed"):
        return True
    return False if any(isinstance(n, ast.Name) and n.id == "max" for n in ast.walk(tree)) else None


def _probe_poll(sender_cls):
    """Attribute names poll() reads, from a blank instance: only _send_failed and conclude_state are tried."""
    reads = set()
    for attribute, value in ((SEND_FAILED, True), ("conclude_state", _kvpoll("Failed", FAILED))):
        try:
            blank = object.__new__(sender_cls)
            blank.__dict__.update({
                SEND_FAILED: False, "conclude_state": None, "bootstrap_room": _PROBE_ROOM, "has_sent": False,
                "kv_mgr": types.SimpleNamespace(
                    request_status={}, check_status=lambda room: _kvpoll("Transferring", TRANSFERRING)),
            })
            blank.__dict__[attribute] = value
            if int(sender_cls.poll(blank)) == FAILED:
                reads.add(attribute)
        except Exception:
            return None
    return reads | {"check_status"}


def _has_send_failed(sender_cls):
    init = _function_tree(getattr(sender_cls, "__init__", None))
    return init is not None and SEND_FAILED in {
        t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Attribute)}


def queue_key(manager):
    """How this manager shards rooms over its transfer worker queues."""
    queues = getattr(manager, "transfer_queues", None)
    if queues is None:
        queues = getattr(manager, "_transfer_queues", None)
    try:
        count = len(queues) if queues is not None else None
    except TypeError:
        count = None
    if not count:
        return QueueKey(None, None)
    tree = _function_tree(getattr(type(manager), "add_transfer_request", None))
    attrs = _attributes(tree) if tree is not None else set()
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} if tree is not None else set()
    if "dst_port" in attrs and "transfer_infos" in attrs:
        return QueueKey(count, "dst_port_sum")  # newest NIXL: sum of the destinations' ports
    if "session_port_sum" in names:
        return QueueKey(count, "session_port_sum")  # Mooncake: the ports of the "host:port" sessions
    if tree is not None and _room_modulo(tree):
        return QueueKey(count, "room")  # older NIXL
    if hasattr(manager, "_num_shards"):
        return QueueKey(count, "room")  # Mori: room % SGLANG_MORI_TRANSFER_SHARDS
    return QueueKey(count, None)


def transfer_tracking(manager):
    """Whether this manager counts each room's outstanding chunks, which transfer_in_flight then reads.

    The newest NIXL, Mooncake and Mori prefill managers keep the count in
    ``_staging_outstanding`` (incremented when a transfer worker dequeues a
    chunk, decremented once it settled); older managers have none, and a
    ``transfer_in_flight`` of false from them proves nothing.
    """
    counts = getattr(manager, "_staging_outstanding", None)
    return counts is not None and callable(getattr(counts, "get", None))


def queue_of(key, manager, room):
    """The queue index of a room, or None where it cannot be computed (now)."""
    rule = key.rule
    if rule is None:
        return None
    if rule == "room":
        return room % key.count
    infos = getattr(manager, "transfer_infos", None)
    try:
        entries = infos.get(room) if infos is not None else None
        if not entries:
            return None
        if rule == "dst_port_sum":
            return sum(int(info.dst_port) for info in entries.values()) % key.count
        return sum(int(str(session).rsplit(":", 1)[1]) for session in entries) % key.count
    except Exception:
        return None


def _room_modulo(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left = node.left
            if isinstance(left, ast.Name) and "room" in left.id:
                return True
    return False


def _function_tree(fn):
    if fn is None:
        return None
    fn = inspect.unwrap(fn)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        module = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = module.body[0] if module.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _attributes(tree):
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def _mentions(tree, attr):
    return any(isinstance(node, ast.Attribute) and node.attr == attr for node in ast.walk(tree))


def _kvpoll(name, default):
    conn = sys.modules.get("sglang.srt.disaggregation.base.conn")
    return getattr(getattr(conn, "KVPoll", None), name, default)


def sender_classes(scheduler, backend):
    """(sender class, manager class) of this backend, or (None, None) until a sender can be seen."""
    conn = sys.modules.get(f"sglang.srt.disaggregation.{backend}.conn")
    if conn is not None:
        senders = [v for k, v in vars(conn).items() if isinstance(v, type) and k.lower() == f"{backend}kvsender"]
        managers = [v for k, v in vars(conn).items() if isinstance(v, type) and k.lower() == f"{backend}kvmanager"]
        if senders and managers:
            return senders[0], managers[0]
    bootstrap = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    reqs = list(getattr(scheduler, "disagg_prefill_inflight_queue", ())) + list(getattr(bootstrap, "queue", ()) or ())
    for req in reqs:
        found = backend_sender(getattr(req, "disagg_kv_sender", None), backend)
        if found is not None:
            return found
    return None, None


def backend_sender(sender, backend):
    """(sender class, manager class) if this sender is one of the backend's own (not a health check's)."""
    if sender is None or not hasattr(sender, "kv_mgr"):
        return None
    if type(sender).__name__.startswith("Fake") and backend != "fake":
        return None
    return type(sender), type(sender.kv_mgr)

