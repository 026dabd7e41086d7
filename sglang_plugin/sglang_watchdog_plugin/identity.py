"""Who a scheduler is (ranks, mode, backend), across SGLang's attribute layouts."""

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    tp_rank: int
    dp_rank: int
    pp_rank: int
    pp_size: int
    attn_tp_rank: int
    attn_cp_rank: int
    mode: str
    backend: str
    # The attention TP and CP group: every rank of it sends its own share of a request's KV.
    attn_tp_size: int = 1
    attn_cp_size: int = 1

    @property
    def index(self):
        """Listener offset from the base port (documented port mapping)."""
        return self.dp_rank * self.pp_size + self.pp_rank

    @property
    def serves_listener(self):
        # SGLang MIN-reduces polls over the attention TP (then CP) group, on
        # prefill and on decode, so the group leader sees every request of its
        # (dp, pp) rank and its lever fails the request on the whole group.
        return self.mode in ("prefill", "decode") and self.attn_tp_rank == 0 and self.attn_cp_rank == 0

    @property
    def publishes_transfers(self):
        # The leader of a prefill group reads the other ranks' outstanding chunks from what they publish.
        return self.mode == "prefill" and not self.serves_listener and self.attn_tp_size * self.attn_cp_size > 1


def identify(scheduler):
    # Newest SGLang keeps ranks in a parallel-state object `ps`; older releases
    # have them as plain scheduler attributes.
    ps = getattr(scheduler, "ps", None)

    def rank(name, default):
        value = getattr(ps, name, None) if ps is not None else None
        if value is None:
            value = getattr(scheduler, name, None)
        return default if value is None else int(value)

    tp_rank = rank("tp_rank", 0)
    return Identity(
        tp_rank=tp_rank,
        dp_rank=rank("dp_rank", 0),
        pp_rank=rank("pp_rank", 0),
        pp_size=rank("pp_size", 1),
        # Without DP attention the attention TP group is the TP group.
        attn_tp_rank=rank("attn_tp_rank", tp_rank),
        attn_cp_rank=rank("attn_cp_rank", 0),
        mode=_mode_name(getattr(scheduler, "disaggregation_mode", None)),
        backend=_backend_name(scheduler),
        attn_tp_size=rank("attn_tp_size", rank("tp_size", 1)),
        attn_cp_size=rank("attn_cp_size", 1),
    )


def _mode_name(mode):
    # DisaggregationMode ("null", "prefill", "decode") or a plain string; an
    # enum without string values is known by its name.
    if mode is None:
        return "null"
    value = getattr(mode, "value", mode)
    return (value if isinstance(value, str) else getattr(mode, "name", str(value))).lower()


def _backend_name(scheduler):
    configured = getattr(getattr(scheduler, "server_args", None), "disaggregation_transfer_backend", None)
    if configured:
        return str(getattr(configured, "value", configured)).lower()
    # Fall back to the class of a live sender or receiver; fake ones only
    # serve health checks.
    for req in getattr(scheduler, "disagg_prefill_inflight_queue", ()):
        name = _backend_of(getattr(req, "disagg_kv_sender", None), "KVSender")
        if name:
            return name
    for queue in ("disagg_decode_prealloc_queue", "disagg_decode_transfer_queue"):
        for decode_req in getattr(getattr(scheduler, queue, None), "queue", None) or ():
            name = _backend_of(getattr(decode_req, "kv_receiver", None), "KVReceiver")
            if name:
                return name
    return "unknown"


def _backend_of(endpoint, suffix):
    name = type(endpoint).__name__
    if name.endswith(suffix) and not name.startswith("Fake"):
        return name[: -len(suffix)].lower()
    return None


def sglang_version():
    # Read from the loaded package only: importing sglang here would be costly
    # and pointless in processes (and tests) that do not run it.
    return str(getattr(sys.modules.get("sglang"), "__version__", None) or "unknown")
