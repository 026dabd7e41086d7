package topology

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// l builds the listeners of (dp, pp) pairs on an instance of ppSize stages.
func l(ppSize int, ranks ...[2]int) []Listener {
	out := []Listener{}
	for _, r := range ranks {
		out = append(out, Listener{DPRank: r[0], PPRank: r[1], Index: r[0]*ppSize + r[1]})
	}
	return out
}

func dps(from, to int) [][2]int {
	var out [][2]int
	for d := from; d < to; d++ {
		out = append(out, [2]int{d, 0})
	}
	return out
}

// cases are instances with the listeners of each node, node 0 first.
var cases = []struct {
	name  string
	args  Args
	nodes [][]Listener
}{
	{"1 node TP8", Args{NNodes: 1, TPSize: 8}, [][]Listener{l(1, [2]int{0, 0})}},
	{"1 node DP-attention 8", Args{NNodes: 1, TPSize: 8, DPSize: 8, EnableDPAttention: true}, [][]Listener{l(1, dps(0, 8)...)}},
	{"1 node plain DP2 PP2", Args{NNodes: 1, TPSize: 4, DPSize: 2, PPSize: 2},
		[][]Listener{l(2, [2]int{0, 0}, [2]int{0, 1}, [2]int{1, 0}, [2]int{1, 1})}},
	{"2 nodes TP16 DP16 (SGLang's example)", Args{NNodes: 2, TPSize: 16, DPSize: 16, EnableDPAttention: true},
		[][]Listener{l(1, dps(0, 8)...), l(1, dps(8, 16)...)}},
	{"2 nodes TP16 DP2", Args{NNodes: 2, TPSize: 16, DPSize: 2, EnableDPAttention: true},
		[][]Listener{l(1, dps(0, 1)...), l(1, dps(1, 2)...)}},
	{"2 nodes plain TP16", Args{NNodes: 2, TPSize: 16}, [][]Listener{l(1, [2]int{0, 0}), {}}},
	{"3 nodes TP24 DP24", Args{NNodes: 3, TPSize: 24, DPSize: 24, EnableDPAttention: true},
		[][]Listener{l(1, dps(0, 8)...), l(1, dps(8, 16)...), l(1, dps(16, 24)...)}},
	// Groups of 3 ranks over nodes of 2: a group may start on one node and
	// end on the next; its leader's node watches it.
	{"3 nodes TP6 DP2 groups across nodes", Args{NNodes: 3, TPSize: 6, DPSize: 2, EnableDPAttention: true},
		[][]Listener{l(1, dps(0, 1)...), l(1, dps(1, 2)...), {}}},
	{"3 nodes plain TP24", Args{NNodes: 3, TPSize: 24}, [][]Listener{l(1, [2]int{0, 0}), {}, {}}},
	{"4 nodes TP32 DP8", Args{NNodes: 4, TPSize: 32, DPSize: 8, EnableDPAttention: true},
		[][]Listener{l(1, dps(0, 2)...), l(1, dps(2, 4)...), l(1, dps(4, 6)...), l(1, dps(6, 8)...)}},
	{"4 nodes plain TP32", Args{NNodes: 4, TPSize: 32}, [][]Listener{l(1, [2]int{0, 0}), {}, {}, {}}},
	{"2 nodes TP8 PP2: a stage a node", Args{NNodes: 2, TPSize: 8, PPSize: 2},
		[][]Listener{l(2, [2]int{0, 0}), l(2, [2]int{0, 1})}},
	{"2 nodes TP4 PP4: two stages a node", Args{NNodes: 2, TPSize: 4, PPSize: 4},
		[][]Listener{l(4, [2]int{0, 0}, [2]int{0, 1}), l(4, [2]int{0, 2}, [2]int{0, 3})}},
	{"4 nodes plain TP16 PP2: two nodes a stage", Args{NNodes: 4, TPSize: 16, PPSize: 2},
		[][]Listener{l(2, [2]int{0, 0}), {}, l(2, [2]int{0, 1}), {}}},
	{"4 nodes TP16 PP2 DP4", Args{NNodes: 4, TPSize: 16, PPSize: 2, DPSize: 4, EnableDPAttention: true},
		[][]Listener{l(2, [2]int{0, 0}, [2]int{1, 0}), l(2, [2]int{2, 0}, [2]int{3, 0}),
			l(2, [2]int{0, 1}, [2]int{1, 1}), l(2, [2]int{2, 1}, [2]int{3, 1})}},
	{"1 node TP8 DP2 attention CP2", Args{NNodes: 1, TPSize: 8, DPSize: 2, EnableDPAttention: true, AttnCPSize: 2},
		[][]Listener{l(1, dps(0, 2)...)}},
	{"2 nodes plain TP8 attention CP2", Args{NNodes: 2, TPSize: 8, AttnCPSize: 2}, [][]Listener{l(1, [2]int{0, 0}), {}}},
}

func TestListeners(t *testing.T) {
	for _, c := range cases {
		for node, want := range c.nodes {
			a := c.args
			a.NodeRank = node
			got, err := Listeners(a)
			if err != nil {
				t.Fatalf("%s node %d: %v", c.name, node, err)
			}
			if got == nil {
				got = []Listener{}
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s node %d: got %v, want %v", c.name, node, got, want)
			}
		}
	}
}

func TestListenersRefusesWhatSGLangCannotPlace(t *testing.T) {
	for _, c := range []struct {
		args Args
		want string
	}{
		{Args{NNodes: 2, NodeRank: 2, TPSize: 16}, "node_rank 2"},
		{Args{NNodes: 2, NodeRank: -1, TPSize: 16}, "node_rank -1"},
		{Args{NNodes: 4, TPSize: 6}, "tp_size 6 must be divisible by the 4 nodes"},
		{Args{NNodes: 4, TPSize: 8, PPSize: 2, NodeRank: 1}, ""},
		{Args{NNodes: 3, TPSize: 6, PPSize: 2}, "pp_size 2 and nnodes 3"},
		{Args{NNodes: 1, TPSize: 8, DPSize: 3, EnableDPAttention: true}, "dp_size 3 * attn_cp_size 1"},
		{Args{NNodes: 1, TPSize: 8, DPSize: 2, EnableDPAttention: true, AttnCPSize: 3}, "attn_cp_size 3"},
		{Args{NNodes: 1, TPSize: 8, AttnCPSize: 3}, "tp_size 8 must be divisible by attn_cp_size 3"},
		{Args{NNodes: 2, TPSize: 16, DPSize: 2}, "needs enable_dp_attention"},
		{Args{NNodes: 1}, "tp_size must be at least 1"},
		{Args{NNodes: 1, TPSize: 8, DPSize: -2}, "dp_size must be at least 1"},
		{Args{NNodes: -1, TPSize: 8}, "nnodes must be at least 1"},
	} {
		_, err := Listeners(c.args)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%+v: %v", c.args, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%+v: got error %v, want one containing %q", c.args, err, c.want)
		}
	}
}

// TestListenersMatchPluginPortRule places every scheduler of each instance
// as SGLang does and asks the plugin's own code (identify, serves_listener,
// port_for) where it listens: each node's ports must be what Listeners
// gives, so that the two rules cannot drift apart.
func TestListenersMatchPluginPortRule(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not found")
	}
	type instance struct {
		NNodes            int    `json:"nnodes"`
		TPSize            int    `json:"tp_size"`
		DPSize            int    `json:"dp_size"`
		PPSize            int    `json:"pp_size"`
		AttnCPSize        int    `json:"attn_cp_size"`
		EnableDPAttention bool   `json:"enable_dp_attention"`
		Mode              string `json:"mode"`
	}
	var in []instance
	for _, c := range cases {
		for _, mode := range []string{"prefill", "decode"} {
			in = append(in, instance{NNodes: orOne(c.args.NNodes), TPSize: c.args.TPSize, DPSize: orOne(c.args.DPSize),
				PPSize: orOne(c.args.PPSize), AttnCPSize: orOne(c.args.AttnCPSize), EnableDPAttention: c.args.EnableDPAttention, Mode: mode})
		}
	}
	body, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(python, filepath.Join("testdata", "plugin_ports.py"), filepath.Join("..", "sglang_plugin"))
	cmd.Stdin = bytes.NewReader(body)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("plugin_ports.py: %v\n%s", err, stderr.String())
	}
	var ports [][][]int
	if err := json.Unmarshal(out, &ports); err != nil {
		t.Fatal(err)
	}
	if len(ports) != len(in) {
		t.Fatalf("plugin_ports.py answered %d instances, asked %d", len(ports), len(in))
	}
	for i, c := range in {
		for node, pluginPorts := range ports[i] {
			ls, err := Listeners(Args{NNodes: c.NNodes, NodeRank: node, TPSize: c.TPSize, DPSize: c.DPSize, PPSize: c.PPSize,
				AttnCPSize: c.AttnCPSize, EnableDPAttention: c.EnableDPAttention})
			if err != nil {
				t.Fatal(err)
			}
			goPorts := []int{}
			for _, l := range ls {
				goPorts = append(goPorts, 28100+l.Index)
			}
			if !reflect.DeepEqual(goPorts, pluginPorts) {
				t.Errorf("%+v node %d: Listeners gives ports %v, the plugin listens on %v", c, node, goPorts, pluginPorts)
			}
		}
	}
}
