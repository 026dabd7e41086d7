"""Prints, per node of an SGLang instance, the ports the watchdog plugin opens there.

Usage: plugin_ports.py <plugin source dir> '{"nnodes": 2, "tp": 16, "dp": 16, "pp": 1, "dp_attention": true, "base_port": 28100}'

The schedulers are placed as SGLang places them (python/sglang/srt/, v0.5.18):
entrypoints/engine.py _calculate_rank_ranges gives each node its PP stages
and TP ranks (the DP controller's launch_tensor_parallel_group uses the same
ranges); with DP attention layers/dp_attention.py
compute_dp_attention_world_info gives each TP rank its dp_rank and
attn_tp_rank; without it each of the dp_size replicas is a TP group of its
own on the one node (launch_dp_schedulers; server_args.py refuses
multi-node DP without DP attention). Whether a scheduler listens, and on
which port, is the plugin's own code: identity.identify, serves_listener,
index, and config.Config.port_for.
"""

import json
import sys
from types import SimpleNamespace

sys.path.insert(0, sys.argv[1])
from sglang_watchdog_plugin.config import Config  # noqa: E402
from sglang_watchdog_plugin.identity import identify  # noqa: E402


def rank_ranges(nnodes, pp_size, tp_size, node_rank):
    pp_size_per_node = max(pp_size // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp_size, 1)
    pp = range(pp_size_per_node * (node_rank // nnodes_per_pp_rank),
               pp_size_per_node * (node_rank // nnodes_per_pp_rank + 1))
    tp_size_per_node = tp_size // nnodes_per_pp_rank
    tp = range(tp_size_per_node * (node_rank % nnodes_per_pp_rank),
               tp_size_per_node * (node_rank % nnodes_per_pp_rank + 1))
    return pp, tp


def schedulers(a, node):
    pp_range, tp_range = rank_ranges(a["nnodes"], a["pp"], a["tp"], node)
    replicas = [None] if a["dp_attention"] or a["dp"] == 1 else range(a["dp"])
    for replica in replicas:
        for pp_rank in pp_range:
            for tp_rank in tp_range:
                if a["dp_attention"]:
                    attn_tp_size = a["tp"] // a["dp"]
                    dp_rank = tp_rank // attn_tp_size
                else:
                    attn_tp_size = a["tp"]
                    dp_rank = replica
                yield SimpleNamespace(
                    tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, pp_size=a["pp"], tp_size=a["tp"],
                    attn_tp_rank=tp_rank % attn_tp_size, attn_tp_size=attn_tp_size,
                    disaggregation_mode="prefill",
                )


def main():
    a = json.loads(sys.argv[2])
    config = Config(base_port=a["base_port"])
    out = {}
    for node in range(a["nnodes"]):
        ports = []
        for scheduler in schedulers(a, node):
            ident = identify(scheduler)
            if ident.serves_listener:
                ports.append(config.port_for(ident.index))
        out[str(node)] = sorted(ports)
    print(json.dumps(out))


main()
