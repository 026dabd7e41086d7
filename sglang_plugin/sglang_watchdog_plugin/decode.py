"""Decode side: read-only observation of KV receivers, the decode levers, and decode orders.

One module per job, as on the prefill side: ``decode_observe`` (receivers
and queues, read without calling ``poll()``), ``decode_capabilities`` (which
lever works, read from SGLang's code), ``decode_release`` (SGLang's deferred
KV release) and ``decode_orders`` (a decode force-fail on the scheduler
thread). This module names the decode side's public API in one place.
"""

from .capabilities import ABORT, Capabilities
from .decode_capabilities import detect, pass_problem, pending_release_problem
from .decode_observe import (
    PREALLOC,
    TRANSFER,
    WHERE,
    ReceiverView,
    backend_receiver,
    observe_receiver,
    queued,
    queues,
    receiver_class,
    request_room,
    waiting_for_memory,
)
from .decode_orders import DEFERRED_ABORT, apply_order, transfer_live
from .decode_release import DEFERRED_SETTING, can_register_deferred, deferred_release, deferred_setting

__all__ = [
    "ABORT", "Capabilities", "DEFERRED_ABORT", "DEFERRED_SETTING", "PREALLOC", "TRANSFER", "WHERE", "ReceiverView",
    "apply_order", "backend_receiver", "can_register_deferred", "deferred_release", "deferred_setting", "detect",
    "observe_receiver", "pass_problem", "pending_release_problem", "queued", "queues", "receiver_class",
    "request_room", "transfer_live", "waiting_for_memory",
]
