package verify

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"sigs.k8s.io/yaml"

	"github.com/sglang-watchdog/sglang-watchdog/deploy/kubernetes"
)

// repoRoot is the repository root, seen from this module's directory.
const repoRoot = "../.."

func repoPath(rel string) string { return filepath.Join(repoRoot, filepath.FromSlash(rel)) }

func readRepoFile(t *testing.T, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(repoPath(rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// doc is one YAML document, converted to JSON.
type doc struct {
	source     string
	index      int
	json       []byte
	apiVersion string
	kind       string
	name       string
}

func (d doc) String() string {
	return fmt.Sprintf("%s#%d (%s %s %s)", d.source, d.index, d.apiVersion, d.kind, d.name)
}

// splitDocs splits a YAML stream into documents (kubernetes.SplitDocuments).
func splitDocs(source string, data []byte) ([]doc, error) {
	ds, err := kubernetes.SplitDocuments(source, data)
	if err != nil {
		return nil, err
	}
	out := make([]doc, len(ds))
	for i, d := range ds {
		out[i] = doc{source: d.Source, index: d.Index, json: d.JSON, apiVersion: d.APIVersion, kind: d.Kind, name: d.Name}
	}
	return out, nil
}

// decodeStrict decodes a document into obj, rejecting unknown fields.
func decodeStrict(d doc, obj any) error {
	if err := yaml.UnmarshalStrict(d.json, obj); err != nil {
		return fmt.Errorf("%s: %w", d, err)
	}
	return nil
}

// objects holds decoded objects by kind, in the order they came.
type objects struct {
	secrets         []corev1.Secret
	pods            []corev1.Pod
	configMaps      []corev1.ConfigMap
	deployments     []appsv1.Deployment
	networkPolicies []networkingv1.NetworkPolicy
	podMonitors     []monitoringv1.PodMonitor
	prometheusRules []monitoringv1.PrometheusRule
	leaderWorkerSet []leaderWorkerSet
	roleBasedGroups []roleBasedGroup
	rbgV1alpha2     []roleBasedGroupV1alpha2
	disaggSets      []disaggregatedSet
	services        []corev1.Service
}

// decodeAll decodes every document strictly into its API type; a kind
// without a decoder is an error.
func decodeAll(t *testing.T, docs []doc) objects {
	t.Helper()
	var o objects
	for _, d := range docs {
		var err error
		switch d.apiVersion + " " + d.kind {
		case "v1 Secret":
			var obj corev1.Secret
			err = decodeStrict(d, &obj)
			o.secrets = append(o.secrets, obj)
		case "v1 Pod":
			var obj corev1.Pod
			err = decodeStrict(d, &obj)
			o.pods = append(o.pods, obj)
		case "v1 ConfigMap":
			var obj corev1.ConfigMap
			err = decodeStrict(d, &obj)
			o.configMaps = append(o.configMaps, obj)
		case "apps/v1 Deployment":
			var obj appsv1.Deployment
			err = decodeStrict(d, &obj)
			o.deployments = append(o.deployments, obj)
		case "networking.k8s.io/v1 NetworkPolicy":
			var obj networkingv1.NetworkPolicy
			err = decodeStrict(d, &obj)
			o.networkPolicies = append(o.networkPolicies, obj)
		case "monitoring.coreos.com/v1 PodMonitor":
			var obj monitoringv1.PodMonitor
			err = decodeStrict(d, &obj)
			o.podMonitors = append(o.podMonitors, obj)
		case "monitoring.coreos.com/v1 PrometheusRule":
			var obj monitoringv1.PrometheusRule
			err = decodeStrict(d, &obj)
			o.prometheusRules = append(o.prometheusRules, obj)
		case "leaderworkerset.x-k8s.io/v1 LeaderWorkerSet":
			var obj leaderWorkerSet
			err = decodeStrict(d, &obj)
			o.leaderWorkerSet = append(o.leaderWorkerSet, obj)
		case "workloads.x-k8s.io/v1alpha1 RoleBasedGroup":
			var obj roleBasedGroup
			err = decodeStrict(d, &obj)
			o.roleBasedGroups = append(o.roleBasedGroups, obj)
		case "workloads.x-k8s.io/v1alpha2 RoleBasedGroup":
			var obj roleBasedGroupV1alpha2
			err = decodeStrict(d, &obj)
			o.rbgV1alpha2 = append(o.rbgV1alpha2, obj)
		case "v1 Service":
			var obj corev1.Service
			err = decodeStrict(d, &obj)
			o.services = append(o.services, obj)
		case "disaggregatedset.x-k8s.io/v1 DisaggregatedSet":
			var obj disaggregatedSet
			err = decodeStrict(d, &obj)
			o.disaggSets = append(o.disaggSets, obj)
		default:
			err = fmt.Errorf("%s: no strict decoder for this kind; add one to the test", d)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	return o
}

func TestStrictDecodingRejectsUnknownFields(t *testing.T) {
	for _, src := range []string{
		"apiVersion: monitoring.coreos.com/v1\nkind: PodMonitor\nspec:\n  podMetricsEndpoint: []\n",
		"apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nspec:\n  groups:\n  - name: g\n    rules:\n    - alert: A\n      expr: up\n      severity: page\n",
		"apiVersion: leaderworkerset.x-k8s.io/v1\nkind: LeaderWorkerSet\nspec:\n  leaderWorkerTemplate:\n    workerTemplate:\n      spec:\n        containers:\n        - name: a\n          imagePullPolicies: Always\n",
		"apiVersion: workloads.x-k8s.io/v1alpha1\nkind: RoleBasedGroup\nspec:\n  roles:\n  - name: a\n    replica: 1\n",
		"apiVersion: disaggregatedset.x-k8s.io/v1\nkind: DisaggregatedSet\nspec:\n  roles:\n  - name: a\n    spec:\n      leaderWorkerTemplate:\n        sise: 1\n",
	} {
		docs, err := splitDocs("inline", []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range docs {
			var obj any
			switch d.kind {
			case "PodMonitor":
				obj = &monitoringv1.PodMonitor{}
			case "PrometheusRule":
				obj = &monitoringv1.PrometheusRule{}
			case "LeaderWorkerSet":
				obj = &leaderWorkerSet{}
			case "RoleBasedGroup":
				obj = &roleBasedGroup{}
			case "DisaggregatedSet":
				obj = &disaggregatedSet{}
			}
			if err := decodeStrict(d, obj); err == nil {
				t.Errorf("%s: an unknown field was accepted", d)
			}
		}
	}
}
