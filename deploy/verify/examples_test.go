package verify

import (
	"fmt"
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

// roleBasedGroupV1alpha2 mirrors the fields of a workloads.x-k8s.io/v1alpha2
// RoleBasedGroup that the chart's patch uses: roles by name, each with a
// leaderWorkerPattern whose one template serves the leader and the workers
// (sgl-project/rbg v0.8.0-alpha.5, api/workloads/v1alpha2).
type roleBasedGroupV1alpha2 struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Roles []struct {
			Name                string `json:"name"`
			LeaderWorkerPattern *struct {
				Size     *int32                 `json:"size,omitempty"`
				Template corev1.PodTemplateSpec `json:"template"`
			} `json:"leaderWorkerPattern,omitempty"`
		} `json:"roles"`
	} `json:"spec"`
}

// podTemplate is one pod template of an example, named for messages.
type podTemplate struct {
	name string
	tmpl corev1.PodTemplateSpec
	// nodes is the pods of one SGLang server (an LWS group's size);
	// nodeRanks are the --node-rank values of the pods this template runs:
	// 0 for a leader, 1 to nodes-1 for LWS workers.
	nodes       int
	nodeRanks   []int
	hostNetwork bool
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
		// Without a leader template, the leader runs the worker template.
		first := 0
		if lt.LeaderTemplate != nil {
			out = append(out, podTemplate{f + " " + name + " leader", *lt.LeaderTemplate, size, []int{0}, hostNetwork})
			first = 1
		}
		var ranks []int
		for k := first; k < size; k++ {
			ranks = append(ranks, k)
		}
		out = append(out, podTemplate{f + " " + name + " worker", lt.WorkerTemplate, size, ranks, hostNetwork})
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
				out = append(out, podTemplate{f + " " + g.Name + " role " + r.Name, *r.Template, 1, []int{0}, e.hostNetwork})
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

// exampleInstance reads an SGLang server's parallelism from its launch
// args and the plugin's base port from its env.
func exampleInstance(t *testing.T, p podTemplate, s corev1.Container) instance {
	t.Helper()
	in := instance{
		NNodes: p.nodes, TP: intFlag(t, p.name, s.Args, "tp-size", 1), DP: intFlag(t, p.name, s.Args, "dp-size", 1),
		PP: intFlag(t, p.name, s.Args, "pp-size", 1), DPAttention: containsArg(s.Args, "--enable-dp-attention"), BasePort: 28100,
	}
	for _, e := range s.Env {
		if e.Name == "SGLANG_WATCHDOG_PLUGIN_PORT" {
			in.BasePort, _ = strconv.Atoi(e.Value)
		}
	}
	return in
}

// TestExamplesRunTheWatchdogWhereSGLangServes checks every pod of every
// example, node rank by node rank: a pod whose node runs a scheduler that
// leads its attention-TP group carries the sidecar, which, with its args
// expanded as the kubelet does on that pod, watches exactly the plugin
// ports the plugin opens on that node (plugin_ports.py: SGLang's placement,
// the plugin's own rule), with the token, prefill and decode alike, and
// reads SGLang's /metrics on the pod's --port; pods without such a
// scheduler (the workers of a plain TP server, the router) carry none. The
// pods carry the labels the chart's PodMonitors select, and run on the
// node's network where the example says so.
func TestExamplesRunTheWatchdogWhereSGLangServes(t *testing.T) {
	var prefill, decode, workers int
	for _, p := range loadExamples(t) {
		spec := p.tmpl.Spec
		s, isSGLang := sglangServer(spec)
		sidecar, hasSidecar := findSidecar(t, p.name, spec)
		if !isSGLang {
			if hasSidecar {
				t.Errorf("%s: a pod without SGLang carries the watchdog", p.name)
			}
			continue
		}
		checkHostNetwork(t, p.name, spec, p.hostNetwork)
		in := exampleInstance(t, p, s)
		want := pluginPorts(t, in)
		var leads bool
		for _, k := range p.nodeRanks {
			leads = leads || len(want[k]) > 0
		}
		if !leads {
			if hasSidecar {
				t.Errorf("%s: a pod without a scheduler that leads its attention-TP group carries the watchdog", p.name)
			}
			continue
		}
		if !hasSidecar {
			t.Errorf("%s: runs schedulers that lead attention-TP groups, but no sidecar", p.name)
			continue
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
		if mode[0] == "prefill" {
			prefill++
		} else {
			decode++
		}
		if p.nodeRanks[0] > 0 {
			workers++
		}
		for _, k := range p.nodeRanks {
			name := fmt.Sprintf("%s node %d", p.name, k)
			labels, annotations := podMeta("LeaderWorkerSet", k, p.nodes)
			expanded := sidecar
			expanded.Args = expandArgs(t, name, sidecar, labels, annotations)
			// Both roles: this node's attention-TP leaders, watched in
			// dry-run; restarts stay off.
			checkSidecar(t, name, corev1.PodSpec{InitContainers: []corev1.Container{expanded}, Containers: spec.Containers, Volumes: spec.Volumes},
				sidecarWant{mode: "dry-run", ports: want[k], secretName: "sglang-watchdog-plugin-token"})
			u := flagValues(expanded.Args, "sglang.metrics-url")
			if len(u) != 1 || !strings.HasSuffix(u[0], ":"+strconv.Itoa(intFlag(t, p.name, s.Args, "port", 30000))+"/metrics") {
				t.Errorf("%s: --sglang.metrics-url %q does not read SGLang's --port on this node", name, u)
			}
		}
	}
	// Every example deploys both roles; the LeaderWorkerSet's and the
	// DisaggregatedSet's DP-attention servers run sidecars on their
	// workers too.
	if n := len(examples); prefill < n || decode < n || workers < 2 {
		t.Errorf("want a prefill and a decode server in each of the %d examples and DP-attention workers, have %d prefill, %d decode and %d worker sidecars", n, prefill, decode, workers)
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
