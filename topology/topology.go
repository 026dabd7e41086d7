// Package topology tells which plugin listeners of an SGLang instance run on
// one of its nodes, from the instance's server arguments, so that the
// sidecar of each node (one pod per node under LeaderWorkerSet) can watch
// exactly its own node's ranks.
//
// The plugin listens in every scheduler that leads its attention group
// (attn_tp_rank 0 and attn_cp_rank 0) on base port + dp_rank * pp_size +
// pp_rank, dp_rank being the global DP rank (sglang_plugin:
// identity.py Identity.index and serves_listener, config.py port_for).
//
// Where SGLang places the schedulers, read in python/sglang/srt/ of every
// release from v0.4.6 to v0.5.18 and main (2026-08-23):
//
//   - The TP ranks and PP stages of a node: entrypoints/engine.py
//     (_calculate_rank_ranges, v0.5.10 to v0.5.18 and main; inlined in
//     _launch_subprocesses, v0.4.10 and v0.5.3) and the same ranges in
//     managers/data_parallel_controller.py launch_tensor_parallel_group:
//     pp_size_per_node = max(pp_size // nnodes, 1), nnodes_per_pp_rank =
//     max(nnodes // pp_size, 1), stages pp_size_per_node * (node_rank //
//     nnodes_per_pp_rank) onwards, tp_size_per_node = tp_size //
//     nnodes_per_pp_rank, TP ranks tp_size_per_node * (node_rank %
//     nnodes_per_pp_rank) onwards. v0.4.6 has no pipeline parallelism and
//     gives node n the TP ranks tp_size/nnodes * n onwards: the same
//     placement at pp_size 1.
//   - Ranks from a TP rank: layers/dp_attention.py
//     compute_dp_attention_world_info: with DP attention attn_tp_size =
//     tp_size // dp_size // attn_cp_size, dp_rank = tp_rank //
//     (attn_tp_size * attn_cp_size), attn_tp_rank = tp_rank % attn_tp_size
//     (attn_cp_size from v0.5.10; 1 before, where the formula is the
//     same), and the DP controller passes that dp_rank to the scheduler.
//     Without DP attention the attention group is the whole TP group, and
//     each of the dp_size replicas is a TP group of its own with its
//     dp_rank (launch_dp_schedulers).
//   - server_args.py check_server_args refuses multi-node data parallelism
//     without DP attention, every release, and a tp_size (v0.4.6) or
//     tp_size * pp_size (v0.4.10 on) that nnodes does not divide.
//
// Elastic EP joiners (ep_join_mode "scale", v0.5.18) place ranks their own
// way and are not covered.
package topology

import (
	"cmp"
	"fmt"
	"slices"
)

// Args are the SGLang server arguments of the instance that decide where
// its schedulers run. Zero sizes mean SGLang's default of 1.
type Args struct {
	NNodes            int // --nnodes
	NodeRank          int // --node-rank
	TPSize            int // --tp-size
	DPSize            int // --dp-size
	PPSize            int // --pp-size
	EnableDPAttention bool
	// AttnCPSize is the attention context-parallel size (--attn-cp-size,
	// v0.5.10 on; some model hooks set it from tp_size / dp_size).
	AttnCPSize int
}

// Listener is one plugin listener: the scheduler of DP rank DPRank and PP
// stage PPRank that leads its attention group listens on the plugin's base
// port + Index.
type Listener struct {
	DPRank, PPRank, Index int
}

func orOne(v int) int {
	if v == 0 {
		return 1
	}
	return v
}

// Listeners returns the plugin listeners whose scheduler runs on node
// a.NodeRank, by index; empty on a node with no attention group leader
// (the worker nodes of a plain TP instance). It errors, naming the
// argument, on a combination SGLang refuses or places inconsistently.
func Listeners(a Args) ([]Listener, error) {
	nnodes, tp, dp, pp, cp := orOne(a.NNodes), a.TPSize, orOne(a.DPSize), orOne(a.PPSize), orOne(a.AttnCPSize)
	for _, s := range []struct {
		name string
		v    int
	}{{"nnodes", nnodes}, {"tp_size", tp}, {"dp_size", dp}, {"pp_size", pp}, {"attn_cp_size", cp}} {
		if s.v < 1 {
			return nil, fmt.Errorf("%s must be at least 1, got %d", s.name, s.v)
		}
	}
	switch {
	case a.NodeRank < 0 || a.NodeRank >= nnodes:
		return nil, fmt.Errorf("node_rank %d must be in [0, nnodes %d)", a.NodeRank, nnodes)
	case nnodes > 1 && dp > 1 && !a.EnableDPAttention:
		return nil, fmt.Errorf("dp_size %d on nnodes %d needs enable_dp_attention: SGLang refuses multi-node data parallelism without it", dp, nnodes)
	case nnodes%pp != 0 && pp%nnodes != 0:
		// SGLang's ranges then give a node a stage that does not exist.
		return nil, fmt.Errorf("pp_size %d and nnodes %d: one must divide the other", pp, nnodes)
	}
	nodesPerStage := max(nnodes/pp, 1)
	stagesPerNode := max(pp/nnodes, 1)
	if tp%nodesPerStage != 0 {
		return nil, fmt.Errorf("tp_size %d must be divisible by the %d nodes of each pipeline stage (nnodes / pp_size)", tp, nodesPerStage)
	}
	attnDP := 1
	if a.EnableDPAttention {
		attnDP = dp
	}
	if tp%(attnDP*cp) != 0 {
		if a.EnableDPAttention {
			return nil, fmt.Errorf("tp_size %d must be divisible by dp_size %d * attn_cp_size %d with DP attention", tp, dp, cp)
		}
		return nil, fmt.Errorf("tp_size %d must be divisible by attn_cp_size %d", tp, cp)
	}
	// An attention group is attn_tp_size * attn_cp_size consecutive TP
	// ranks; its first rank leads it.
	group := tp / attnDP
	tpPerNode := tp / nodesPerStage
	firstTP := tpPerNode * (a.NodeRank % nodesPerStage)
	firstPP := stagesPerNode * (a.NodeRank / nodesPerStage)
	// Without DP attention every replica runs the same TP ranks.
	replicas := 1
	if !a.EnableDPAttention {
		replicas = dp
	}
	var out []Listener
	for replica := 0; replica < replicas; replica++ {
		for ppRank := firstPP; ppRank < firstPP+stagesPerNode; ppRank++ {
			for tpRank := firstTP; tpRank < firstTP+tpPerNode; tpRank++ {
				if tpRank%group != 0 {
					continue
				}
				dpRank := replica
				if a.EnableDPAttention {
					dpRank = tpRank / group
				}
				out = append(out, Listener{DPRank: dpRank, PPRank: ppRank, Index: dpRank*pp + ppRank})
			}
		}
	}
	slices.SortFunc(out, func(x, y Listener) int { return cmp.Compare(x.Index, y.Index) })
	return out, nil
}
