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
* NIXL up to v0.5.11 (no ``_send_failed``): once ``has_sent``, poll() reads
  its transfer handles and answers WaitingForInput while any is in flight;
  the listing says WaitingForInput then too, not Unknown.
* Fake (health checks, warm-up): ``conclude_state``, then ``has_sent`` (its
  ``poll()`` reports WaitingForInput until ``send()`` ran, then Success);
  no progress (-1).
"""

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
    if getattr(sender, "has_sent", False) is True and getattr(sender, "xfer_handles", None) is not None:
        # NIXL up to v0.5.11 (nixl/conn.py NixlKVSender.poll): once the KV is sent, poll() reads the
        # transfer handles, never the manager's status (from which the room is gone: KeyError), and
        # answers WaitingForInput until every handle is DONE. Reading the handles means calling the
        # NIXL agent, which only SGLang's pass does; in flight is the state that matters here.
        return WAITING_FOR_INPUT
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
    """The version 1 ``lever`` field: the attribute older clients know the backend by."""
    return "_send_failed" if hasattr(sender, "_send_failed") else "conclude_state"


def outstanding_chunks(sender, room):
    """Chunks of this room that a transfer worker has dequeued or posted and not settled (0 if unknown).

    The newest NIXL, Mooncake and Mori managers count them per room in
    ``_staging_outstanding`` (a defaultdict: read with get, never index it).
    """
    counts = getattr(getattr(sender, "kv_mgr", None), "_staging_outstanding", None)
    if counts is None:
        return 0
    try:
        value = counts.get(room, 0)
    except Exception:
        return 0
    return value if value.__class__ is int and value > 0 else 0
