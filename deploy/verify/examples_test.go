package verify

import (
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
}

func loadExamples(t *testing.T) []podTemplate {
	t.Helper()
	var out []podTemplate
	for _, f := range []string{"deploy/examples/leaderworkerset/sglang-pd.yaml", "deploy/examples/rolebasedgroup/sglang-pd.yaml"} {
		docs, err := splitDocs(f, readRepoFile(t, f))
		if err != nil {
			t.Fatal(err)
		}
		o := decodeAll(t, docs)
		if len(o.leaderWorkerSet)+len(o.roleBasedGroups) == 0 {
			t.Errorf("%s: no LeaderWorkerSet or RoleBasedGroup", f)
		}
		for _, l := range o.leaderWorkerSet {
			lt := l.Spec.LeaderWorkerTemplate
			if lt.Size == nil || *lt.Size < 1 {
				t.Errorf("%s: LeaderWorkerSet %s needs a size", f, l.Name)
			}
			if lt.LeaderTemplate != nil {
				out = append(out, podTemplate{f + " " + l.Name + " leader", *lt.LeaderTemplate})
			}
			out = append(out, podTemplate{f + " " + l.Name + " worker", lt.WorkerTemplate})
		}
		for _, g := range o.roleBasedGroups {
			for _, r := range g.Spec.Roles {
				if r.Template == nil {
					t.Errorf("%s: role %s has no template", f, r.Name)
					continue
				}
				out = append(out, podTemplate{f + " " + g.Name + " role " + r.Name, *r.Template})
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

// TestExamplesRunTheWatchdogWhereSGLangServes checks every pod template:
// the pod that runs SGLang's HTTP server (--port) carries the sidecar,
// which reads one plugin listener per rank with the token, prefill and
// decode alike; pods without the server (LWS workers, the router) carry
// none. The pods carry the labels the chart's PodMonitors select.
func TestExamplesRunTheWatchdogWhereSGLangServes(t *testing.T) {
	var prefill, decode int
	for _, p := range loadExamples(t) {
		spec := p.tmpl.Spec
		s, isSGLang := sglangServer(spec)
		_, hasSidecar := findSidecar(t, p.name, spec)
		serves := isSGLang && len(flagValues(s.Args, "port")) == 1
		if !serves {
			if hasSidecar {
				t.Errorf("%s: a pod without SGLang's HTTP server carries the watchdog", p.name)
			}
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
		// Both roles: ranks on this pod are the attention-TP leaders of
		// dp_size * pp_size (the examples keep every leader on the pod with
		// the server), watched in dry-run; restarts stay off.
		want := sidecarWant{
			mode:       "dry-run",
			pluginBase: 28100,
			ranks:      intFlag(t, p.name, s.Args, "dp-size", 1) * intFlag(t, p.name, s.Args, "pp-size", 1),
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
		if u := flagValues(findArgs(t, p.name, spec), "sglang.metrics-url"); len(u) != 1 || !strings.HasSuffix(u[0], ":"+flagValues(s.Args, "port")[0]+"/metrics") {
			t.Errorf("%s: --sglang.metrics-url %q does not read SGLang's --port", p.name, u)
		}
	}
	// Both examples deploy both roles.
	if prefill != 2 || decode != 2 {
		t.Errorf("want a prefill and a decode server in each of the two examples, have %d prefill and %d decode", prefill, decode)
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
