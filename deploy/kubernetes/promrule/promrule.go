// Package promrule turns the Prometheus rule files of alerts/ into
// prometheus-operator PrometheusRule manifests, one per rule file, for
// deploy/kubernetes/monitoring/.
//
// The manifests are generated and committed; regenerate them with
//
//	go run ./deploy/kubernetes/gen
//
// from the repository root after any change to alerts/*.rules.yml (the same
// command refreshes the Helm chart's copies, see package deploy/helm). A
// test in deploy/kubernetes fails while the committed manifests are stale.
package promrule

import (
	"bytes"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strings"

	"go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/alerts"
)

// Command regenerates the PrometheusRule manifests (run from the repository
// root).
const Command = "go run ./deploy/kubernetes/gen"

// Dir is where the generated manifests live, relative to deploy/kubernetes.
const Dir = "monitoring"

// FilePrefix starts the name of every generated manifest in Dir; files with
// this prefix that the generator does not produce are stale.
const FilePrefix = "prometheusrule-"

// RuleFile is the body of a Prometheus rule file, as far as this project uses
// it. Unknown fields are rejected so that nothing is dropped silently.
type RuleFile struct {
	Groups []RuleGroup `yaml:"groups" json:"groups"`
}

// RuleGroup mirrors a Prometheus rule group and the operator's
// monitoring.coreos.com/v1 RuleGroup (same field names).
type RuleGroup struct {
	Name        string            `yaml:"name" json:"name"`
	Interval    string            `yaml:"interval,omitempty" json:"interval,omitempty"`
	QueryOffset string            `yaml:"query_offset,omitempty" json:"query_offset,omitempty"`
	Limit       *int              `yaml:"limit,omitempty" json:"limit,omitempty"`
	Labels      map[string]string `yaml:"labels,omitempty" json:"labels,omitempty"`
	Rules       []Rule            `yaml:"rules" json:"rules"`
}

// Rule mirrors a Prometheus recording or alerting rule and the operator's
// monitoring.coreos.com/v1 Rule.
type Rule struct {
	Record        string            `yaml:"record,omitempty" json:"record,omitempty"`
	Alert         string            `yaml:"alert,omitempty" json:"alert,omitempty"`
	Expr          string            `yaml:"expr" json:"expr"`
	For           string            `yaml:"for,omitempty" json:"for,omitempty"`
	KeepFiringFor string            `yaml:"keep_firing_for,omitempty" json:"keep_firing_for,omitempty"`
	Labels        map[string]string `yaml:"labels,omitempty" json:"labels,omitempty"`
	Annotations   map[string]string `yaml:"annotations,omitempty" json:"annotations,omitempty"`
}

// PrometheusRule is the minimal monitoring.coreos.com/v1 PrometheusRule this
// project writes.
type PrometheusRule struct {
	APIVersion string     `yaml:"apiVersion" json:"apiVersion"`
	Kind       string     `yaml:"kind" json:"kind"`
	Metadata   ObjectMeta `yaml:"metadata" json:"metadata"`
	Spec       RuleFile   `yaml:"spec" json:"spec"`
}

// ObjectMeta is the part of Kubernetes object metadata the manifests use.
type ObjectMeta struct {
	Name        string            `yaml:"name" json:"name"`
	Namespace   string            `yaml:"namespace,omitempty" json:"namespace,omitempty"`
	Labels      map[string]string `yaml:"labels,omitempty" json:"labels,omitempty"`
	Annotations map[string]string `yaml:"annotations,omitempty" json:"annotations,omitempty"`
}

// Labels carried by every generated PrometheusRule.
var commonLabels = map[string]string{
	"app.kubernetes.io/name":    "sglang-watchdog",
	"app.kubernetes.io/part-of": "sglang-pd",
}

// ParseRuleFile decodes a Prometheus rule file strictly.
func ParseRuleFile(data []byte) (RuleFile, error) {
	var rf RuleFile
	if err := yaml.UnmarshalStrict(data, &rf); err != nil {
		return RuleFile{}, err
	}
	if len(rf.Groups) == 0 {
		return RuleFile{}, fmt.Errorf("no rule groups")
	}
	for _, g := range rf.Groups {
		if g.Name == "" {
			return RuleFile{}, fmt.Errorf("a rule group has no name")
		}
		for i, r := range g.Rules {
			if (r.Alert == "") == (r.Record == "") {
				return RuleFile{}, fmt.Errorf("group %q rule %d: exactly one of alert and record must be set", g.Name, i)
			}
			if strings.TrimSpace(r.Expr) == "" {
				return RuleFile{}, fmt.Errorf("group %q rule %d: empty expr", g.Name, i)
			}
		}
	}
	return rf, nil
}

var nonSlug = regexp.MustCompile(`[^a-z0-9]+`)

// Slug is the part of a rule file's name that names its manifest:
// "watchdog.rules.yml" -> "watchdog", "sglang-raw.rules.yml" -> "sglang-raw".
func Slug(ruleFile string) string {
	base := path.Base(ruleFile)
	for _, ext := range []string{".yml", ".yaml"} {
		base = strings.TrimSuffix(base, ext)
	}
	base = strings.TrimSuffix(base, ".rules")
	return strings.Trim(nonSlug.ReplaceAllString(strings.ToLower(base), "-"), "-")
}

// ManifestPath is where the manifest of a rule file is written, relative to
// deploy/kubernetes.
func ManifestPath(ruleFile string) string {
	return path.Join(Dir, FilePrefix+Slug(ruleFile)+".yaml")
}

// ObjectName is the metadata.name of the PrometheusRule of a rule file.
func ObjectName(ruleFile string) string {
	return "sglang-watchdog-" + Slug(ruleFile)
}

// Build returns the PrometheusRule object for one rule file.
func Build(ruleFile string, data []byte) (PrometheusRule, error) {
	rf, err := ParseRuleFile(data)
	if err != nil {
		return PrometheusRule{}, fmt.Errorf("alerts/%s: %w", ruleFile, err)
	}
	labels := make(map[string]string, len(commonLabels))
	for k, v := range commonLabels {
		labels[k] = v
	}
	return PrometheusRule{
		APIVersion: "monitoring.coreos.com/v1",
		Kind:       "PrometheusRule",
		Metadata:   ObjectMeta{Name: ObjectName(ruleFile), Labels: labels},
		Spec:       rf,
	}, nil
}

// Render returns the manifest of one rule file, header comment included.
func Render(ruleFile string, data []byte) ([]byte, error) {
	obj, err := Build(ruleFile, data)
	if err != nil {
		return nil, err
	}
	body, err := yaml.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Code generated by %s from alerts/%s. DO NOT EDIT.\n", Command, ruleFile)
	b.WriteString("#\n")
	b.WriteString("# The rules of alerts/" + ruleFile + " as a prometheus-operator PrometheusRule.\n")
	b.WriteString("# The Prometheus custom resource selects rules by label: with\n")
	b.WriteString("# kube-prometheus-stack add release: <helm release name> to metadata.labels\n")
	b.WriteString("# (kubectl label or a kustomize patch) if Prometheus ignores this object.\n")
	b.Write(body)
	return b.Bytes(), nil
}

// RuleFiles returns the names of the rule files of alerts/ (as in
// alerts.FS), sorted.
func RuleFiles() ([]string, error) {
	names := alerts.Names()
	if len(names) == 0 {
		return nil, fmt.Errorf("alerts.FS holds no rule files")
	}
	out := append([]string(nil), names...)
	sort.Strings(out)
	return out, nil
}

// ReadRuleFile reads one rule file from alerts.FS.
func ReadRuleFile(name string) ([]byte, error) {
	return fs.ReadFile(alerts.FS, name)
}

// RenderAll returns every generated manifest keyed by its path relative to
// deploy/kubernetes.
func RenderAll() (map[string][]byte, error) {
	names, err := RuleFiles()
	if err != nil {
		return nil, err
	}
	out := make(map[string][]byte, len(names))
	seen := map[string]string{}
	for _, name := range names {
		p := ManifestPath(name)
		if prev, dup := seen[p]; dup {
			return nil, fmt.Errorf("alerts/%s and alerts/%s both map to %s", prev, name, p)
		}
		seen[p] = name
		data, err := ReadRuleFile(name)
		if err != nil {
			return nil, err
		}
		b, err := Render(name, data)
		if err != nil {
			return nil, err
		}
		out[p] = b
	}
	return out, nil
}
