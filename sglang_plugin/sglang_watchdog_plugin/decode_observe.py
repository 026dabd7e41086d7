"""Decode side, observing: read-only views of KV receivers and of the decode queues.

Where a decode request waits (SGLang v0.5.18, ``disaggregation/decode.py``): a ``DecodeRequest``
(fields ``req``, ``kv_receiver``, ``waiting_for_input``,
``metadata_buffer_index``) sits in ``disagg_decode_prealloc_queue.queue``
until its pages are allocated and its metadata sent to prefill, then in
``disagg_decode_transfer_queue.queue`` until its receiver polls Success or
Failed. ``kv_receiver`` is set to None once SGLang clears it.

Nothing here calls ``poll()``: it feeds SGLang's all-reduce, applies the
waiting timeout and latches terminal states. Per receiver the plugin reads:

* every receiver: a latched ``conclude_state`` first (``abort()`` latches
  Failed, and every receiver's ``poll()`` returns it);
* common receivers (NIXL, Mooncake and the others): ``kv_mgr.check_status(room)``;
  the metadata hand-over (``init_time``, set when metadata is sent);
* NIXL: ``started_transfer`` and the manager's per-room ``transfer_statuses``
  entry (chunks received per prefill PP rank, chunks expected per rank once
  the last chunk arrived, the number of PP ranks expected);
* the fake receiver of health checks and warm-ups (no ``bootstrap_room``,
  no manager on older releases): ``bootstrap_done`` and ``has_sent_metadata``;
* the prefill ranks it talks to, as the bootstrap server gave them:
  ``bootstrap_infos``, a list of dicts with ``rank_ip`` and ``rank_port``
  (``disaggregation/common/conn.py`` CommonKVReceiver, v0.4.10 to v0.5.18
  and main; Mooncake's own receiver in v0.5.3), or one ``bootstrap_info``
  dict (``nixl/conn.py`` and ``mooncake/conn.py``, v0.4.6). None until the
  receiver fetched them, and again after a failed fetch (v0.5.18).
"""

import sys
from typing import NamedTuple

from . import capabilities
from .observe import (
    BOOTSTRAPPING,
    FAILED,
    SUCCESS,
    TRANSFERRING,
    UNKNOWN,
    WAITING_FOR_INPUT,
    as_poll_code,
)

PREALLOC, TRANSFER = "prealloc", "transfer"


WHERE = "decode-queued"


class ReceiverView(NamedTuple):
    poll: int
    progress: int  # -1: unknown
    chunks_expected: int | None
    transfer_started: bool | None
    waiting_for_memory: bool = False
    # "ip:port" of the prefill ranks the receiver talks to, in its order; None: not known.
    prefill_rank_addrs: tuple | None = None


# The watchdog refuses a listing with more (pluginapi.MaxPrefillRankAddrs).
MAX_PREFILL_RANK_ADDRS = 256

_UNKNOWN_VIEW = ReceiverView(UNKNOWN, -1, None, None)


def observe_receiver(receiver, room):
    """What the receiver's poll() would build on, read without calling it."""
    if receiver is None:  # cleared by SGLang: the request leaves its queue in this pass
        return _UNKNOWN_VIEW
    concluded = getattr(receiver, "conclude_state", None)
    if hasattr(receiver, "has_sent_metadata"):  # the fake receiver: no transfer at all
        if concluded is not None:
            poll = as_poll_code(concluded)
        elif not getattr(receiver, "bootstrap_done", False):
            poll = BOOTSTRAPPING
        else:
            poll = SUCCESS if receiver.has_sent_metadata else WAITING_FOR_INPUT
        return ReceiverView(poll, -1, None, bool(receiver.has_sent_metadata))
    manager = getattr(receiver, "kv_mgr", None)
    progress, expected, done = _transfer_status(manager, room)
    if concluded is not None:
        poll = as_poll_code(concluded)
    else:
        reads_status = _poll_reads_status(type(receiver))
        # A poll() that never asks the manager (NIXL up to v0.5.3) answers WaitingForInput until done.
        poll = WAITING_FOR_INPUT if reads_status is False else _status(manager, room)
        if done is not None and poll not in (SUCCESS, FAILED):
            poll = done  # all chunks are in: the next poll() latches this
    return ReceiverView(poll, progress, expected, _started(receiver, progress, poll),
                        prefill_rank_addrs=prefill_rank_addrs(receiver))


def prefill_rank_addrs(receiver):
    """The distinct "ip:port" of the prefill ranks the receiver talks to, None when it has none yet."""
    infos = getattr(receiver, "bootstrap_infos", None)
    if infos is None:
        one = getattr(receiver, "bootstrap_info", None)
        infos = None if one is None else (one,)
    if not isinstance(infos, (list, tuple)):
        return None
    out = []
    for info in infos:
        ip, port = _field(info, "rank_ip"), _field(info, "rank_port")
        if not ip or isinstance(port, bool) or not isinstance(port, (int, str)) or not str(port).isdigit():
            continue
        ip = str(ip)
        addr = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        if addr not in out:
            out.append(addr)
            if len(out) == MAX_PREFILL_RANK_ADDRS:
                break
    return tuple(out) or None


def _field(info, name):
    return info.get(name) if isinstance(info, dict) else getattr(info, name, None)


_reads_status = {}


def _poll_reads_status(receiver_cls):
    """Whether the receiver's poll() answers from ``kv_mgr.check_status``: True, False or None (unreadable).

    SGLang's NixlKVReceiver.poll up to v0.5.3 (``disaggregation/nixl/conn.py``,
    v0.4.6, v0.4.10, v0.5.3) returns its latched ``conclude_state``, else
    WaitingForInput until every chunk arrived, and never reads the manager's
    per-room status, which holds no entry for such a room: reading it there
    listed the room as Unknown while SGLang's poll() said WaitingForInput.
    """
    known = _reads_status.get(receiver_cls, ())
    if known != ():
        return known
    tree = capabilities._function_tree(getattr(receiver_cls, "poll", None))
    if tree is None:
        answer = None
    else:
        attributes = capabilities._attributes(tree)
        answer = True if "check_status" in attributes else False if "WaitingForInput" in attributes else None
    _reads_status[receiver_cls] = answer
    return answer


def _status(manager, room):
    check_status = getattr(manager, "check_status", None)
    if check_status is None:
        return UNKNOWN
    try:
        return as_poll_code(check_status(room))
    except Exception:  # KeyError once the room is cleared
        return UNKNOWN


def _transfer_status(manager, room):
    """(chunks received, chunks expected or None, terminal poll code or None) from NIXL's per-room status."""
    statuses = getattr(manager, "transfer_statuses", None)
    if statuses is None:
        return -1, None, None
    try:
        # A defaultdict on the manager: get(), never index, or the read would create an entry.
        status = statuses.get(room)
        if status is None:
            return 0, None, None
        received = sum(len(chunks) for chunks in list(status.received_kvs_per_pp.values()))
        expected_per_pp = dict(status.expected_kvs_per_pp)
        ranks = status.num_pp_ranks_expected
        expected = sum(expected_per_pp.values()) if ranks is not None and len(expected_per_pp) >= ranks else None
        done = None
        is_done = getattr(status, "is_done", None)
        if callable(is_done) and is_done():
            is_failed = getattr(status, "is_failed", None)
            done = FAILED if callable(is_failed) and is_failed() else SUCCESS
        return received, expected, done
    except Exception:  # a transfer thread changed it under us: unknown this time
        return -1, None, None


def waiting_for_memory(decode_req, view):
    """Whether a prealloc request waits for free KV pages: its handshake is done and its receiver not failed.

    SGLang sets ``DecodeRequest.waiting_for_input`` on the WaitingForInput poll
    of the handshake (``DecodePreallocQueue._update_handshake_waiters``, or
    ``pop_preallocated`` on older releases; v0.4.6 to v0.5.18), and
    ``pop_preallocated`` gives pages only to such requests, while pages are
    free. Its waiting timeout starts when the metadata is sent, after that:
    such a request waits as long as decode has no memory, and SGLang never
    times it out.
    """
    return getattr(decode_req, "waiting_for_input", None) is True and view.poll != FAILED


def _started(receiver, progress, poll):
    """Whether prefill may be writing into this request's pages: True, False, or None (unknown).

    Metadata sent (NIXL ``started_transfer``, or ``init_time`` of the common
    receivers) means prefill holds the destination pages and may write at any
    time; a chunk received or a Transferring status means it did.
    """
    if progress > 0 or poll == TRANSFERRING:
        return True
    started = getattr(receiver, "started_transfer", None)
    if started is True:
        return True
    has_init_time = hasattr(receiver, "init_time")
    if has_init_time and receiver.init_time is not None:
        return True
    if started is False or has_init_time:
        return False
    return None


def receiver_class(scheduler, backend):
    """The backend's receiver class, or None until one can be seen."""
    conn = sys.modules.get(f"sglang.srt.disaggregation.{backend}.conn")
    if conn is not None:
        for key, value in vars(conn).items():
            if isinstance(value, type) and key.lower() == f"{backend}kvreceiver":
                return value
    for _, decode_req in queued(scheduler):
        found = backend_receiver(getattr(decode_req, "kv_receiver", None), backend)
        if found is not None:
            return found
    return None


def backend_receiver(receiver, backend):
    """The receiver's class if it is one of the backend's own (not a health check's)."""
    if receiver is None or (type(receiver).__name__.startswith("Fake") and backend != "fake"):
        return None
    return type(receiver)


def queues(scheduler):
    """The live (prealloc, transfer) lists; an absent queue reads as empty."""
    prealloc = getattr(getattr(scheduler, "disagg_decode_prealloc_queue", None), "queue", None)
    transfer = getattr(getattr(scheduler, "disagg_decode_transfer_queue", None), "queue", None)
    return (prealloc if prealloc is not None else ()), (transfer if transfer is not None else ())


def queued(scheduler):
    prealloc, transfer = queues(scheduler)
    for decode_req in prealloc:
        yield PREALLOC, decode_req
    for decode_req in transfer:
        yield TRANSFER, decode_req


def request_room(req):
    """The Req's room; None (health checks on some releases) reads as 0."""
    room = getattr(req, "bootstrap_room", None)
    return 0 if room is None else room
