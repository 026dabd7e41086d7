package verify

import (
	"reflect"
	"regexp"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/sglang-watchdog/sglang-watchdog/alerts"
	"github.com/sglang-watchdog/sglang-watchdog/deploy/kubernetes/promrule"
)

// jobRe matches the job names the watchdog alerts select
// (alerts.WatchdogJobSelector, job=~"...", an anchored regexp).
var jobRe = func() *regexp.Regexp {
	m := regexp.MustCompile(`^job=~"(.*)"$`).FindStringSubmatch(alerts.WatchdogJobSelector)
	if m == nil {
		panic("alerts.WatchdogJobSelector is not job=~\"...\": " + alerts.WatchdogJobSelector)
	}
	return regexp.MustCompile("^(?:" + m[1] + ")$")
}()

// ruleSpec decodes a rule file of alerts/ strictly into the operator's
// PrometheusRuleSpec: a field the operator does not know fails here.
func ruleSpec(t *testing.T, name string) monitoringv1.PrometheusRuleSpec {
	t.Helper()
	data, err := promrule.ReadRuleFile(name)
	if err != nil {
		t.Fatal(err)
	}
	var spec monitoringv1.PrometheusRuleSpec
	if err := yaml.UnmarshalStrict(data, &spec); err != nil {
		t.Fatalf("alerts/%s as a PrometheusRuleSpec: %v", name, err)
	}
	if len(spec.Groups) == 0 {
		t.Fatalf("alerts/%s: no groups", name)
	}
	return spec
}

// checkPodMonitor checks one PodMonitor: it scrapes the sidecar's named
// port metrics on /metrics, selects pods with the given labels, and names
// the job so that the watchdog alerts select it.
func checkPodMonitor(t *testing.T, pm monitoringv1.PodMonitor, podLabels map[string]string) {
	t.Helper()
	name := pm.Namespace + "/" + pm.Name
	sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if sel.Empty() {
		t.Errorf("%s: an empty selector scrapes every pod", name)
	}
	if !sel.Matches(labels.Set(podLabels)) {
		t.Errorf("%s: selector %s does not select the SGLang pods %v", name, sel, podLabels)
	}
	if len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("%s: want one podMetricsEndpoint, have %d", name, len(pm.Spec.PodMetricsEndpoints))
	}
	ep := pm.Spec.PodMetricsEndpoints[0]
	if ep.Port == nil || *ep.Port != "metrics" || ep.Path != "/metrics" {
		t.Errorf("%s: scrapes port %v path %q, want the sidecar's named port metrics on /metrics", name, ep.Port, ep.Path)
	}
	job := ""
	for _, r := range ep.RelabelConfigs {
		if r.TargetLabel == "job" && r.Replacement != nil {
			job = *r.Replacement
		}
	}
	if !jobRe.MatchString(job) {
		t.Errorf("%s: job %q does not match the alerts' job selector %s", name, job, jobRe)
	}
}

// TestManifestsMonitoringObjects decodes the PodMonitors and
// PrometheusRules of deploy/kubernetes strictly into monitoring/v1 and
// checks them against the Deployments and alerts/.
func TestManifestsMonitoringObjects(t *testing.T) {
	for _, role := range []string{"prefill", "decode"} {
		var docs []doc
		for _, f := range []string{"deployment.yaml", "podmonitor.yaml"} {
			rel := "deploy/kubernetes/" + role + "/" + f
			d, err := splitDocs(rel, readRepoFile(t, rel))
			if err != nil {
				t.Fatal(err)
			}
			docs = append(docs, d...)
		}
		o := decodeAll(t, docs)
		if len(o.podMonitors) != 1 || len(o.deployments) != 1 {
			t.Fatalf("%s: want one Deployment and one PodMonitor", role)
		}
		checkPodMonitor(t, o.podMonitors[0], o.deployments[0].Spec.Template.Labels)
		if !strings.HasSuffix(*o.podMonitors[0].Spec.PodMetricsEndpoints[0].RelabelConfigs[0].Replacement, "-"+role) {
			t.Errorf("%s: the job should name the role", role)
		}
	}

	names, err := promrule.RuleFiles()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		rel := "deploy/kubernetes/" + promrule.ManifestPath(n)
		docs, err := splitDocs(rel, readRepoFile(t, rel))
		if err != nil {
			t.Fatal(err)
		}
		o := decodeAll(t, docs)
		if len(o.prometheusRules) != 1 {
			t.Fatalf("%s: want one PrometheusRule", rel)
		}
		if !reflect.DeepEqual(o.prometheusRules[0].Spec, ruleSpec(t, n)) {
			t.Errorf("%s does not carry exactly the rules of alerts/%s; regenerate with: %s", rel, n, promrule.Command)
		}
	}
}
