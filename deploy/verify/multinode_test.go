package verify

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/sglang-watchdog/sglang-watchdog/topology"
)

// instance is one SGLang server's parallelism, as SGLang was launched.
type instance struct {
	NNodes      int  `json:"nnodes"`
	TP          int  `json:"tp"`
	DP          int  `json:"dp"`
	PP          int  `json:"pp"`
	DPAttention bool `json:"dp_attention"`
	BasePort    int  `json:"base_port"`
}

func (in instance) String() string {
	s := fmt.Sprintf("nnodes=%d tp=%d dp=%d pp=%d", in.NNodes, in.TP, in.DP, in.PP)
	if in.DPAttention {
		s += " dp-attention"
	}
	return s
}

// pluginPorts returns, per node, the ports the plugin opens there: the
// schedulers placed as SGLang's engine.py places them, each judged by the
// plugin's own identity.py and config.py (topology/testdata/plugin_ports.py,
// the oracle the topology package is tested against too).
func pluginPorts(t *testing.T, in instance) map[int][]int {
	t.Helper()
	arg, err := json.Marshal([]map[string]any{{"nnodes": in.NNodes, "tp_size": in.TP, "dp_size": in.DP, "pp_size": in.PP,
		"attn_cp_size": 1, "enable_dp_attention": in.DPAttention, "mode": "prefill", "base_port": in.BasePort}})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("python3", repoPath("topology/testdata/plugin_ports.py"), repoPath("sglang_plugin"))
	cmd.Stdin = bytes.NewReader(arg)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("plugin_ports.py: %v", err)
	}
	var instances [][][]int
	if err := json.Unmarshal(out, &instances); err != nil || len(instances) != 1 {
		t.Fatalf("plugin_ports.py: %v: %s", err, out)
	}
	byNode := map[int][]int{}
	for node, ports := range instances[0] {
		byNode[node] = ports
	}
	return byNode
}

// podMeta is what a workload controller puts on the pod of node rank k of
// a group of n: the labels and annotations the sidecar's downward-API env
// reads.
func podMeta(kind string, k, n int) (labels, annotations map[string]string) {
	switch kind {
	case "RoleBasedGroup":
		return map[string]string{"rbg.workloads.x-k8s.io/component-index": strconv.Itoa(k), "rbg.workloads.x-k8s.io/component-size": strconv.Itoa(n)}, nil
	default: // LeaderWorkerSet, and the LWS roles of a DisaggregatedSet
		return map[string]string{"leaderworkerset.sigs.k8s.io/worker-index": strconv.Itoa(k)}, map[string]string{"leaderworkerset.sigs.k8s.io/size": strconv.Itoa(n)}
	}
}

var fieldRefKey = regexp.MustCompile(`^metadata\.(labels|annotations)\['([^']+)'\]$`)

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expandArgs returns a container's args as the kubelet runs them: its env
// (values, and downward-API references to the pod's labels and
// annotations) substituted for $(VAR); a reference to an undefined
// variable stays as written, as in Kubernetes.
func expandArgs(t *testing.T, name string, c corev1.Container, labels, annotations map[string]string) []string {
	t.Helper()
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil:
			m := fieldRefKey.FindStringSubmatch(e.ValueFrom.FieldRef.FieldPath)
			if m == nil {
				t.Fatalf("%s: env %s reads %s, which the test cannot play", name, e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			src := labels
			if m[1] == "annotations" {
				src = annotations
			}
			v, ok := src[m[2]]
			if !ok {
				t.Errorf("%s: env %s reads %s, which the pod does not carry", name, e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			env[e.Name] = v
		}
	}
	var out []string
	for _, a := range c.Args {
		out = append(out, varRef.ReplaceAllStringFunc(a, func(ref string) string {
			if v, ok := env[ref[2:len(ref)-1]]; ok {
				return v
			}
			return ref
		}))
	}
	return out
}

// watchedPorts returns the plugin ports a sidecar with these (expanded)
// args reads: its --plugin.url ports, or those it computes from the
// instance's topology with the topology package, as the binary does.
func watchedPorts(t *testing.T, name string, args []string) []int {
	t.Helper()
	var ports []int
	for _, u := range flagValues(args, "plugin.url") {
		pu, err := url.Parse(u)
		if err != nil {
			t.Fatalf("%s: --plugin.url=%s: %v", name, u, err)
		}
		p, err := strconv.Atoi(pu.Port())
		if err != nil {
			t.Fatalf("%s: --plugin.url=%s has no port", name, u)
		}
		ports = append(ports, p)
	}
	if len(flagValues(args, "sglang.tp-size")) == 0 {
		slices.Sort(ports)
		return ports
	}
	if len(ports) > 0 {
		t.Errorf("%s: both --plugin.url and --sglang.tp-size", name)
	}
	num := func(flag string, def int) int {
		v := flagValues(args, flag)
		if len(v) == 0 {
			return def
		}
		n, err := strconv.Atoi(v[0])
		if err != nil {
			t.Fatalf("%s: --%s=%s is not a number (an unexpanded variable?)", name, flag, v[0])
		}
		return n
	}
	a := topology.Args{
		NNodes: num("sglang.nnodes", 1), NodeRank: num("sglang.node-rank", 0),
		TPSize: num("sglang.tp-size", 1), DPSize: num("sglang.dp-size", 1), PPSize: num("sglang.pp-size", 1),
		EnableDPAttention: slices.Contains(args, "--sglang.enable-dp-attention"),
	}
	listeners, err := topology.Listeners(a)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	base := num("plugin.base-port", 28100)
	for _, l := range listeners {
		ports = append(ports, base+l.Index)
	}
	slices.Sort(ports)
	return ports
}

// groupPod is the pod of one node rank of a multi-node instance: its pod
// template and the args its sidecar runs there.
type groupPod struct {
	name string
	tmpl corev1.PodTemplateSpec
	args []string
}

// checkInstance checks the sidecars of every pod of one instance against
// the plugin: each node's sidecar watches exactly the ports the plugin
// opens on that node (the sidecar reads 127.0.0.1, its own node), so every
// listener is watched by exactly one sidecar, on the port it listens on.
// The plugin's SGLANG_WATCHDOG_PLUGIN_PORT is the same in every pod.
func checkInstance(t *testing.T, name string, in instance, pods []groupPod) {
	t.Helper()
	want := pluginPorts(t, in)
	for k, p := range pods {
		got := watchedPorts(t, p.name, p.args)
		if !reflect.DeepEqual(got, want[k]) && (len(got) != 0 || len(want[k]) != 0) {
			t.Errorf("%s (%s), node %d: the sidecar watches ports %v, the plugin listens on %v", name, in, k, got, want[k])
		}
		if s, ok := sglangServer(p.tmpl.Spec); ok && len(want[k]) > 0 {
			if !hasEnv(s, "SGLANG_WATCHDOG_PLUGIN_PORT", strconv.Itoa(in.BasePort)) && !slices.ContainsFunc(p.tmpl.Spec.Containers, func(c corev1.Container) bool {
				return hasEnv(c, "SGLANG_WATCHDOG_PLUGIN_PORT", strconv.Itoa(in.BasePort))
			}) {
				t.Errorf("%s, node %d: SGLang's SGLANG_WATCHDOG_PLUGIN_PORT is not %d", name, k, in.BasePort)
			}
		}
	}
}

// multiNodeCase is one chart render of a multi-node instance.
type multiNodeCase struct {
	kind string
	in   instance
}

func multiNodeCases() []multiNodeCase {
	var out []multiNodeCase
	for _, kind := range []string{"LeaderWorkerSet", "RoleBasedGroup"} {
		for n := 2; n <= 4; n++ {
			out = append(out,
				// SGLang's large-scale PD layout: one attention rank per GPU.
				multiNodeCase{kind, instance{NNodes: n, TP: 8 * n, DP: 8 * n, PP: 1, DPAttention: true, BasePort: 28100}},
				// Attention-TP groups of four GPUs, two per node.
				multiNodeCase{kind, instance{NNodes: n, TP: 8 * n, DP: 2 * n, PP: 1, DPAttention: true, BasePort: 28300}},
				// Plain TP over every node: one leader, on node 0.
				multiNodeCase{kind, instance{NNodes: n, TP: 8 * n, DP: 1, PP: 1, BasePort: 28100}},
				// Pipeline stages across the nodes: a leader on each.
				multiNodeCase{kind, instance{NNodes: n, TP: 8, DP: 1, PP: n, BasePort: 28100}},
			)
		}
	}
	return out
}

// renderMultiNode renders the chart's patches for an instance of both
// roles and returns each role's pods, node rank by node rank.
func renderMultiNode(t *testing.T, c multiNodeCase) map[string][]groupPod {
	t.Helper()
	var set []string
	for _, role := range []string{"prefill", "decode"} {
		p := "roles." + role + "."
		set = append(set, "--set", p+"workloadKind="+c.kind, "--set", p+"workload=sglang-"+role,
			"--set", fmt.Sprintf("%stopology.nnodes=%d", p, c.in.NNodes), "--set", fmt.Sprintf("%stopology.tpSize=%d", p, c.in.TP),
			"--set", fmt.Sprintf("%stopology.dpSize=%d", p, c.in.DP), "--set", fmt.Sprintf("%stopology.ppSize=%d", p, c.in.PP),
			"--set", fmt.Sprintf("%stopology.dpAttention=%v", p, c.in.DPAttention), "--set", fmt.Sprintf("%splugin.basePort=%d", p, c.in.BasePort))
	}
	out, err := helmTemplate(t, append([]string{"-f", chartCases[0].values(), "-s", "templates/sidecar-patch.yaml"}, set...)...)
	if err != nil {
		t.Fatal(err)
	}
	docs, err := splitDocs(c.kind, out)
	if err != nil {
		t.Fatal(err)
	}
	o := decodeAll(t, docs)
	pods := map[string][]groupPod{}
	add := func(role string, tmplFor func(k int) corev1.PodTemplateSpec) {
		for k := range c.in.NNodes {
			tmpl := tmplFor(k)
			name := fmt.Sprintf("%s %s %s pod %d", c.kind, c.in, role, k)
			labels, annotations := podMeta(c.kind, k, c.in.NNodes)
			s, ok := findSidecar(t, name, tmpl.Spec)
			if !ok {
				t.Fatalf("%s: no sidecar", name)
			}
			pods[role] = append(pods[role], groupPod{name, tmpl, expandArgs(t, name, s, labels, annotations)})
		}
	}
	for _, l := range o.leaderWorkerSet {
		lt := l.Spec.LeaderWorkerTemplate
		if lt.LeaderTemplate == nil {
			t.Fatalf("%s: the patch has no leaderTemplate (lwsLeaderTemplate defaults to true)", l.Name)
		}
		add(strings.TrimPrefix(l.Name, "sglang-"), func(k int) corev1.PodTemplateSpec {
			if k == 0 {
				return *lt.LeaderTemplate
			}
			return lt.WorkerTemplate
		})
		if !reflect.DeepEqual(lt.LeaderTemplate.Spec.InitContainers, lt.WorkerTemplate.Spec.InitContainers) {
			t.Errorf("%s: the leader's and the workers' sidecars differ", l.Name)
		}
	}
	for _, g := range o.rbgV1alpha2 {
		for _, r := range g.Spec.Roles {
			if r.LeaderWorkerPattern == nil {
				t.Fatalf("%s role %s: no leaderWorkerPattern", g.Name, r.Name)
			}
			add(r.Name, func(int) corev1.PodTemplateSpec { return r.LeaderWorkerPattern.Template })
		}
	}
	if len(pods) != 2 {
		t.Fatalf("%s: patches for %d roles, want prefill and decode", c.kind, len(pods))
	}
	return pods
}

// TestChartMultiNodeSidecarsWatchEveryListener renders LeaderWorkerSet and
// RoleBasedGroup instances of 2, 3 and 4 nodes, with DP attention and with
// plain TP or PP, and checks every pod's sidecar, as the kubelet expands its
// args on that pod, against the plugin's own port rule applied to every
// scheduler of the instance; then has the binary check those args
// (--config.check).
func TestChartMultiNodeSidecarsWatchEveryListener(t *testing.T) {
	bin := watchdogBinary(t)
	for _, c := range multiNodeCases() {
		for role, pods := range renderMultiNode(t, c) {
			name := c.kind + " " + role
			checkInstance(t, name, c.in, pods)
			for _, p := range pods {
				checkSidecarArgsWithBinary(t, bin, p.name, p.args)
			}
		}
	}
}

var (
	binaryOnce sync.Once
	binaryPath string
	binaryErr  error
)

// watchdogBinary builds the repository's sglang-watchdog once per test run.
func watchdogBinary(t *testing.T) string {
	t.Helper()
	binaryOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sglang-watchdog-verify")
		if err != nil {
			binaryErr = err
			return
		}
		binaryPath = filepath.Join(dir, "sglang-watchdog")
		cmd := exec.Command("go", "build", "-o", binaryPath, ".")
		cmd.Dir = repoRoot
		if out, err := cmd.CombinedOutput(); err != nil {
			binaryErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binaryErr != nil {
		t.Fatal(binaryErr)
	}
	return binaryPath
}

// podPaths are the directories the chart mounts into the sidecar; the
// binary's check reads the files there, so they move to a temporary
// directory with a token in it.
var podPaths = []string{"/var/run/secrets/sglang-watchdog", "/etc/sglang-watchdog/mode", "/etc/sglang-watchdog/prefill-watchdog", "/var/lib/sglang-watchdog"}

// checkSidecarArgsWithBinary runs the binary with --config.check over a
// sidecar's args (the pod's files replaced by stand-ins), so that an arg
// the binary refuses fails here rather than in the pod.
func checkSidecarArgsWithBinary(t *testing.T, bin, name string, args []string) {
	t.Helper()
	dir := t.TempDir()
	var moved []string
	for _, a := range args {
		for i, p := range podPaths {
			if strings.Contains(a, p+"/") {
				local := filepath.Join(dir, strconv.Itoa(i))
				if err := os.MkdirAll(local, 0o755); err != nil {
					t.Fatal(err)
				}
				a = strings.ReplaceAll(a, p+"/", local+"/")
			}
		}
		moved = append(moved, a)
	}
	if err := os.WriteFile(filepath.Join(dir, "0", "token"), []byte(ciToken), 0o600); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	out, err := run(bin, append(moved, "--config.check")...)
	if err != nil {
		t.Errorf("%s: the binary refuses the rendered sidecar args: %v\n%s", name, err, out)
	}
}
