package verify

import (
	"errors"
	"fmt"
	"net/netip"
	"path"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/sglang-watchdog/sglang-watchdog/deploy/kubernetes"
	"github.com/sglang-watchdog/sglang-watchdog/internal/memlimit"
	"github.com/sglang-watchdog/sglang-watchdog/loopback"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// sidecarWant is what a pod's watchdog sidecar must run.
type sidecarWant struct {
	mode string // --force-fail.mode
	// ports are the plugin ports the sidecar watches (on a single-node
	// server; multinode_test.go checks the others); none: no plugin.
	ports      []int
	secretName string // token Secret, when there are ports
	image      string
	// restart is --restart.mode; "" wants none (and no
	// SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART in SGLang).
	restart string
	// restartSeconds is SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL when
	// restart is set: the plugin's own floor, the sidecar's interval.
	restartSeconds string
	// verdictURL is --decode.prefill-watchdog-url; "" wants none.
	verdictURL string
	// httpConfigSecret is the Secret of the verdict lookups' HTTP client
	// settings, mounted into the sidecar; "" wants none.
	httpConfigSecret string
}

// findSidecar returns the watchdog container of a pod spec, or false.
func findSidecar(t *testing.T, name string, spec corev1.PodSpec) (corev1.Container, bool) {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == kubernetes.SidecarName {
			t.Errorf("%s: %s is a regular container; it must be a native sidecar", name, c.Name)
		}
	}
	var found []corev1.Container
	for _, c := range spec.InitContainers {
		if c.Name == kubernetes.SidecarName {
			found = append(found, c)
		}
	}
	if len(found) > 1 {
		t.Fatalf("%s: %d %s containers", name, len(found), kubernetes.SidecarName)
	}
	if len(found) == 0 {
		return corev1.Container{}, false
	}
	return found[0], true
}

func flagValues(args []string, name string) []string {
	var out []string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			out = append(out, v)
		}
	}
	return out
}

// checkSidecar checks the watchdog container of a pod spec: a locked-down
// native sidecar whose args match want. Every arg is --flag=value; the
// main module's tests parse the args of the committed renders with the real
// flag set (deploy.SidecarArgs).
func checkSidecar(t *testing.T, name string, spec corev1.PodSpec, want sidecarWant) {
	t.Helper()
	c, ok := findSidecar(t, name, spec)
	if !ok {
		t.Errorf("%s: no %s init container", name, kubernetes.SidecarName)
		return
	}
	if c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("%s: the sidecar needs restartPolicy: Always", name)
	}
	if want.image != "" && c.Image != want.image {
		t.Errorf("%s: image %q, want %q", name, c.Image, want.image)
	}
	if c.ReadinessProbe != nil {
		t.Errorf("%s: the sidecar must not have a readinessProbe (it would gate SGLang's readiness)", name)
	}
	// Probes on the probe listener: --web.config.file must not turn them
	// into TLS handshakes or 401s. A startupProbe is optional: it holds
	// SGLang's start until it passes.
	for kind, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe} {
		if p == nil && kind == "startup" {
			continue
		}
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/-/healthy" || p.HTTPGet.Port.String() != "probes" {
			t.Errorf("%s: the sidecar needs a %s probe on /-/healthy, port probes", name, kind)
		}
	}
	sc := c.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Capabilities == nil ||
		!reflect.DeepEqual(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("%s: the sidecar's securityContext is not locked down: %+v", name, sc)
	}
	if err := checkMemoryLimit(c); err != nil {
		t.Errorf("%s: %v", name, err)
	}
	// The binary gives the Go runtime 90% of the cgroup memory limit
	// (internal/memlimit); a GOMEMLIMIT in the environment would win, and
	// one from limits.memory leaves no headroom before the OOM killer.
	for _, e := range c.Env {
		if e.Name == "GOMEMLIMIT" {
			t.Errorf("%s: the sidecar sets GOMEMLIMIT; the watchdog sets 90%% of its memory limit itself", name)
		}
	}
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	for flag, port := range map[string]string{"web.listen-address": "metrics", "web.probe-listen-address": "probes"} {
		n := ports[port]
		if got := flagValues(c.Args, flag); n == 0 || !reflect.DeepEqual(got, []string{":" + strconv.Itoa(int(n))}) {
			t.Errorf("%s: --%s %q does not serve the named port %s (%d)", name, flag, got, port, n)
		}
	}
	for _, a := range c.Args {
		// A bool flag takes no value: kingpin refuses --flag=true.
		if a == "--sglang.enable-dp-attention" {
			continue
		}
		if !strings.HasPrefix(a, "--") || !strings.Contains(a, "=") {
			t.Errorf("%s: argument %q: use --flag=value", name, a)
		}
		// The verdict URL is the one that leaves the pod: checked below.
		if _, v, _ := strings.Cut(a, "="); strings.Contains(v, "://") && !strings.HasPrefix(a, "--decode.prefill-watchdog-url=") {
			if err := loopback.Check(v); err != nil {
				t.Errorf("%s: %s: %v", name, a, err)
			}
		}
	}
	checkDecodeArgs(t, name, spec, c, want)
	if got := flagValues(c.Args, "force-fail.mode"); !reflect.DeepEqual(got, []string{want.mode}) {
		t.Errorf("%s: --force-fail.mode %q, want %q", name, got, want.mode)
	}
	if got := watchedPorts(t, name, c.Args); !reflect.DeepEqual(got, want.ports) {
		t.Errorf("%s: the sidecar watches plugin ports %v, want %v", name, got, want.ports)
	}
	tokenFile := flagValues(c.Args, "plugin.token-file")
	if len(want.ports) == 0 {
		if len(tokenFile) != 0 {
			t.Errorf("%s: no plugin, yet --plugin.token-file %q", name, tokenFile)
		}
		return
	}
	if !reflect.DeepEqual(tokenFile, []string{kubernetes.TokenPath}) {
		t.Errorf("%s: --plugin.token-file %q, want %s", name, tokenFile, kubernetes.TokenPath)
	}
	checkTokenMount(t, name, spec, c, want.secretName)
}

// checkMemoryLimit checks that the sidecar's memory limit holds every room
// its --watchdog.max-rooms lets it track (memlimit.ForRooms, the rule the
// binary warns by at start): below it, the sidecar is OOM-killed during the
// wedge it is there for.
func checkMemoryLimit(c corev1.Container) error {
	limit := c.Resources.Limits.Memory()
	if limit.IsZero() {
		return errors.New("the sidecar needs a memory limit")
	}
	rooms := watchdog.DefaultMaxRooms
	if v := flagValues(c.Args, "watchdog.max-rooms"); len(v) > 0 {
		n, err := strconv.Atoi(v[len(v)-1])
		if err != nil || n <= 0 {
			return fmt.Errorf("--watchdog.max-rooms=%s: want a positive count", v[len(v)-1])
		}
		rooms = n
	}
	if need := memlimit.ForRooms(rooms); limit.Value() < need {
		return fmt.Errorf("limits.memory %s is below the %d MiB that %d rooms need (memlimit.ForRooms: %d MiB + %d KiB a room)",
			limit, (need+1<<20-1)>>20, rooms, memlimit.BaseBytes>>20, memlimit.RoomBytes>>10)
	}
	return nil
}

// TestMemoryLimitFitsTheRooms: the limit must hold --watchdog.max-rooms
// rooms, the default 100000 when the flag is absent.
func TestMemoryLimitFitsTheRooms(t *testing.T) {
	for _, tc := range []struct {
		limit string
		args  []string
		ok    bool
	}{
		{"", nil, false},
		{"64Mi", nil, false},
		{"227Mi", nil, false},
		{"228Mi", nil, true},
		{"64Mi", []string{"--watchdog.max-rooms=16384"}, true},
		{"64Mi", []string{"--watchdog.max-rooms=16385"}, false},
		{"228Mi", []string{"--watchdog.max-rooms=200000"}, false},
		{"1Gi", []string{"--watchdog.max-rooms=many"}, false},
	} {
		c := corev1.Container{Args: tc.args}
		if tc.limit != "" {
			c.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(tc.limit)}
		}
		if err := checkMemoryLimit(c); (err == nil) != tc.ok {
			t.Errorf("limit %q, args %q: %v, want ok=%v", tc.limit, tc.args, err, tc.ok)
		}
	}
}

// checkTokenMount checks that the token Secret is mounted read-only at the
// token path in the sidecar and in the container that loads the plugin.
func checkTokenMount(t *testing.T, name string, spec corev1.PodSpec, sidecar corev1.Container, secretName string) {
	t.Helper()
	var vol *corev1.Volume
	for i, v := range spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == secretName {
			vol = &spec.Volumes[i]
		}
	}
	if vol == nil {
		t.Errorf("%s: no volume of Secret %q", name, secretName)
		return
	}
	mounted := func(c corev1.Container) bool {
		for _, m := range c.VolumeMounts {
			if m.Name == vol.Name && m.ReadOnly && m.SubPath == "" && m.MountPath+"/token" == kubernetes.TokenPath {
				return true
			}
		}
		return false
	}
	if !mounted(sidecar) {
		t.Errorf("%s: the sidecar does not mount the token read-only at %s", name, kubernetes.TokenPath)
	}
	var plugin int
	for _, c := range spec.Containers {
		if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return strings.HasPrefix(e.Name, "SGLANG_WATCHDOG_PLUGIN_") }) {
			continue
		}
		plugin++
		if !mounted(c) {
			t.Errorf("%s: container %s loads the plugin but does not mount the token", name, c.Name)
		}
		if !hasEnv(c, "SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE", kubernetes.TokenPath) {
			t.Errorf("%s: container %s lacks SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE=%s", name, c.Name, kubernetes.TokenPath)
		}
	}
	if plugin == 0 {
		t.Errorf("%s: the sidecar talks to a plugin, but no container carries the plugin's settings", name)
	}
}

func hasEnv(c corev1.Container, name, value string) bool {
	for _, e := range c.Env {
		if e.Name == name && e.Value == value {
			return true
		}
	}
	return false
}

// checkRestartFloor checks that the container that allows restarts keeps
// the plugin's minimum interval in a directory that outlives it (an
// emptyDir of the pod), set to the interval the sidecar keeps.
func checkRestartFloor(t *testing.T, name string, spec corev1.PodSpec, seconds string) {
	t.Helper()
	emptyDirs := map[string]bool{}
	for _, v := range spec.Volumes {
		if v.EmptyDir != nil {
			emptyDirs[v.Name] = true
		}
	}
	for _, c := range spec.Containers {
		if !hasEnv(c, "SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART", "1") {
			continue
		}
		if !hasEnv(c, "SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL", seconds) {
			t.Errorf("%s: %s lacks SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL=%s", name, c.Name, seconds)
		}
		var dir string
		for _, e := range c.Env {
			if e.Name == "SGLANG_WATCHDOG_PLUGIN_STATE_DIR" {
				dir = e.Value
			}
		}
		kept := false
		for _, m := range c.VolumeMounts {
			if m.MountPath == dir && emptyDirs[m.Name] && !m.ReadOnly {
				kept = true
			}
		}
		if dir == "" || !kept {
			t.Errorf("%s: %s allows restarts, but SGLANG_WATCHDOG_PLUGIN_STATE_DIR %q is not a writable emptyDir mount", name, c.Name, dir)
		}
	}
}

// checkRestartStateFile checks that a sidecar that escalates to restarts
// keeps the time of the last one (--restart.state-file) on a writable
// emptyDir, which outlives the sidecar's own restarts, and that one that
// does not escalate has no state file.
func checkRestartStateFile(t *testing.T, name string, spec corev1.PodSpec, sidecar corev1.Container, restarts bool) {
	t.Helper()
	files := flagValues(sidecar.Args, "restart.state-file")
	if !restarts {
		if len(files) != 0 {
			t.Errorf("%s: --restart.state-file %q without restart escalation", name, files)
		}
		return
	}
	if len(files) != 1 || !path.IsAbs(files[0]) {
		t.Errorf("%s: restart escalation with --restart.state-file %q, want one absolute path", name, files)
		return
	}
	emptyDirs := map[string]bool{}
	for _, v := range spec.Volumes {
		if v.EmptyDir != nil {
			emptyDirs[v.Name] = true
		}
	}
	for _, m := range sidecar.VolumeMounts {
		if m.MountPath == path.Dir(files[0]) && emptyDirs[m.Name] && !m.ReadOnly && m.SubPath == "" {
			return
		}
	}
	t.Errorf("%s: --restart.state-file=%s is not in a writable emptyDir mount of the sidecar", name, files[0])
}

// checkHostNetwork checks a pod on the node's network: hostNetwork with
// the DNS policy that keeps cluster names resolving, or neither.
func checkHostNetwork(t *testing.T, name string, spec corev1.PodSpec, want bool) {
	t.Helper()
	if spec.HostNetwork != want {
		t.Errorf("%s: hostNetwork %v, want %v", name, spec.HostNetwork, want)
	}
	if want && spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("%s: hostNetwork with dnsPolicy %q: cluster DNS names would not resolve (want ClusterFirstWithHostNet)", name, spec.DNSPolicy)
	}
}

// checkDecodeArgs checks the opt-in parts of a sidecar: restart escalation
// on both sides, and a decode sidecar's prefill verdict lookups, which ask
// only inside the prefill networks and carry their client settings.
func checkDecodeArgs(t *testing.T, name string, spec corev1.PodSpec, c corev1.Container, want sidecarWant) {
	t.Helper()
	var restart []string
	if want.restart != "" {
		restart = []string{want.restart}
	}
	if got := flagValues(c.Args, "restart.mode"); !reflect.DeepEqual(got, restart) {
		t.Errorf("%s: --restart.mode %q, want %q", name, got, restart)
	}
	allowed := false
	for _, ctr := range spec.Containers {
		for _, e := range ctr.Env {
			if e.Name == "SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART" {
				allowed = e.Value == "1"
			}
		}
	}
	if allowed != (want.restart != "") {
		t.Errorf("%s: SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=1 is %v, --restart.mode %q: both sides opt in together", name, allowed, want.restart)
	}
	if allowed {
		checkRestartFloor(t, name, spec, want.restartSeconds)
	}
	checkRestartStateFile(t, name, spec, c, want.restart != "")
	var verdict []string
	if want.verdictURL != "" {
		verdict = []string{want.verdictURL}
	}
	if got := flagValues(c.Args, "decode.prefill-watchdog-url"); !reflect.DeepEqual(got, verdict) {
		t.Errorf("%s: --decode.prefill-watchdog-url %q, want %q", name, got, verdict)
	}
	nets := flagValues(c.Args, "decode.prefill-networks")
	if (len(nets) > 0) != (want.verdictURL != "") {
		t.Errorf("%s: --decode.prefill-networks %q with verdict URL %q", name, nets, want.verdictURL)
	}
	for _, n := range nets {
		if pfx, err := netip.ParsePrefix(n); err != nil || pfx.Bits() == 0 {
			t.Errorf("%s: --decode.prefill-networks=%s: want a CIDR narrower than everything", name, n)
		}
	}
	file := flagValues(c.Args, "decode.prefill-watchdog-http-config-file")
	if want.httpConfigSecret == "" {
		if len(file) != 0 {
			t.Errorf("%s: --decode.prefill-watchdog-http-config-file %q, want none", name, file)
		}
		return
	}
	if len(file) != 1 {
		t.Fatalf("%s: want one --decode.prefill-watchdog-http-config-file, have %q", name, file)
	}
	var volume string
	for _, v := range spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == want.httpConfigSecret {
			for _, it := range v.Secret.Items {
				if it.Path == path.Base(file[0]) {
					volume = v.Name
				}
			}
		}
	}
	mounted := false
	for _, m := range c.VolumeMounts {
		if m.Name == volume && m.ReadOnly && path.Join(m.MountPath, path.Base(file[0])) == file[0] {
			mounted = true
		}
	}
	if volume == "" || !mounted {
		t.Errorf("%s: %s is not the Secret %s mounted read-only in the sidecar", name, file[0], want.httpConfigSecret)
	}
}
