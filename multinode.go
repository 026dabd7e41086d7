package main

import (
	"errors"
	"fmt"
	"net"
	"strconv"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"

	"github.com/sglang-watchdog/sglang-watchdog/topology"
)

// nodeOptions are the run flags of a sidecar that computes its node's
// plugin URLs from the SGLang instance's server arguments instead of being
// given them.
type nodeOptions struct {
	args     topology.Args
	basePort int
	host     string
}

// given says whether any topology flag differs from its default.
func (n *nodeOptions) given() bool {
	a := n.args
	return a.TPSize != 0 || a.NNodes != 1 || a.NodeRank != 0 || a.DPSize != 1 || a.PPSize != 1 || a.EnableDPAttention || a.AttnCPSize != 1
}

// nodePluginURLs returns the plugin URLs of the ranks on this node when
// --sglang.tp-size is given, else the --plugin.url ones. A node with no
// listener (a plain TP worker node) gets none and is watched for its
// gauges only; that is logged here, once.
func nodePluginURLs(o *options, logger log.Logger) ([]string, error) {
	n := o.node
	if !n.given() {
		return o.pluginURLs, nil
	}
	if n.args.TPSize == 0 {
		return nil, errors.New("--sglang.nnodes, --sglang.node-rank, --sglang.dp-size, --sglang.pp-size, --sglang.attn-cp-size and --sglang.enable-dp-attention need --sglang.tp-size")
	}
	if len(o.pluginURLs) > 0 {
		return nil, errors.New("--plugin.url and --sglang.tp-size both given: either list the plugin URLs or let the sidecar compute its node's from the --sglang.* flags, not both")
	}
	listeners, err := topology.Listeners(n.args)
	if err != nil {
		return nil, fmt.Errorf("--sglang.* flags: %w", err)
	}
	if n.basePort < 1 || n.basePort > 65535 {
		return nil, fmt.Errorf("--plugin.base-port %d is not a TCP port", n.basePort)
	}
	if n.host == "" {
		return nil, errors.New("--plugin.host is empty")
	}
	var urls []string
	for _, l := range listeners {
		port := n.basePort + l.Index
		if port > 65535 {
			return nil, fmt.Errorf("--plugin.base-port %d + listener index %d (dp_rank %d, pp_rank %d) is past port 65535", n.basePort, l.Index, l.DPRank, l.PPRank)
		}
		urls = append(urls, "http://"+net.JoinHostPort(n.host, strconv.Itoa(port)))
	}
	if len(urls) == 0 {
		level.Info(logger).Log("msg", "no plugin listener runs on this node (no attention group leader): watching its /metrics only", "node_rank", n.args.NodeRank, "nnodes", n.args.NNodes)
	}
	return urls, nil
}
