"""Ports the plugin listens on, per node, for each SGLang instance on stdin.

Every scheduler of the instance is placed and given its ranks as SGLang does
(python/sglang/srt/, v0.5.18: entrypoints/engine.py _calculate_rank_ranges,
managers/data_parallel_controller.py launch_dp_schedulers and
launch_tensor_parallel_group, layers/dp_attention.py
compute_dp_attention_world_info); the plugin's own identify(),
serves_listener and Config.port_for then decide whether and where it
listens. argv[1] is the sglang_plugin directory. An instance's base_port is
SGLANG_WATCHDOG_PLUGIN_PORT (default 28100). deploy/verify checks the Helm
chart's sidecars against the same answer.
"""

import json
import sys
from types import SimpleNamespace

sys.path.insert(0, sys.argv[1])
from sglang_watchdog_plugin.config import Config  # noqa: E402
from sglang_watchdog_plugin.identity import identify  # noqa: E402


def schedulers(a, node_rank):
    nnodes, tp, dp, pp, cp = a["nnodes"], a["tp_size"], a["dp_size"], a["pp_size"], a["attn_cp_size"]
    dp_attention = a["enable_dp_attention"]
    pp_size_per_node = max(pp // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp, 1)
    pp_rank_range = range(pp_size_per_node * (node_rank // nnodes_per_pp_rank),
                          pp_size_per_node * (node_rank // nnodes_per_pp_rank + 1))
    tp_size_per_node = tp // nnodes_per_pp_rank
    tp_rank_range = range(tp_size_per_node * (node_rank % nnodes_per_pp_rank),
                          tp_size_per_node * (node_rank % nnodes_per_pp_rank + 1))
    attn_dp_size = dp if dp_attention else 1
    attn_tp_size = tp // attn_dp_size // cp
    # No DP controller at dp_size 1: the scheduler gets dp_rank None.
    replicas = [None] if dp == 1 else ([None] if dp_attention else range(dp))
    for replica in replicas:
        for pp_rank in pp_rank_range:
            for tp_rank in tp_rank_range:
                dp_rank = tp_rank // (attn_tp_size * cp) if dp_attention else replica
                yield SimpleNamespace(
                    tp_rank=tp_rank, tp_size=tp, dp_rank=dp_rank, pp_rank=pp_rank, pp_size=pp,
                    attn_tp_rank=tp_rank % attn_tp_size, attn_tp_size=attn_tp_size,
                    attn_cp_rank=(tp_rank // attn_tp_size) % cp, attn_cp_size=cp,
                    disaggregation_mode=a["mode"], server_args=None)


def main():
    out = []
    for a in json.load(sys.stdin):
        config = Config(base_port=a.get("base_port", 28100))
        nodes = []
        for node_rank in range(a["nnodes"]):
            ports = []
            for scheduler in schedulers(a, node_rank):
                identity = identify(scheduler)
                if identity.serves_listener:
                    ports.append(config.port_for(identity.index))
            nodes.append(sorted(ports))
        out.append(nodes)
    json.dump(out, sys.stdout)


main()
