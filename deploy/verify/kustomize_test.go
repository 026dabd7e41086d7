package verify

import (
	"encoding/json"
	"os"
	"path"
	"sort"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

const componentRel = "deploy/kustomize/sglang-watchdog"

// plainSGLang returns a manifest Deployment with everything the watchdog
// adds taken out: what a user's SGLang Deployment looks like before the
// component. Its automountServiceAccountToken stays: the workload's own.
func plainSGLang(dep appsv1.Deployment) appsv1.Deployment {
	out := *dep.DeepCopy()
	spec := &out.Spec.Template.Spec
	spec.InitContainers = nil
	var vols []corev1.Volume
	for _, v := range spec.Volumes {
		if v.Name != "watchdog-token" {
			vols = append(vols, v)
		}
	}
	spec.Volumes = vols
	for i := range spec.Containers {
		c := &spec.Containers[i]
		var env []corev1.EnvVar
		for _, e := range c.Env {
			if !strings.HasPrefix(e.Name, "SGLANG_") {
				env = append(env, e)
			}
		}
		c.Env = env
		var mounts []corev1.VolumeMount
		for _, m := range c.VolumeMounts {
			if m.Name != "watchdog-token" {
				mounts = append(mounts, m)
			}
		}
		c.VolumeMounts = mounts
	}
	return out
}

func manifestDeployment(t *testing.T, role string) appsv1.Deployment {
	t.Helper()
	rel := "deploy/kubernetes/" + role + "/deployment.yaml"
	docs, err := splitDocs(rel, readRepoFile(t, rel))
	if err != nil {
		t.Fatal(err)
	}
	deps := decodeAll(t, docs).deployments
	if len(deps) != 1 {
		t.Fatalf("%s: want one Deployment", rel)
	}
	return deps[0]
}

// buildWithComponent builds, with kustomize's Go API on an in-memory file
// system, an overlay of the given resources that uses the component.
func buildWithComponent(t *testing.T, overlay string, resources map[string]any) []byte {
	t.Helper()
	fs := filesys.MakeFsInMemory()
	// The component as committed.
	entries, err := os.ReadDir(repoPath(componentRel))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		if err := fs.WriteFile(path.Join("/component", e.Name()), readRepoFile(t, componentRel+"/"+e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	for name, obj := range resources {
		b, err := yaml.Marshal(obj)
		if err != nil {
			t.Fatal(err)
		}
		if err := fs.WriteFile(path.Join("/app", name), b); err != nil {
			t.Fatal(err)
		}
	}
	if err := fs.WriteFile("/app/kustomization.yaml", []byte(overlay)); err != nil {
		t.Fatal(err)
	}
	if err := fs.WriteFile("/app/token", []byte("0123456789abcdef0123456789abcdef")); err != nil {
		t.Fatal(err)
	}
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fs, "/app")
	if err != nil {
		t.Fatalf("kustomize build: %v", err)
	}
	out, err := m.AsYaml()
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// sortedMounts returns a copy with the pod's volumes and every container's
// volume mounts sorted by name.
func sortedMounts(dep appsv1.Deployment) appsv1.Deployment {
	out := *dep.DeepCopy()
	spec := &out.Spec.Template.Spec
	sort.Slice(spec.Volumes, func(i, j int) bool { return spec.Volumes[i].Name < spec.Volumes[j].Name })
	for _, cs := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
		for i := range cs {
			m := cs[i].VolumeMounts
			sort.Slice(m, func(i, j int) bool { return m[i].Name < m[j].Name })
		}
	}
	return out
}

func asJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestKustomizeComponentReproducesTheManifests: the component turns plain
// SGLang Deployments into exactly the Deployments of deploy/kubernetes, and
// a token Secret from a secretGenerator reaches the volume under its hashed
// name.
func TestKustomizeComponentReproducesTheManifests(t *testing.T) {
	want := map[string]appsv1.Deployment{}
	resources := map[string]any{}
	for _, role := range []string{"prefill", "decode"} {
		d := manifestDeployment(t, role)
		want[d.Name] = d
		resources[role+".yaml"] = plainSGLang(d)
	}
	out := buildWithComponent(t, `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - prefill.yaml
  - decode.yaml
components:
  - ../component
secretGenerator:
  - name: sglang-watchdog-plugin-token
    files:
      - token
`, resources)
	docs, err := splitDocs("kustomize build", out)
	if err != nil {
		t.Fatal(err)
	}
	o := decodeAll(t, docs)
	if len(o.secrets) != 1 || !strings.HasPrefix(o.secrets[0].Name, "sglang-watchdog-plugin-token-") {
		t.Fatalf("want the generated token Secret with a hash suffix, have %d Secrets", len(o.secrets))
	}
	hashed := o.secrets[0].Name
	if len(o.deployments) != 2 {
		t.Fatalf("want 2 Deployments, have %d", len(o.deployments))
	}
	for _, got := range o.deployments {
		w, ok := want[got.Name]
		if !ok {
			t.Errorf("unexpected Deployment %s", got.Name)
			continue
		}
		// The generator's hashed name replaces the plain one in the volume.
		var refs int
		for i, v := range got.Spec.Template.Spec.Volumes {
			if v.Secret != nil {
				if v.Secret.SecretName != hashed {
					t.Errorf("%s: volume %s names Secret %q, want the generated %q", got.Name, v.Name, v.Secret.SecretName, hashed)
				}
				got.Spec.Template.Spec.Volumes[i].Secret.SecretName = "sglang-watchdog-plugin-token"
				refs++
			}
		}
		// Strategic merge puts the patch's volumes and mounts first; their
		// order means nothing to Kubernetes.
		if a, b := asJSON(t, sortedMounts(got)), asJSON(t, sortedMounts(w)); a != b {
			t.Errorf("%s: the component's result differs from deploy/kubernetes:\ncomponent: %s\nmanifest:  %s", got.Name, a, b)
		}
		checkSidecar(t, got.Name, got.Spec.Template.Spec, sidecarWant{mode: "dry-run", ports: []int{28100, 28101}, secretName: "sglang-watchdog-plugin-token"})
		if refs != 1 {
			t.Errorf("%s: %d Secret volumes, want the token's", got.Name, refs)
		}
	}
}

// TestKustomizeComponentKeepsWorkloadSettings: the component, a strategic
// merge patch like the chart's, keeps what the Deployments set themselves
// (an SGLANG_PLUGINS whitelist, other env, service-account settings, pull
// secrets).
func TestKustomizeComponentKeepsWorkloadSettings(t *testing.T) {
	resources := map[string]any{}
	for _, role := range []string{"prefill", "decode"} {
		resources[role+".yaml"] = plainSGLangWithOwnSettings(t, role)
	}
	out := buildWithComponent(t, `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [prefill.yaml, decode.yaml]
components: [../component]
`, resources)
	docs, err := splitDocs("kustomize build", out)
	if err != nil {
		t.Fatal(err)
	}
	deps := decodeAll(t, docs).deployments
	if len(deps) != 2 {
		t.Fatalf("want 2 Deployments, have %d", len(deps))
	}
	for _, d := range deps {
		checkSidecar(t, d.Name, d.Spec.Template.Spec, sidecarWant{mode: "dry-run", ports: []int{28100, 28101}, secretName: "sglang-watchdog-plugin-token"})
		checkKeepsWorkloadSettings(t, d.Name, d)
	}
}

// TestKustomizeComponentLeavesOtherWorkloads: only Deployments labelled as
// prefill or decode get a sidecar.
func TestKustomizeComponentLeavesOtherWorkloads(t *testing.T) {
	router := plainSGLang(manifestDeployment(t, "prefill"))
	router.Name = "router"
	router.Labels = map[string]string{"app.kubernetes.io/component": "router"}
	out := buildWithComponent(t, `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - router.yaml
components:
  - ../component
`, map[string]any{"router.yaml": router})
	docs, err := splitDocs("kustomize build", out)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range decodeAll(t, docs).deployments {
		if _, ok := findSidecar(t, d.Name, d.Spec.Template.Spec); ok {
			t.Errorf("%s: the component added a sidecar to a workload that is neither prefill nor decode", d.Name)
		}
	}
}

// TestKustomizeComponentTakesMoreRanks runs the overlay of
// docs/deployment.md ("Kustomize") that adds two plugin ranks.
func TestKustomizeComponentTakesMoreRanks(t *testing.T) {
	prefill := plainSGLang(manifestDeployment(t, "prefill"))
	out := buildWithComponent(t, `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [prefill.yaml]
components: [../component]
secretGenerator:
  - name: sglang-watchdog-plugin-token
    files: [token]
patches:
  - target: {kind: Deployment, labelSelector: app.kubernetes.io/component=prefill}
    patch: |-
      - op: add
        path: /spec/template/spec/initContainers/0/args/5
        value: --plugin.url=http://127.0.0.1:28102
      - op: add
        path: /spec/template/spec/initContainers/0/args/6
        value: --plugin.url=http://127.0.0.1:28103
`, map[string]any{"prefill.yaml": prefill})
	docs, err := splitDocs("kustomize build", out)
	if err != nil {
		t.Fatal(err)
	}
	o := decodeAll(t, docs)
	if len(o.deployments) != 1 || len(o.secrets) != 1 {
		t.Fatalf("want one Deployment and one Secret, have %d and %d", len(o.deployments), len(o.secrets))
	}
	checkSidecar(t, "4 ranks", o.deployments[0].Spec.Template.Spec, sidecarWant{
		mode: "dry-run", ports: []int{28100, 28101, 28102, 28103}, secretName: o.secrets[0].Name,
	})
}

// TestKustomizeComponentAsksPrefill runs the overlay of docs/deployment.md
// ("Kustomize") that gives the decode sidecar the prefill verdict lookups.
func TestKustomizeComponentAsksPrefill(t *testing.T) {
	decode := plainSGLang(manifestDeployment(t, "decode"))
	out := buildWithComponent(t, `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [decode.yaml]
components: [../component]
secretGenerator:
  - name: sglang-watchdog-plugin-token
    files: [token]
patches:
  - target: {kind: Deployment, labelSelector: app.kubernetes.io/component=decode}
    patch: |-
      - op: add
        path: /spec/template/spec/initContainers/0/args/-
        value: --decode.prefill-watchdog-url=http://{host}:9433
      - op: add
        path: /spec/template/spec/initContainers/0/args/-
        value: --decode.prefill-networks=10.244.0.0/16   # the prefill pods' CIDR
`, map[string]any{"decode.yaml": decode})
	docs, err := splitDocs("kustomize build", out)
	if err != nil {
		t.Fatal(err)
	}
	o := decodeAll(t, docs)
	if len(o.deployments) != 1 || len(o.secrets) != 1 {
		t.Fatalf("want one Deployment and one Secret, have %d and %d", len(o.deployments), len(o.secrets))
	}
	checkSidecar(t, "decode with verdicts", o.deployments[0].Spec.Template.Spec, sidecarWant{
		mode: "dry-run", ports: []int{28100, 28101}, secretName: o.secrets[0].Name, verdictURL: "http://{host}:9433",
	})
}
