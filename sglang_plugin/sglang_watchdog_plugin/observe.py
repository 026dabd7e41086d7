"""Read-only observation of KV senders, and the force-fail lever.

Nothing here calls ``poll()``: on some backends it has side effects (Mooncake
caches a terminal state in ``conclude_state``), and its result feeds SGLang's
MIN all-reduce, so only SGLang's own pass may call it.

Attributes read per backend:

* NIXL (newest): ``_send_failed``, then ``kv_mgr.check_status(room)``, as
  its poll() does (it ignores ``conclude_state``); progress from
  ``chunk_id`` (chunks handed to the transfer workers).
* Mooncake and other ``CommonKVSender`` backends: ``conclude_state``, then
  ``kv_mgr.check_status(room)``; progress from ``curr_idx`` (pages handed over).
* Fake (health checks, warm-up): ``conclude_state``, then ``has_sent`` (its
  ``poll()`` reports WaitingForInput until ``send()`` ran, then Success);
  no progress (-1).
"""

import sys

FAILED, BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS = range(5)
UNKNOWN = -1

_POLL_NAMES = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")

# Tried in order: NIXL senders carry both, and chunk_id is the finer signal there.
_PROGRESS_ATTRIBUTES = ("chunk_id", "curr_idx")


def poll_name(code):
    return _POLL_NAMES[code] if 0 <= code < len(_POLL_NAMES) else "Unknown"


def as_poll_code(value):
    """Maps a KVPoll value (int or IntEnum) to its int, anything else to UNKNOWN."""
    if value.__class__ is not int:  # the fast path is a plain int
        if not isinstance(value, int) or isinstance(value, bool):
            return UNKNOWN
        value = int(value)
    return value if 0 <= value < len(_POLL_NAMES) else UNKNOWN


def observe(sender, room):
    """Returns (poll code, progress, lever set) for one sender, as its poll() would see it.

    Runs for every room on re-observation, hence the flat shape.
    """
    send_failed = getattr(sender, "_send_failed", None)
    if send_failed is not None:
        # NIXL's poll() reads _send_failed, then the manager's status, and never
        # conclude_state: a conclude_state left by abort() must not read as Failed.
        if send_failed:
            return FAILED, progress_of(sender), True
        return _transfer_status(sender, room), progress_of(sender), False
    concluded = getattr(sender, "conclude_state", None)
    if concluded is not None:
        code = as_poll_code(concluded)
        return code, progress_of(sender), code == FAILED
    return _transfer_status(sender, room), progress_of(sender), False


def _transfer_status(sender, room):
    check_status = getattr(getattr(sender, "kv_mgr", None), "check_status", None)
    if check_status is not None:
        try:
            return as_poll_code(check_status(room))
        except Exception:  # KeyError once a room is cleared; any other failure reads the same
            return UNKNOWN
    has_sent = getattr(sender, "has_sent", None)
    if has_sent is None:
        return UNKNOWN
    return SUCCESS if has_sent else WAITING_FOR_INPUT


def progress_of(sender):
    for name in _PROGRESS_ATTRIBUTES:
        value = getattr(sender, name, None)
        if value.__class__ is int:
            return value
    return -1


def lever_name(sender):
    return "_send_failed" if hasattr(sender, "_send_failed") else "conclude_state"


def pull_lever(sender):
    """Sets the backend's lever so that the sender's next poll() reports Failed."""
    if hasattr(sender, "_send_failed"):
        # NIXL's poll() checks _send_failed first and ignores conclude_state.
        sender._send_failed = True
    else:
        sender.conclude_state = _kvpoll_failed()


def _kvpoll_failed():
    # Prefer SGLang's own constant in case a release turns KVPoll into an enum;
    # the module is already loaded wherever a real sender exists.
    conn = sys.modules.get("sglang.srt.disaggregation.base.conn")
    return getattr(getattr(conn, "KVPoll", None), "Failed", FAILED)
