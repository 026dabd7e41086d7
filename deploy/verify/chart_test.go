package verify

import (
	"bytes"
	"encoding/json"
	"flag"
	"maps"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
)

var update = flag.Bool("update", false, "rewrite the golden sidecar renders in deploy/helm/testdata")

const (
	chartRel  = "deploy/helm/sglang-watchdog"
	goldenDir = "deploy/helm/testdata"
	release   = "w"
	namespace = "sglang"
)

// ciToken is the plugin token of the ci/ values files that set token.value.
const ciToken = "ci-token-0123456789abcdef0123456789abcdef"

// chartCase is one values file of the chart's ci/ directory and what it
// must render.
type chartCase struct {
	name          string
	roles         map[string]sidecarWant // by workload (the patch's name)
	podMonitors   map[string]string      // role -> extra label that must be set, "" for none
	secret        string                 // created token Secret, "" for none
	rules         []string               // rule files, sorted
	dashboard     bool
	networkPolicy bool
	hostNetwork   bool
	// Alerts left out and labels added (prometheusRule.disabledAlerts,
	// additionalRuleLabels).
	disabledAlerts []string
	ruleLabels     map[string]string
	// podMonitorTLS: scheme https with tlsConfig, authorization, an extra
	// relabeling, metricRelabelings and sampleLimit.
	podMonitorTLS bool
}

var chartCases = []chartCase{
	{
		name: "default",
		roles: map[string]sidecarWant{
			"sglang-prefill": {mode: "dry-run", ports: []int{28100, 28101}, secretName: "w-sglang-watchdog-plugin-token", image: "ghcr.io/sglang-watchdog/sglang-watchdog:v0.1.0"},
			"sglang-decode":  {mode: "dry-run", ports: []int{28100, 28101}, secretName: "w-sglang-watchdog-plugin-token", image: "ghcr.io/sglang-watchdog/sglang-watchdog:v0.1.0"},
		},
		podMonitors: map[string]string{"prefill": "", "decode": ""},
		secret:      "w-sglang-watchdog-plugin-token",
		rules:       []string{"watchdog"},
		dashboard:   true,
	},
	{
		name: "full",
		roles: map[string]sidecarWant{
			"big-prefill": {mode: "auto", ports: []int{28200, 28201, 28202, 28203}, secretName: "my-plugin-token", restart: "auto", restartSeconds: "3600",
				image: "ghcr.io/sglang-watchdog/sglang-watchdog@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"},
			"sglang-decode": {mode: "dry-run", ports: []int{28100, 28101}, secretName: "my-plugin-token",
				verdictURL: "https://{host}:9433", httpConfigSecret: "prefill-watchdog-client"},
		},
		podMonitors:    map[string]string{"prefill": "team", "decode": "team"},
		rules:          []string{"sglang-raw", "watchdog"},
		dashboard:      true,
		networkPolicy:  true,
		disabledAlerts: []string{"SGLangWatchdogAbsent"},
		ruleLabels:     map[string]string{"team": "inference", "severity": "must-not-win"},
		podMonitorTLS:  true,
	},
	{
		name: "hostnetwork",
		roles: map[string]sidecarWant{
			"sglang-prefill": {mode: "dry-run", ports: []int{28100, 28101}, secretName: "sglang-watchdog-plugin-token", restart: "dry-run", restartSeconds: "5400"},
			"sglang-decode":  {mode: "dry-run", ports: []int{28100, 28101}, secretName: "sglang-watchdog-plugin-token", verdictURL: "http://{host}:9433"},
		},
		podMonitors: map[string]string{"prefill": "", "decode": ""},
		rules:       []string{"watchdog"},
		dashboard:   true,
		hostNetwork: true,
	},
	{
		name:        "decode-only",
		roles:       map[string]sidecarWant{"sglang-decode": {mode: "dry-run", ports: []int{28100, 28101}, secretName: "w-sglang-watchdog-plugin-token"}},
		podMonitors: map[string]string{"decode": ""},
		secret:      "w-sglang-watchdog-plugin-token",
	},
}

func (c chartCase) values() string {
	return repoPath(chartRel + "/ci/" + c.name + "-values.yaml")
}

// operatorAPIs are the Prometheus Operator's kinds as a cluster with its
// CRDs serves them: only then does the chart render PodMonitors and
// PrometheusRules.
var operatorAPIs = []string{"--api-versions", "monitoring.coreos.com/v1/PodMonitor", "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"}

// helmTemplate renders the chart with the sidecar patches on (they are
// template-only: a patch is no installable Deployment, so helm lint, which
// checks what is installed, runs without them) for a cluster that serves
// the Prometheus Operator's kinds.
func helmTemplate(t *testing.T, args ...string) ([]byte, error) {
	t.Helper()
	return helmTemplateFor(t, operatorAPIs, args...)
}

// helmTemplateFor renders the chart like helmTemplate for a cluster that
// serves the given --api-versions.
func helmTemplateFor(t *testing.T, apis []string, args ...string) ([]byte, error) {
	t.Helper()
	base := append([]string{"template", release, repoPath(chartRel), "--namespace", namespace, "--set", "sidecarPatch.enabled=true"}, apis...)
	return run(toolPath(t, "helm"), append(base, args...)...)
}

func TestChartLint(t *testing.T) {
	helm := toolPath(t, "helm")
	files := []string{repoPath(chartRel + "/ci/lws-dp-attention-values.yaml"), repoPath(chartRel + "/ci/rbg-tp-values.yaml")}
	for _, c := range chartCases {
		files = append(files, c.values())
	}
	for _, f := range files {
		if out, err := run(helm, "lint", "--strict", repoPath(chartRel), "-f", f); err != nil {
			t.Errorf("%s: %v\n%s", f, err, out)
		}
	}
}

// TestChartRenders renders every ci/ values file, decodes every object
// strictly into its API type and checks it.
func TestChartRenders(t *testing.T) {
	dashboard := readRepoFile(t, "dashboards/sglang-watchdog.json")
	for _, c := range chartCases {
		t.Run(c.name, func(t *testing.T) {
			out, err := helmTemplate(t, "-f", c.values())
			if err != nil {
				t.Fatal(err)
			}
			docs, err := splitDocs(c.name, out)
			if err != nil {
				t.Fatal(err)
			}
			o := decodeAll(t, docs)
			for _, d := range docs {
				if d.kind != "Deployment" && d.name != "" && !strings.HasPrefix(d.name, release+"-sglang-watchdog") && d.name != "my-plugin-token" {
					t.Errorf("%s: object name %q is not prefixed with the release's full name", d, d.name)
				}
			}

			// Sidecar patches, one per enabled role.
			if len(o.deployments) != len(c.roles) {
				t.Errorf("%d sidecar patches, want %d", len(o.deployments), len(c.roles))
			}
			for _, dep := range o.deployments {
				want, ok := c.roles[dep.Name]
				if !ok {
					t.Errorf("a patch for %q, which no role names", dep.Name)
					continue
				}
				spec := dep.Spec.Template.Spec
				checkSidecar(t, c.name+" "+dep.Name, spec, want)
				// The workload's own settings stay: no service-account
				// setting, no SGLANG_PLUGINS (a whitelist the user may
				// have), no startup gate by default.
				if spec.AutomountServiceAccountToken != nil {
					t.Errorf("%s: the patch sets automountServiceAccountToken, overriding the workload's", dep.Name)
				}
				for _, ctr := range spec.Containers {
					for _, e := range ctr.Env {
						if e.Name == "SGLANG_PLUGINS" {
							t.Errorf("%s: the patch sets SGLANG_PLUGINS in %s, overwriting the workload's own", dep.Name, ctr.Name)
						}
					}
				}
				checkModeFile(t, c.name+" "+dep.Name, spec, strings.TrimPrefix(strings.TrimPrefix(dep.Name, "sglang-"), "big-"))
				checkHostNetwork(t, c.name+" "+dep.Name, spec, c.hostNetwork)
			}

			// PodMonitors.
			if len(o.podMonitors) != len(c.podMonitors) {
				t.Errorf("%d PodMonitors, want %d", len(o.podMonitors), len(c.podMonitors))
			}
			for _, pm := range o.podMonitors {
				role := strings.TrimPrefix(pm.Name, release+"-sglang-watchdog-")
				label, ok := c.podMonitors[role]
				if !ok {
					t.Errorf("PodMonitor %s for no role", pm.Name)
					continue
				}
				checkPodMonitor(t, pm, map[string]string{"app.kubernetes.io/name": "sglang", "app.kubernetes.io/component": role})
				if got := *pm.Spec.PodMetricsEndpoints[0].RelabelConfigs[0].Replacement; got != "sglang-watchdog-"+role {
					t.Errorf("%s: job %q, want sglang-watchdog-%s", pm.Name, got, role)
				}
				if label != "" && pm.Labels[label] == "" {
					t.Errorf("%s: podMonitor.additionalLabels not applied (%s)", pm.Name, label)
				}
				if pm.Namespace != namespace {
					t.Errorf("%s: namespace %q", pm.Name, pm.Namespace)
				}
				checkPodMonitorOptions(t, pm, c.podMonitorTLS)
			}

			// PrometheusRules carry alerts/ exactly.
			var rules []string
			for _, pr := range o.prometheusRules {
				slug := strings.TrimPrefix(pr.Name, release+"-sglang-watchdog-")
				rules = append(rules, slug)
				if want := ruleSpecAs(ruleSpec(t, slug+".rules.yml"), c.disabledAlerts, c.ruleLabels); !reflect.DeepEqual(pr.Spec, want) {
					t.Errorf("PrometheusRule %s does not carry exactly alerts/%s.rules.yml (less %q, with labels %v); regenerate the chart's copy with: go run ./deploy/kubernetes/gen", pr.Name, slug, c.disabledAlerts, c.ruleLabels)
				}
			}
			sort.Strings(rules)
			if !reflect.DeepEqual(rules, c.rules) {
				t.Errorf("PrometheusRules for %q, want %q", rules, c.rules)
			}

			// The dashboard ConfigMap.
			var dashboards int
			for _, cm := range o.configMaps {
				if cm.Name == release+"-sglang-watchdog-mode" {
					checkModeConfigMap(t, cm, c.roles)
					continue
				}
				if cm.Labels["grafana_dashboard"] != "1" {
					t.Errorf("ConfigMap %s lacks the label grafana_dashboard: \"1\"", cm.Name)
				}
				if !bytes.Equal([]byte(cm.Data["sglang-watchdog.json"]), dashboard) {
					t.Errorf("ConfigMap %s does not hold dashboards/sglang-watchdog.json; regenerate the chart's copy with: go run ./deploy/kubernetes/gen", cm.Name)
				}
				if !json.Valid([]byte(cm.Data["sglang-watchdog.json"])) {
					t.Errorf("ConfigMap %s: the dashboard is not valid JSON", cm.Name)
				}
				dashboards++
			}
			if (dashboards == 1) != c.dashboard || dashboards > 1 {
				t.Errorf("%d dashboard ConfigMaps, want dashboard=%v", dashboards, c.dashboard)
			}

			checkHelmTest(t, o.pods, o.services, c.podMonitors)

			// The token Secret, created only when a role uses the plugin and
			// no existing Secret is named.
			switch {
			case c.secret == "" && len(o.secrets) != 0:
				t.Errorf("a Secret was created: %s", o.secrets[0].Name)
			case c.secret != "":
				if len(o.secrets) != 1 || o.secrets[0].Name != c.secret {
					t.Fatalf("want the Secret %s, have %d Secrets", c.secret, len(o.secrets))
				}
				if tok := string(o.secrets[0].Data["token"]); tok != ciToken {
					t.Errorf("Secret %s: token %q, want token.value", c.secret, tok)
				}
			}

			// The NetworkPolicy admits Prometheus to the sidecar (9433), the
			// nodes of networkPolicy.probesFrom to the probe port (9434), and
			// keeps SGLang's own ports open.
			if (len(o.networkPolicies) > 0) != c.networkPolicy {
				t.Errorf("%d NetworkPolicies, want networkPolicy=%v", len(o.networkPolicies), c.networkPolicy)
			}
			for _, np := range o.networkPolicies {
				var metrics, probes, api, extra, verdicts bool
				for _, r := range np.Spec.Ingress {
					for _, p := range r.Ports {
						switch p.Port.String() {
						case "9433":
							if len(r.From) == 0 {
								t.Errorf("NetworkPolicy %s opens the sidecar's port to everyone", np.Name)
							}
							for _, f := range r.From {
								if f.NamespaceSelector == nil && f.PodSelector != nil && f.PodSelector.MatchLabels["app.kubernetes.io/component"] == "decode" {
									verdicts = true
								} else {
									metrics = true
								}
							}
						case "9434":
							probes = len(r.From) == 1 && r.From[0].IPBlock != nil
						case "30000":
							api = len(r.From) == 0
						case "15000":
							extra = true
						}
					}
				}
				if !metrics || !probes || !api || !extra {
					t.Errorf("NetworkPolicy %s: metrics from Prometheus only %v, probes from the nodes only %v, SGLang API open %v, extraIngress %v", np.Name, metrics, probes, api, extra)
				}
				// The decode pods reach the prefill pods' watchdog for
				// verdicts, and nothing else gains that port.
				if want := strings.HasSuffix(np.Name, "-prefill"); verdicts != want {
					t.Errorf("NetworkPolicy %s: decode pods admitted to the sidecar port %v, want %v", np.Name, verdicts, want)
				}
			}
		})
	}
}

// TestChartSidecarGolden keeps the rendered sidecar patches of every ci/
// values file in deploy/helm/testdata; the main module's tests parse their
// args with the real flag set (deploy.SidecarArgs). Rewrite them with
// go test -run TestChartSidecarGolden -update.
func TestChartSidecarGolden(t *testing.T) {
	for _, c := range chartCases {
		out, err := helmTemplate(t, "-f", c.values(), "-s", "templates/sidecar-patch.yaml")
		if err != nil {
			t.Fatal(err)
		}
		golden := repoPath(goldenDir + "/sidecar-" + c.name + ".yaml")
		if *update {
			if err := os.MkdirAll(filepath.Dir(golden), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(golden, out, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(golden)
		if err != nil {
			t.Fatalf("%v; write it with: go test -run TestChartSidecarGolden -update", err)
		}
		if !bytes.Equal(out, want) {
			t.Errorf("%s differs from the chart's render; rewrite it with: (cd deploy/verify && go test -run TestChartSidecarGolden -update)", golden)
		}
	}
}

// ruleSpecAs returns spec as the chart renders it with
// prometheusRule.disabledAlerts and additionalRuleLabels: the disabled
// alerts left out, the labels added to every alert under its own.
func ruleSpecAs(spec monitoringv1.PrometheusRuleSpec, disabled []string, labels map[string]string) monitoringv1.PrometheusRuleSpec {
	var out monitoringv1.PrometheusRuleSpec
	for _, g := range spec.Groups {
		var rules []monitoringv1.Rule
		for _, r := range g.Rules {
			if r.Alert != "" && slices.Contains(disabled, r.Alert) {
				continue
			}
			if r.Alert != "" && len(labels) > 0 {
				merged := maps.Clone(labels)
				maps.Copy(merged, r.Labels)
				r.Labels = merged
			}
			rules = append(rules, r)
		}
		if len(rules) > 0 {
			g.Rules = rules
			out.Groups = append(out.Groups, g)
		}
	}
	return out
}

// checkPodMonitorOptions checks podMonitor's scrape settings: scheme https
// with TLS, authorization, an extra relabeling after the job's,
// metricRelabelings and a sample limit (ci/full-values.yaml), or plain HTTP
// with none of them.
func checkPodMonitorOptions(t *testing.T, pm monitoringv1.PodMonitor, tls bool) {
	t.Helper()
	ep := pm.Spec.PodMetricsEndpoints[0]
	scheme := ""
	if ep.Scheme != nil {
		scheme = ep.Scheme.String()
	}
	var limit int64
	if pm.Spec.SampleLimit != nil {
		limit = *pm.Spec.SampleLimit
	}
	if !tls {
		if scheme != "http" || ep.TLSConfig != nil || ep.Authorization != nil || len(ep.RelabelConfigs) != 1 || limit != 0 {
			t.Errorf("%s: scheme %q, TLS %v, authorization %v, %d relabelings, sample limit %d: want the defaults", pm.Name, scheme, ep.TLSConfig != nil, ep.Authorization != nil, len(ep.RelabelConfigs), limit)
		}
		return
	}
	if scheme != "https" || ep.TLSConfig == nil || ep.TLSConfig.CA.Secret == nil || ep.Authorization == nil || ep.Authorization.Credentials == nil {
		t.Errorf("%s: scheme %q, tlsConfig %+v, authorization %+v: want https with a CA and bearer credentials", pm.Name, scheme, ep.TLSConfig, ep.Authorization)
	}
	if len(ep.RelabelConfigs) != 2 || ep.RelabelConfigs[0].TargetLabel != "job" || ep.RelabelConfigs[1].TargetLabel != "node" {
		t.Errorf("%s: relabelings %+v: want the job's, then podMonitor.relabelings", pm.Name, ep.RelabelConfigs)
	}
	if len(ep.MetricRelabelConfigs) != 1 || limit != 2000 {
		t.Errorf("%s: %d metricRelabelings, sample limit %d", pm.Name, len(ep.MetricRelabelConfigs), limit)
	}
}

// checkHelmTest checks the `helm test` Pod: a test hook that runs once and
// asks the sidecar of every enabled role, through that role's Service, which
// selects the role's pods, not-ready ones included, on the sidecar's ports.
func checkHelmTest(t *testing.T, pods []corev1.Pod, services []corev1.Service, roles map[string]string) {
	t.Helper()
	if len(pods) != 1 {
		t.Fatalf("%d Pods, want the helm test's", len(pods))
	}
	p := pods[0]
	if p.Annotations["helm.sh/hook"] != "test" || p.Spec.RestartPolicy != corev1.RestartPolicyNever || len(p.Spec.Containers) != 1 {
		t.Fatalf("Pod %s: hook %q, restartPolicy %q, %d containers: want one container, a test hook that runs once", p.Name, p.Annotations["helm.sh/hook"], p.Spec.RestartPolicy, len(p.Spec.Containers))
	}
	c := p.Spec.Containers[0]
	script := strings.Join(c.Args, " ")
	if c.Resources.Limits.Memory().IsZero() {
		t.Errorf("Pod %s: no memory limit", p.Name)
	}
	if !strings.Contains(script, ":9434/-/healthy") {
		t.Errorf("Pod %s does not ask the sidecars' /-/healthy: %s", p.Name, script)
	}
	if len(services) != len(roles) {
		t.Errorf("%d Services, want one per role (%d)", len(services), len(roles))
	}
	for _, svc := range services {
		role := strings.TrimPrefix(svc.Name, release+"-sglang-watchdog-")
		if _, ok := roles[role]; !ok {
			t.Errorf("Service %s for no role", svc.Name)
			continue
		}
		if !strings.Contains(script, svc.Name+" ") {
			t.Errorf("Pod %s does not ask Service %s", p.Name, svc.Name)
		}
		if svc.Spec.Selector["app.kubernetes.io/component"] != role || !svc.Spec.PublishNotReadyAddresses {
			t.Errorf("Service %s: selector %v, publishNotReadyAddresses %v: want the role's pods, loading ones included", svc.Name, svc.Spec.Selector, svc.Spec.PublishNotReadyAddresses)
		}
	}
}

// TestChartRendersAreStable: the same values give the same objects at every
// render, the token included, as Argo CD and Flux need (they render with
// helm template and apply the difference).
func TestChartRendersAreStable(t *testing.T) {
	for _, c := range chartCases {
		first, err := helmTemplate(t, "-f", c.values())
		if err != nil {
			t.Fatal(err)
		}
		second, err := helmTemplate(t, "-f", c.values())
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(first, second) {
			t.Errorf("%s: two renders differ", c.name)
		}
	}
}

// TestChartWithoutTheOperatorCRDs: on a cluster that does not serve the
// Prometheus Operator's kinds, the chart leaves out the PodMonitors and
// PrometheusRules, which would not apply, and renders the rest.
func TestChartWithoutTheOperatorCRDs(t *testing.T) {
	out, err := helmTemplateFor(t, nil, "-f", chartCases[0].values())
	if err != nil {
		t.Fatal(err)
	}
	docs, err := splitDocs("no CRDs", out)
	if err != nil {
		t.Fatal(err)
	}
	o := decodeAll(t, docs)
	if len(o.podMonitors)+len(o.prometheusRules) != 0 || len(o.deployments) == 0 || len(o.secrets) != 1 || len(o.configMaps) != 2 {
		t.Errorf("without the CRDs: %d PodMonitors, %d PrometheusRules (want none), %d patches, %d Secrets, %d ConfigMaps",
			len(o.podMonitors), len(o.prometheusRules), len(o.deployments), len(o.secrets), len(o.configMaps))
	}
}

func TestChartRejectsBadValues(t *testing.T) {
	dir := t.TempDir()
	// Each case over the ci defaults, which set the token (but for "no token").
	for name, tc := range map[string]struct{ values, want string }{
		// values.schema.json catches these before the templates do.
		"bare off":    {"roles:\n  decode:\n    forceFailMode: off\n", `/roles/decode/forceFailMode': value must be one of 'off', 'dry-run', 'auto'`},
		"typo":        {"roles:\n  prefill:\n    forceFailMode: dryrun\n", `/roles/prefill/forceFailMode': value must be one of`},
		"unknown key": {"podMonitor:\n  intervall: 30s\n", `intervall`},
		"positional":  {"sidecar:\n  extraArgs: [--watchdog.deadline, 90s]\n", `/sidecar/extraArgs/0`},
		"no selector": {"roles:\n  decode:\n    podSelector: null\n", `missing property 'podSelector'`},
		"auto without plugin": {
			"roles:\n  decode:\n    forceFailMode: auto\n    plugin:\n      enabled: false\n", "forceFailMode auto needs the plugin",
		},
		"ranks of before":                    {"roles:\n  decode:\n    plugin:\n      ranks: 4\n", "roles.decode.plugin.ranks is gone: describe the instance in roles.decode.topology"},
		"nodes of a Deployment":              {"roles:\n  decode:\n    topology:\n      nnodes: 2\n      tpSize: 16\n      dpSize: 1\n", "a Deployment runs one pod per instance"},
		"nodes that do not divide":           {"roles:\n  decode:\n    workloadKind: LeaderWorkerSet\n    topology:\n      nnodes: 3\n      tpSize: 16\n      dpSize: 1\n", "nnodes 3 does not divide tpSize * ppSize (16)"},
		"multi-node DP without DP attention": {"roles:\n  decode:\n    workloadKind: RoleBasedGroup\n    topology:\n      nnodes: 2\n      tpSize: 16\n      dpSize: 2\n", "SGLang refuses multi-node data parallelism without DP attention"},
		"a flag the chart sets":              {"roles:\n  decode:\n    extraArgs: [--sglang.metrics-url=off]\n", "--sglang.metrics-url is set by the chart"},
		"a limit below the rooms":            {"sidecar:\n  resources:\n    limits:\n      memory: 64Mi\n", "limits.memory 64Mi is below what 100000 rooms take"},
		"a limit in bytes":                   {"sidecar:\n  resources:\n    limits:\n      memory: \"300000000\"\n", "give it in Mi or Gi"},
		"one port for both":                  {"sidecar:\n  probePort: 9433\n", "sidecar.probePort and sidecar.port are both 9433"},
		"no mode":                            {"roles:\n  decode:\n    mode: null\n", `missing property 'mode'`},
		"verdicts without networks": {
			"roles:\n  decode:\n    prefillWatchdog:\n      enabled: true\n", "prefillWatchdog.networks is empty",
		},
		"verdicts from everywhere": {
			"roles:\n  decode:\n    prefillWatchdog:\n      enabled: true\n      networks: [0.0.0.0/0]\n", "networks has 0.0.0.0/0",
		},
		"verdicts from no prefill": {
			"roles:\n  prefill:\n    enabled: false\n  decode:\n    prefillWatchdog:\n      enabled: true\n      networks: [10.0.0.0/8]\n", `prefillWatchdog.role "prefill" is not an enabled prefill role`,
		},
		"verdicts on prefill": {
			"roles:\n  prefill:\n    prefillWatchdog:\n      enabled: true\n      networks: [10.0.0.0/8]\n", "prefillWatchdog is for decode roles",
		},
		"unknown rule file": {"prometheusRule:\n  ruleFiles:\n    watchdgo: true\n", "the chart has no files/rules/watchdgo.rules.yml"},
		// Never a token made up per render: GitOps renders again at every sync.
		"no token":              {"token:\n  value: \"\"\n", "the plugin token is not set"},
		"unknown alert":         {"prometheusRule:\n  disabledAlerts: [SGLangWatchdogAbsnet]\n", "no enabled rule file has an alert SGLangWatchdogAbsnet"},
		"host network guard":    {"hostNetwork: true\nnetworkPolicy:\n  enabled: true\n", "a NetworkPolicy does not apply to pods on the node's network"},
		"interval of two units": {"restart:\n  minInterval: 1h30m\n", "/restart/minInterval"},
	} {
		f := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		if err := os.WriteFile(f, []byte(tc.values), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := helmTemplate(t, "-f", chartCases[0].values(), "-f", f)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: helm template error %v, want one containing %q", name, err, tc.want)
		}
	}
}

// TestChartPatchAppliesLikeKubectl applies each rendered sidecar patch the
// way `kubectl patch --type=strategic` does to a plain SGLang Deployment
// with settings of its own (an SGLANG_PLUGINS whitelist, another variable,
// a service account whose token it mounts, a pull secret): the result runs
// the sidecar and the plugin's settings, and keeps every one of them.
func TestChartPatchAppliesLikeKubectl(t *testing.T) {
	out, err := helmTemplate(t, "-f", chartCases[0].values(), "--set", "fullnameOverride=sglang-watchdog", "-s", "templates/sidecar-patch.yaml",
		"--set", "imagePullSecrets[0].name=regcred")
	if err != nil {
		t.Fatal(err)
	}
	docs, err := splitDocs("chart", out)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		role := strings.TrimPrefix(d.name, "sglang-")
		got := patchPlainSGLang(t, role, d.json)
		checkSidecar(t, "patched "+d.name, got.Spec.Template.Spec, sidecarWant{mode: "dry-run", ports: []int{28100, 28101}, secretName: "sglang-watchdog-plugin-token"})
		checkKeepsWorkloadSettings(t, "patched "+d.name, got)
	}
}

// plainSGLangWithOwnSettings returns the SGLang Deployment of
// deploy/kubernetes without the watchdog, given settings of its own that a
// patch must keep (checkKeepsWorkloadSettings).
func plainSGLangWithOwnSettings(t *testing.T, role string) appsv1.Deployment {
	t.Helper()
	plain := plainSGLang(manifestDeployment(t, role))
	spec := &plain.Spec.Template.Spec
	// The token mounted, against the manifests' false: a patch that sets
	// either value shows.
	yes := true
	spec.AutomountServiceAccountToken = &yes
	spec.ServiceAccountName = "sglang"
	spec.ImagePullSecrets = []corev1.LocalObjectReference{{Name: "sglang-registry"}}
	spec.Containers[0].Env = append(spec.Containers[0].Env,
		corev1.EnvVar{Name: "SGLANG_PLUGINS", Value: "my_plugin,sglang_watchdog"}, corev1.EnvVar{Name: "HF_HOME", Value: "/models"})
	return plain
}

// patchPlainSGLang applies a strategic merge patch, as kubectl does, to
// plainSGLangWithOwnSettings.
func patchPlainSGLang(t *testing.T, role string, patch []byte) appsv1.Deployment {
	t.Helper()
	original, err := json.Marshal(plainSGLangWithOwnSettings(t, role))
	if err != nil {
		t.Fatal(err)
	}
	merged, err := strategicpatch.StrategicMergePatch(original, patch, appsv1.Deployment{})
	if err != nil {
		t.Fatalf("%s: %v", role, err)
	}
	var got appsv1.Deployment
	if err := json.Unmarshal(merged, &got); err != nil {
		t.Fatal(err)
	}
	return got
}

// checkKeepsWorkloadSettings checks what plainSGLangWithOwnSettings gave
// the Deployment is still there after the patch.
func checkKeepsWorkloadSettings(t *testing.T, name string, d appsv1.Deployment) {
	t.Helper()
	spec := d.Spec.Template.Spec
	if spec.AutomountServiceAccountToken == nil || !*spec.AutomountServiceAccountToken || spec.ServiceAccountName != "sglang" {
		t.Errorf("%s: the workload's service-account settings changed: automount %v, account %q", name, spec.AutomountServiceAccountToken, spec.ServiceAccountName)
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("%s: %d containers; the patch added one (a wrong sglangContainer?)", name, len(spec.Containers))
	}
	c := spec.Containers[0]
	if !hasEnv(c, "SGLANG_PLUGINS", "my_plugin,sglang_watchdog") || !hasEnv(c, "HF_HOME", "/models") {
		t.Errorf("%s: the workload's own env was overwritten: %+v", name, c.Env)
	}
	if c.Image == "" || len(c.Args) == 0 {
		t.Errorf("%s: SGLang's container lost its image or args", name)
	}
	if !slices.Contains(spec.ImagePullSecrets, corev1.LocalObjectReference{Name: "sglang-registry"}) {
		t.Errorf("%s: the workload's pull secrets were replaced: %v", name, spec.ImagePullSecrets)
	}
}

// checkModeConfigMap checks the mode ConfigMap: one key per role, its
// forceFailMode, and no annotation a pod template could follow.
func checkModeConfigMap(t *testing.T, cm corev1.ConfigMap, roles map[string]sidecarWant) {
	t.Helper()
	want := map[string]string{}
	for workload, w := range roles {
		want[strings.TrimPrefix(strings.TrimPrefix(workload, "sglang-"), "big-")] = w.mode
	}
	if !reflect.DeepEqual(cm.Data, want) {
		t.Errorf("ConfigMap %s: %v, want each role's mode %v", cm.Name, cm.Data, want)
	}
}

// checkModeFile checks that a role's sidecar reads its key of the mode
// ConfigMap, mounted optional (a pod starts without it) and read-only.
func checkModeFile(t *testing.T, name string, spec corev1.PodSpec, role string) {
	t.Helper()
	c, _ := findSidecar(t, name, spec)
	files := flagValues(c.Args, "force-fail.mode-file")
	if len(files) != 1 {
		t.Fatalf("%s: --force-fail.mode-file %q, want one", name, files)
	}
	var vol *corev1.Volume
	for i, v := range spec.Volumes {
		if v.ConfigMap != nil && v.ConfigMap.Name == release+"-sglang-watchdog-mode" {
			vol = &spec.Volumes[i]
		}
	}
	if vol == nil || vol.ConfigMap.Optional == nil || !*vol.ConfigMap.Optional || len(vol.ConfigMap.Items) != 1 || vol.ConfigMap.Items[0].Key != role {
		t.Fatalf("%s: no optional volume of the mode ConfigMap's key %s: %+v", name, role, vol)
	}
	for _, m := range c.VolumeMounts {
		if m.Name == vol.Name && m.ReadOnly && path.Join(m.MountPath, vol.ConfigMap.Items[0].Path) == files[0] {
			return
		}
	}
	t.Errorf("%s: --force-fail.mode-file=%s is not the mode ConfigMap's key mounted read-only", name, files[0])
}
