package verify

import (
	"reflect"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The Go API modules of LeaderWorkerSet, DisaggregatedSet and
// RoleBasedGroup are not available here, so these mirror the fields the
// examples use (names and shapes from leaderworkerset.x-k8s.io/v1,
// disaggregatedset.x-k8s.io/v1 and workloads.x-k8s.io/v1alpha1); the pod
// templates they embed are the real core/v1 types, so strict decoding
// checks every pod field.

type leaderWorkerSetSpec struct {
	Replicas             *int32 `json:"replicas,omitempty"`
	StartupPolicy        string `json:"startupPolicy,omitempty"`
	LeaderWorkerTemplate struct {
		Size           *int32                  `json:"size,omitempty"`
		RestartPolicy  string                  `json:"restartPolicy,omitempty"`
		LeaderTemplate *corev1.PodTemplateSpec `json:"leaderTemplate,omitempty"`
		WorkerTemplate corev1.PodTemplateSpec  `json:"workerTemplate"`
	} `json:"leaderWorkerTemplate"`
}

type leaderWorkerSet struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              leaderWorkerSetSpec `json:"spec"`
}

// disaggregatedSet: one LeaderWorkerSet template per role
// (DisaggregatedRoleSpec inlines LeaderWorkerSetTemplateSpec).
type disaggregatedSet struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Roles []struct {
			Name     string              `json:"name"`
			Metadata *metav1.ObjectMeta  `json:"metadata,omitempty"`
			Spec     leaderWorkerSetSpec `json:"spec"`
		} `json:"roles"`
	} `json:"spec"`
}

type roleBasedGroup struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Roles []struct {
			Name         string   `json:"name"`
			Replicas     *int32   `json:"replicas"`
			Dependencies []string `json:"dependencies,omitempty"`
			Workload     struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
			} `json:"workload"`
			Template *corev1.PodTemplateSpec `json:"template,omitempty"`
		} `json:"roles"`
	} `json:"spec"`
}

// podTemplate is one pod template of an example, named for messages.
type podTemplate struct {
	name string
	tmpl corev1.PodTemplateSpec
	// nodes is the pods of one SGLang server (an LWS group's size);
	// nodeRank is this template's --node-rank: 0 for a leader, 1 for an LWS
	// worker (the test refuses worker sidecars in groups of more than two,
	// whose workers differ in their ranks).
	nodes, nodeRank int
	hostNetwork     bool
}

// examples lists the example files; hostNetwork: their SGLang pods run on
// the node's network.
var examples = []struct {
	file        string
	hostNetwork bool
}{
	{"deploy/examples/leaderworkerset/sglang-pd.yaml", false},
	{"deploy/examples/rolebasedgroup/sglang-pd.yaml", false},
	{"deploy/examples/disaggregatedset/sglang-pd.yaml", true},
}

func loadExamples(t *testing.T) []podTemplate {
	t.Helper()
	var out []podTemplate
	lws := func(f, name string, spec leaderWorkerSetSpec, hostNetwork bool) {
		lt := spec.LeaderWorkerTemplate
		if lt.Size == nil || *lt.Size < 1 {
			t.Errorf("%s: LeaderWorkerSet %s needs a size", f, name)
			return
		}
		size := int(*lt.Size)
		if lt.LeaderTemplate != nil {
			out = append(out, podTemplate{f + " " + name + " leader", *lt.LeaderTemplate, size, 0, hostNetwork})
		}
		// Without a leader template, the leader runs the worker template.
		rank := 0
		if lt.LeaderTemplate != nil {
			rank = 1
		}
		out = append(out, podTemplate{f + " " + name + " worker", lt.WorkerTemplate, size, rank, hostNetwork})
	}
	for _, e := range examples {
		f := e.file
		docs, err := splitDocs(f, readRepoFile(t, f))
		if err != nil {
			t.Fatal(err)
		}
		o := decodeAll(t, docs)
		if len(o.leaderWorkerSet)+len(o.roleBasedGroups)+len(o.disaggSets) == 0 {
			t.Errorf("%s: no LeaderWorkerSet, DisaggregatedSet or RoleBasedGroup", f)
		}
		for _, l := range o.leaderWorkerSet {
			lws(f, l.Name, l.Spec, e.hostNetwork)
		}
		for _, d := range o.disaggSets {
			for _, r := range d.Spec.Roles {
				lws(f, d.Name+" role "+r.Name, r.Spec, e.hostNetwork)
			}
		}
		for _, g := range o.roleBasedGroups {
			for _, r := range g.Spec.Roles {
				if r.Template == nil {
					t.Errorf("%s: role %s has no template", f, r.Name)
					continue
				}
				out = append(out, podTemplate{f + " " + g.Name + " role " + r.Name, *r.Template, 1, 0, e.hostNetwork})
			}
		}
	}
	return out
}

// sglangServer returns the SGLang server container of a pod, if any.
func sglangServer(spec corev1.PodSpec) (corev1.Container, bool) {
	for _, c := range spec.Containers {
		if len(c.Command) >= 3 && c.Command[0] == "python3" && c.Command[2] == "sglang.launch_server" {
			return c, true
		}
	}
	return corev1.Container{}, false
}

func intFlag(t *testing.T, name string, args []string, flag string, def int) int {
	t.Helper()
	v := flagValues(args, flag)
	if len(v) == 0 {
		return def
	}
	n, err := strconv.Atoi(v[0])
	if err != nil {
		t.Fatalf("%s: --%s=%q", name, flag, v[0])
	}
	return n
}

// leadRanks returns the plugin ports of the ranks that lead their
// attention-TP group on one pod of an SGLang server: without DP attention,
// the dp_size * pp_size leaders all sit on node rank 0 (tp_rank 0 of each
// DP replica); with DP attention, node n runs TP ranks
// tp_size/nnodes * n onwards and dp_rank = tp_rank / (tp_size/dp_size)
// (SGLang v0.5.18, managers/data_parallel_controller.py), each on
// 28100 + dp_rank * pp_size + pp_rank.
func leadRanks(t *testing.T, p podTemplate, args []string) (first, count int) {
	t.Helper()
	dp := intFlag(t, p.name, args, "dp-size", 1)
	pp := intFlag(t, p.name, args, "pp-size", 1)
	if !containsArg(args, "--enable-dp-attention") {
		if p.nodeRank != 0 {
			return 0, 0
		}
		return 28100, dp * pp
	}
	tp := intFlag(t, p.name, args, "tp-size", 1)
	if pp != 1 {
		t.Fatalf("%s: the test knows DP attention layouts with pp_size 1 only", p.name)
	}
	attnTP, perNode := tp/dp, tp/p.nodes
	if perNode < attnTP {
		t.Fatalf("%s: an attention-TP group spans nodes", p.name)
	}
	return 28100 + p.nodeRank*perNode/attnTP, perNode / attnTP
}

// TestExamplesRunTheWatchdogWhereSGLangServes checks every pod template:
// every pod that runs a scheduler leading its attention-TP group carries
// the sidecar, which reads exactly that pod's plugin listeners with the
// token, prefill and decode alike, and SGLang's /metrics where the HTTP
// server (--port) runs; pods without such schedulers (LWS workers without
// DP attention, the router) carry none. The pods carry the labels the
// chart's PodMonitors select, and run on the node's network where the
// example says so.
func TestExamplesRunTheWatchdogWhereSGLangServes(t *testing.T) {
	var prefill, decode, workers int
	for _, p := range loadExamples(t) {
		spec := p.tmpl.Spec
		s, isSGLang := sglangServer(spec)
		_, hasSidecar := findSidecar(t, p.name, spec)
		serves := isSGLang && len(flagValues(s.Args, "port")) == 1
		var first, ranks int
		if isSGLang {
			first, ranks = leadRanks(t, p, s.Args)
			checkHostNetwork(t, p.name, spec, p.hostNetwork)
		}
		if ranks == 0 {
			if hasSidecar {
				t.Errorf("%s: a pod without a scheduler that leads its attention-TP group carries the watchdog", p.name)
			}
			continue
		}
		if !serves {
			if p.nodes > 2 {
				t.Errorf("%s: one worker template for %d nodes cannot name each worker's ranks", p.name, p.nodes)
			}
			workers++
		}
		mode := flagValues(s.Args, "disaggregation-mode")
		if len(mode) != 1 || (mode[0] != "prefill" && mode[0] != "decode") {
			t.Errorf("%s: --disaggregation-mode %q", p.name, mode)
			continue
		}
		if got := p.tmpl.Labels["app.kubernetes.io/component"]; got != mode[0] {
			t.Errorf("%s: label app.kubernetes.io/component=%q, want %s (the chart's PodMonitors select it)", p.name, got, mode[0])
		}
		if !containsArg(s.Args, "--enable-metrics") {
			t.Errorf("%s: SGLang needs --enable-metrics", p.name)
		}
		// Both roles: the attention-TP leaders on this pod, watched in
		// dry-run; restarts stay off.
		want := sidecarWant{
			mode:       "dry-run",
			pluginBase: first,
			ranks:      ranks,
			secretName: "sglang-watchdog-plugin-token",
		}
		if !hasEnv(s, "SGLANG_PLUGINS", "sglang_watchdog") {
			t.Errorf("%s: %s SGLang must load the plugin", p.name, mode[0])
		}
		if mode[0] == "prefill" {
			prefill++
		} else {
			decode++
		}
		checkSidecar(t, p.name, spec, want)
		u := flagValues(findArgs(t, p.name, spec), "sglang.metrics-url")
		switch {
		case serves && (len(u) != 1 || !strings.HasSuffix(u[0], ":"+flagValues(s.Args, "port")[0]+"/metrics")):
			t.Errorf("%s: --sglang.metrics-url %q does not read SGLang's --port", p.name, u)
		case !serves && !reflect.DeepEqual(u, []string{""}):
			t.Errorf("%s: --sglang.metrics-url %q on a pod without SGLang's HTTP server; want it empty", p.name, u)
		}
	}
	// Every example deploys both roles; the DisaggregatedSet's decode
	// worker runs a sidecar of its own (DP attention over two nodes).
	if n := len(examples); prefill != n || decode != n+1 || workers != 1 {
		t.Errorf("want a prefill and a decode server in each of the %d examples and one DP-attention worker, have %d prefill, %d decode and %d worker sidecars", n, prefill, decode, workers)
	}
}

func containsArg(args []string, a string) bool {
	for _, x := range args {
		if x == a {
			return true
		}
	}
	return false
}

func findArgs(t *testing.T, name string, spec corev1.PodSpec) []string {
	t.Helper()
	c, _ := findSidecar(t, name, spec)
	return c.Args
}
