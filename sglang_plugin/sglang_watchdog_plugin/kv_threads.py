"""SGLang's own threads of a KV manager, found once and watched: a dead one is a wedge nothing in SGLang notices.

Every KV manager runs threads SGLang starts in its constructor and never
watches: the bootstrap thread that reads decode's frames (prefill), one
transfer worker per transfer queue (prefill), the decode listener and the
heartbeat checker. Each loops for ever, so an exception ends it silently:
a Mooncake transfer worker that raises leaves its queue undrained
(``MooncakeKVManager.transfer_worker``, ``disaggregation/mooncake/conn.py``),
and a NIXL prefill bootstrap thread that meets a frame it does not know
asserts and dies (``NixlKVManager._start_bootstrap_thread``,
``disaggregation/nixl/conn.py``: "First message should be b'NixlMsgGuard'.
Foreign traffic?"), after which no request bootstraps again.

A thread is SGLang's manager's when its target is a method of the manager
or a function that closes over it (``threading.Thread(target=bootstrap_thread)``
inside a method). Python drops a thread's target once it ends, so threads
are found while alive, at the plugin's first hooked pass, and remembered:
a thread that died before that pass is not listed.
"""

import threading

BOOTSTRAP, TRANSFER_WORKER, DECODE_LISTENER, HEARTBEAT, OTHER = (
    "bootstrap", "transfer_worker", "decode_listener", "heartbeat", "other")

# SGLang's target function names, per role (v0.4.6 to upstream main; Mori's names included).
_ROLES = {
    "bootstrap_thread": BOOTSTRAP,
    "bootstrap_worker": BOOTSTRAP,
    "transfer_worker": TRANSFER_WORKER,
    "_transfer_worker": TRANSFER_WORKER,
    "transfer_thread": TRANSFER_WORKER,  # Mooncake v0.4.6: one thread drains the manager's one queue.Queue
    "decode_thread": DECODE_LISTENER,
    "decode_worker": DECODE_LISTENER,
    "heartbeat_checker": HEARTBEAT,
}


class KVThread:
    __slots__ = ("thread", "role", "function", "transfer_queue")

    def __init__(self, thread, role, function, transfer_queue):
        self.thread, self.role, self.function, self.transfer_queue = thread, role, function, transfer_queue

    def json(self):
        row = {"role": self.role, "function": self.function, "alive": self.thread.is_alive()}
        if self.transfer_queue is not None:
            row["transfer_queue"] = self.transfer_queue
        return row


def find(manager):
    """The live threads serving ``manager``, in a stable order (role, queue, function)."""
    if manager is None:
        return ()
    queues = getattr(manager, "transfer_queues", None)
    queues = list(queues) if isinstance(queues, (list, tuple)) else []
    found = []
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        if target is None or not _serves(target, manager):
            continue
        function = getattr(target, "__name__", type(target).__name__)[:128]
        role = role_of(function)
        queue = None
        if role == TRANSFER_WORKER:
            args = getattr(thread, "_args", ()) or ()
            queue = next((i for i, q in enumerate(queues) if args and args[0] is q), None)
        found.append(KVThread(thread, role, function, queue))
    found.sort(key=lambda t: (t.role, -1 if t.transfer_queue is None else t.transfer_queue, t.function))
    return tuple(found)


def role_of(function):
    """The role of a thread that runs SGLang's function of this name."""
    return _ROLES.get(function, OTHER)


def _serves(target, manager):
    if getattr(target, "__self__", None) is manager:
        return True
    closure = getattr(target, "__closure__", None) or ()
    for cell in closure:
        try:
            if cell.cell_contents is manager:
                return True
        except ValueError:  # an empty cell
            continue
    return False


def listing(threads):
    """The listing's ``kv_threads``: None while no thread of the manager is known (none looked for, or none
    found: a manager whose threads are not SGLang's), which the watchdog reads as unknown, never as dead."""
    return [t.json() for t in threads] if threads else None


def dead(threads):
    return [t for t in threads or () if not t.thread.is_alive()]
