package kubernetes

import (
	"fmt"
	"net/netip"
	"net/url"
	"path"
	"reflect"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/sglang-watchdog/sglang-watchdog/deploy/kubernetes/promrule"
	"github.com/sglang-watchdog/sglang-watchdog/loopback"
)

// objects holds every decoded manifest, by kind.
type objects struct {
	deployments     map[string][]appsv1.Deployment // by file
	secrets         map[string][]corev1.Secret     // by directory
	podMonitors     map[string]int                 // by directory: how many
	prometheusRules map[string]int                 // by file: how many
}

func loadAll(t *testing.T) objects {
	t.Helper()
	files, err := manifestFiles()
	if err != nil {
		t.Fatal(err)
	}
	o := objects{
		deployments:     map[string][]appsv1.Deployment{},
		secrets:         map[string][]corev1.Secret{},
		podMonitors:     map[string]int{},
		prometheusRules: map[string]int{},
	}
	for _, f := range files {
		docs, err := documents(f)
		if err != nil {
			t.Fatal(err)
		}
		if len(docs) == 0 {
			t.Errorf("%s: no Kubernetes object", f)
		}
		dir := path.Dir(f)
		for _, d := range docs {
			switch d.APIVersion + " " + d.Kind {
			case "apps/v1 Deployment":
				var obj appsv1.Deployment
				if err := decodeStrict(d, &obj); err != nil {
					t.Fatal(err)
				}
				o.deployments[f] = append(o.deployments[f], obj)
			case "v1 Secret":
				var obj corev1.Secret
				if err := decodeStrict(d, &obj); err != nil {
					t.Fatal(err)
				}
				o.secrets[dir] = append(o.secrets[dir], obj)
			// The operator's objects are decoded strictly into its own
			// monitoring/v1 types, and checked, in the deploy/verify module
			// (TestManifestsMonitoringObjects), which keeps that dependency out
			// of the main module.
			case "monitoring.coreos.com/v1 PodMonitor":
				o.podMonitors[dir]++
			case "monitoring.coreos.com/v1 PrometheusRule":
				o.prometheusRules[f]++
			default:
				t.Errorf("%s: no strict decoder for this kind; add one to the test", d)
			}
		}
	}
	return o
}

func TestStrictDecodingRejectsUnknownFields(t *testing.T) {
	bad := Document{Source: "inline", JSON: []byte(`{"apiVersion":"apps/v1","kind":"Deployment","spec":{"replicas":1,"replica":2}}`)}
	if err := decodeStrict(bad, &appsv1.Deployment{}); err == nil {
		t.Fatal("an unknown field was accepted")
	}
}

func TestManifestsDecodeStrictly(t *testing.T) {
	o := loadAll(t)
	for _, dir := range []string{"prefill", "decode"} {
		if len(o.deployments[dir+"/deployment.yaml"]) != 1 {
			t.Errorf("%s/deployment.yaml: want exactly one Deployment", dir)
		}
		if o.podMonitors[dir] != 1 {
			t.Errorf("%s: want exactly one PodMonitor, have %d", dir, o.podMonitors[dir])
		}
	}
	if len(o.secrets["prefill"]) != 1 {
		t.Errorf("prefill: want the plugin token Secret")
	}
	if len(o.prometheusRules) == 0 {
		t.Errorf("no PrometheusRule under %s/; run %s", promrule.Dir, promrule.Command)
	}
}

// sidecar returns the watchdog container of a Deployment and checks that it
// is a native sidecar.
func sidecar(t *testing.T, name string, dep appsv1.Deployment) corev1.Container {
	t.Helper()
	spec := dep.Spec.Template.Spec
	for _, c := range spec.Containers {
		if c.Name == SidecarName {
			t.Errorf("%s: %s is a regular container; it must be a native sidecar (initContainers, restartPolicy Always)", name, SidecarName)
		}
	}
	var found []corev1.Container
	for _, c := range spec.InitContainers {
		if c.Name == SidecarName {
			found = append(found, c)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%s: want one init container named %s, have %d", name, SidecarName, len(found))
	}
	c := found[0]
	if c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("%s: %s needs restartPolicy: Always to be a native sidecar", name, SidecarName)
	}
	return c
}

// sglangContainer returns the SGLang server container.
func sglangContainer(t *testing.T, name string, dep appsv1.Deployment) corev1.Container {
	t.Helper()
	for _, c := range dep.Spec.Template.Spec.Containers {
		if len(c.Command) >= 3 && c.Command[0] == "python3" && c.Command[2] == "sglang.launch_server" {
			return c
		}
	}
	t.Fatalf("%s: no container runs python3 -m sglang.launch_server", name)
	return corev1.Container{}
}

// flagValues returns the values of --name=value (and --name value) in args.
func flagValues(args []string, name string) []string {
	var out []string
	for i, a := range args {
		switch {
		case strings.HasPrefix(a, "--"+name+"="):
			out = append(out, strings.TrimPrefix(a, "--"+name+"="))
		case a == "--"+name && i+1 < len(args) && !strings.HasPrefix(args[i+1], "--"):
			out = append(out, args[i+1])
		}
	}
	return out
}

func hasFlag(args []string, name string) bool {
	for _, a := range args {
		if a == "--"+name || strings.HasPrefix(a, "--"+name+"=") {
			return true
		}
	}
	return false
}

func oneFlag(t *testing.T, name string, args []string, flag string) string {
	t.Helper()
	v := flagValues(args, flag)
	if len(v) != 1 {
		t.Fatalf("%s: want exactly one --%s, have %q", name, flag, v)
	}
	return v[0]
}

func envValue(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

func namedPort(c corev1.Container, name string) (corev1.ContainerPort, bool) {
	for _, p := range c.Ports {
		if p.Name == name {
			return p, true
		}
	}
	return corev1.ContainerPort{}, false
}

func TestSidecarIsNativeAndLockedDown(t *testing.T) {
	o := loadAll(t)
	for name, deps := range o.deployments {
		for _, dep := range deps {
			spec := dep.Spec.Template.Spec
			c := sidecar(t, name, dep)

			if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
				t.Errorf("%s: automountServiceAccountToken must be false", name)
			}
			if c.Image == "" {
				t.Errorf("%s: sidecar has no image", name)
			}
			if len(c.Command) != 0 {
				t.Errorf("%s: sidecar must not override the image's ENTRYPOINT (command %q)", name, c.Command)
			}

			sc := c.SecurityContext
			if sc == nil {
				t.Fatalf("%s: sidecar has no securityContext", name)
			}
			if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
				t.Errorf("%s: runAsNonRoot must be true", name)
			}
			if sc.RunAsUser == nil || *sc.RunAsUser != 65532 {
				t.Errorf("%s: runAsUser must be 65532 (distroless nonroot)", name)
			}
			if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Errorf("%s: readOnlyRootFilesystem must be true", name)
			}
			if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s: allowPrivilegeEscalation must be false", name)
			}
			if sc.Privileged != nil && *sc.Privileged {
				t.Errorf("%s: sidecar must not be privileged", name)
			}
			if sc.Capabilities == nil || !reflect.DeepEqual(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 {
				t.Errorf("%s: capabilities must drop ALL and add none", name)
			}
			if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Errorf("%s: seccompProfile must be RuntimeDefault", name)
			}

			req, lim := c.Resources.Requests, c.Resources.Limits
			if req.Cpu().IsZero() || req.Memory().IsZero() {
				t.Errorf("%s: sidecar needs explicit cpu and memory requests", name)
			}
			if lim.Memory().IsZero() {
				t.Errorf("%s: sidecar needs a memory limit", name)
			} else if lim.Memory().Cmp(*req.Memory()) < 0 {
				t.Errorf("%s: memory limit below the request", name)
			}

			port, ok := namedPort(c, "metrics")
			if !ok || port.ContainerPort != 9433 {
				t.Errorf("%s: sidecar needs the named port metrics: 9433", name)
			}
			listen := oneFlag(t, name, c.Args, "web.listen-address")
			if !strings.HasSuffix(listen, ":"+strconv.Itoa(int(port.ContainerPort))) {
				t.Errorf("%s: --web.listen-address=%s does not serve the metrics port %d", name, listen, port.ContainerPort)
			}

			probes, ok := namedPort(c, "probes")
			if !ok {
				t.Errorf("%s: sidecar needs the named port probes", name)
			} else if got := oneFlag(t, name, c.Args, "web.probe-listen-address"); !strings.HasSuffix(got, ":"+strconv.Itoa(int(probes.ContainerPort))) {
				t.Errorf("%s: --web.probe-listen-address=%s does not serve the probes port %d", name, got, probes.ContainerPort)
			}
			checkProbes(t, name, c)
		}
	}
}

func checkProbes(t *testing.T, name string, c corev1.Container) {
	t.Helper()
	if p := c.LivenessProbe; p == nil || p.HTTPGet == nil {
		t.Errorf("%s: sidecar needs an HTTP livenessProbe", name)
	} else {
		if p.HTTPGet.Path != "/-/healthy" {
			t.Errorf("%s: sidecar livenessProbe on %q, want /-/healthy", name, p.HTTPGet.Path)
		}
		// The probe listener: --web.config.file must not turn probes into 401s.
		if p.HTTPGet.Port.String() != "probes" {
			t.Errorf("%s: sidecar livenessProbe on port %q, want the named port probes", name, p.HTTPGet.Port.String())
		}
	}
	// A native sidecar's startupProbe holds SGLang's start until it passes:
	// a watchdog that cannot start must not keep SGLang down.
	if c.StartupProbe != nil {
		t.Errorf("%s: sidecar has a startupProbe, which would hold SGLang's start", name)
	}
	// A native sidecar's readiness counts toward Pod Ready: the watchdog must
	// never pull SGLang out of its Service, least of all because SGLang
	// itself is not up yet (/-/ready).
	if c.ReadinessProbe != nil {
		t.Errorf("%s: sidecar must not have a readinessProbe (it would gate the SGLang pod's readiness)", name)
	}
}

// urlFlags are the watchdog flags that take a URL.
var urlFlags = []string{"sglang.metrics-url", "plugin.url"}

func TestSidecarArgsOnlyLoopback(t *testing.T) {
	all, err := SidecarArgs()
	if err != nil {
		t.Fatal(err)
	}
	for name, args := range all {
		if hasFlag(args, "plugin.allow-remote") {
			t.Errorf("%s: --plugin.allow-remote must not be set", name)
		}
		if hasFlag(args, "plugin.token") {
			t.Errorf("%s: tokens are never passed as flag values", name)
		}
		for _, a := range args {
			if !strings.HasPrefix(a, "--") {
				t.Errorf("%s: positional argument %q; use --flag=value", name, a)
			}
			if _, v, ok := strings.Cut(a, "="); ok && strings.Contains(v, "://") && !strings.HasPrefix(a, "--"+verdictURLFlag+"=") {
				if err := loopback.Check(v); err != nil {
					t.Errorf("%s: %s: %v", name, a, err)
				}
			}
		}
		checkVerdictURL(t, name, args)
		for _, f := range urlFlags {
			for _, v := range flagValues(args, f) {
				if err := loopback.Check(v); err != nil {
					t.Errorf("%s: --%s: %v", name, f, err)
				}
			}
		}
	}
}

// verdictURLFlag is the one URL flag that leaves the pod: a decode sidecar
// asks the prefill pods' watchdogs (docs/decode.md).
const verdictURLFlag = "decode.prefill-watchdog-url"

// checkVerdictURL: the prefill verdict URL is a template whose host is a
// request's bootstrap host, and it comes with the prefill pods' networks,
// none of them everything: only those addresses are ever asked.
func checkVerdictURL(t *testing.T, name string, args []string) {
	t.Helper()
	urls := flagValues(args, verdictURLFlag)
	if len(urls) == 0 {
		return
	}
	u, err := url.Parse(strings.Replace(urls[0], "{host}", "host.invalid", 1))
	if len(urls) != 1 || err != nil || u.Hostname() != "host.invalid" || (u.Scheme != "http" && u.Scheme != "https") {
		t.Errorf("%s: --%s %q, want one http(s) URL with {host} as its host", name, verdictURLFlag, urls)
	}
	nets := flagValues(args, "decode.prefill-networks")
	if len(nets) == 0 {
		t.Errorf("%s: --%s without --decode.prefill-networks asks no one", name, verdictURLFlag)
	}
	for _, n := range nets {
		if pfx, err := netip.ParsePrefix(n); err != nil || pfx.Bits() == 0 {
			t.Errorf("%s: --decode.prefill-networks=%s: want a CIDR narrower than everything", name, n)
		}
	}
}

func TestSidecarMatchesSGLang(t *testing.T) {
	o := loadAll(t)
	for name, deps := range o.deployments {
		mode := path.Dir(name) // prefill or decode
		for _, dep := range deps {
			c := sidecar(t, name, dep)
			s := sglangContainer(t, name, dep)

			if got := oneFlag(t, name, s.Args, "disaggregation-mode"); got != mode {
				t.Errorf("%s: SGLang runs --disaggregation-mode=%s in %s/", name, got, mode)
			}
			if !hasFlag(s.Args, "enable-metrics") {
				t.Errorf("%s: SGLang needs --enable-metrics for the watchdog to read /metrics", name)
			}
			apiPort := oneFlag(t, name, s.Args, "port")
			if p, ok := namedPort(s, "http"); !ok || strconv.Itoa(int(p.ContainerPort)) != apiPort {
				t.Errorf("%s: SGLang's --port=%s is not its named port http", name, apiPort)
			}
			mu, err := url.Parse(oneFlag(t, name, c.Args, "sglang.metrics-url"))
			if err != nil {
				t.Fatal(err)
			}
			if mu.Port() != apiPort || mu.Path != "/metrics" {
				t.Errorf("%s: --sglang.metrics-url=%s, SGLang serves /metrics on port %s", name, mu, apiPort)
			}

			// Both roles load the plugin, one --plugin.url per rank, and
			// start in dry-run; restart escalation stays off.
			if mode := oneFlag(t, name, c.Args, "force-fail.mode"); mode != "dry-run" {
				t.Errorf("%s: the example starts in --force-fail.mode=dry-run, have %s", name, mode)
			}
			checkPluginURLs(t, name, s, flagValues(c.Args, "plugin.url"))
			if v := flagValues(c.Args, "restart.mode"); len(v) != 0 && v[0] != "off" {
				t.Errorf("%s: --restart.mode=%s; restarts are opt-in and the manifests keep them off", name, v[0])
			}
			if _, ok := envValue(s, "SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART"); ok {
				t.Errorf("%s: SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART is set; restarts are opt-in and the manifests keep them off", name)
			}
			if dir := path.Dir(name); dir != "prefill" && dir != "decode" {
				t.Errorf("%s: unexpected directory", name)
			}
		}
	}
}

// checkPluginURLs checks one --plugin.url per rank, on 28100 + index
// (docs/plugin-api.md, "Port mapping").
func checkPluginURLs(t *testing.T, name string, s corev1.Container, urls []string) {
	t.Helper()
	// Unset, SGLang's plugin framework loads every installed plugin; set,
	// it is a whitelist the example would impose on the user's plugins.
	if v, ok := envValue(s, "SGLANG_PLUGINS"); ok {
		t.Errorf("%s: SGLANG_PLUGINS=%s restricts SGLang's plugins; leave it unset", name, v)
	}
	if v, ok := envValue(s, "SGLANG_WATCHDOG_PLUGIN_HOST"); ok && v != "127.0.0.1" {
		t.Errorf("%s: the plugin listens on %s; keep it on loopback", name, v)
	}
	base := 28100
	if v, ok := envValue(s, "SGLANG_WATCHDOG_PLUGIN_PORT"); ok {
		var err error
		if base, err = strconv.Atoi(v); err != nil {
			t.Fatalf("%s: SGLANG_WATCHDOG_PLUGIN_PORT=%q", name, v)
		}
	}
	size := func(flag string) int {
		v := flagValues(s.Args, flag)
		if len(v) == 0 {
			return 1
		}
		n, err := strconv.Atoi(v[0])
		if err != nil {
			t.Fatalf("%s: --%s=%q", name, flag, v[0])
		}
		return n
	}
	ranks := size("dp-size") * size("pp-size")
	var want []string
	for i := range ranks {
		want = append(want, fmt.Sprintf("http://127.0.0.1:%d", base+i))
	}
	if !reflect.DeepEqual(urls, want) {
		t.Errorf("%s: --plugin.url %q, want one per rank %q", name, urls, want)
	}
}

func TestTokenSecretMountedInBothContainers(t *testing.T) {
	o := loadAll(t)
	for name, deps := range o.deployments {
		for _, dep := range deps {
			c := sidecar(t, name, dep)
			tokenFile := flagValues(c.Args, "plugin.token-file")
			if len(tokenFile) != 1 || tokenFile[0] != TokenPath {
				t.Errorf("%s: --plugin.token-file=%s, want %s", name, tokenFile[0], TokenPath)
			}
			s := sglangContainer(t, name, dep)
			if v, _ := envValue(s, "SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE"); v != TokenPath {
				t.Errorf("%s: SGLang's SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE=%q, want %s", name, v, TokenPath)
			}

			// The volume that holds the token.
			var vol *corev1.Volume
			for i, v := range dep.Spec.Template.Spec.Volumes {
				if v.Secret != nil {
					vol = &dep.Spec.Template.Spec.Volumes[i]
				}
			}
			if vol == nil {
				t.Fatalf("%s: no Secret volume for the plugin token", name)
			}
			fileName := path.Base(TokenPath)
			var key string
			if len(vol.Secret.Items) == 0 {
				key = fileName
			} else {
				for _, it := range vol.Secret.Items {
					if it.Path == fileName {
						key = it.Key
					}
				}
			}
			if key == "" {
				t.Errorf("%s: Secret volume %s does not project a file %q", name, vol.Name, fileName)
			}
			// One token for both roles: the Secret is prefill/secret.yaml.
			var secret *corev1.Secret
			for i, s := range o.secrets["prefill"] {
				if s.Name == vol.Secret.SecretName {
					secret = &o.secrets["prefill"][i]
				}
			}
			if secret == nil {
				t.Fatalf("%s: Secret %q is not in prefill/", name, vol.Secret.SecretName)
			}
			if secret.StringData[key] == "" && len(secret.Data[key]) == 0 {
				t.Errorf("%s: Secret %s has no value for key %q", name, secret.Name, key)
			}

			for _, ctr := range []corev1.Container{c, s} {
				var mounted bool
				for _, m := range ctr.VolumeMounts {
					if m.Name != vol.Name {
						continue
					}
					mounted = true
					if !m.ReadOnly {
						t.Errorf("%s: %s mounts the token read-write", name, ctr.Name)
					}
					if path.Join(m.MountPath, fileName) != TokenPath || m.SubPath != "" {
						t.Errorf("%s: %s mounts the token at %s (subPath %q), want %s", name, ctr.Name, m.MountPath, m.SubPath, TokenPath)
					}
				}
				if !mounted {
					t.Errorf("%s: %s does not mount the token Secret", name, ctr.Name)
				}
			}
		}
	}
}

func TestPrometheusRulesUpToDate(t *testing.T) {
	want, err := promrule.RenderAll()
	if err != nil {
		t.Fatal(err)
	}
	committed, err := manifestFiles()
	if err != nil {
		t.Fatal(err)
	}
	stale := func(format string, args ...any) {
		t.Helper()
		t.Errorf(format+"; regenerate with: %s", append(args, promrule.Command)...)
	}
	have := map[string]bool{}
	for _, f := range committed {
		if path.Dir(f) == promrule.Dir && strings.HasPrefix(path.Base(f), promrule.FilePrefix) {
			have[f] = true
			if _, ok := want[f]; !ok {
				stale("%s has no rule file in alerts/ any more", f)
			}
		}
	}
	for f, b := range want {
		if !have[f] {
			stale("%s is missing", f)
			continue
		}
		got, err := manifestFS.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != string(b) {
			stale("%s is stale", f)
		}
	}
}

func TestSidecarArgs(t *testing.T) {
	all, err := SidecarArgs()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"prefill/deployment.yaml", "decode/deployment.yaml"} {
		if len(all[f]) == 0 {
			t.Errorf("SidecarArgs has no args for %s", f)
		}
	}
	// The result is a copy.
	all["prefill/deployment.yaml"][0] = "--changed"
	again, err := SidecarArgs()
	if err != nil {
		t.Fatal(err)
	}
	if again["prefill/deployment.yaml"][0] == "--changed" {
		t.Error("SidecarArgs returns shared slices")
	}
}
