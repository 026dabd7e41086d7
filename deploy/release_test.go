package deploy

import (
	"archive/zip"
	"bytes"
	"debug/buildinfo"
	"debug/elf"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/alerts"
)

func readRepo(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, filepath.FromSlash(rel)))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// releaseVersion is the VERSION file's content.
func releaseVersion(t *testing.T) string {
	t.Helper()
	v := strings.TrimSpace(readRepo(t, "VERSION"))
	if !regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$`).MatchString(v) {
		t.Fatalf("VERSION holds %q, want a semantic version without a leading v", v)
	}
	return v
}

// releaseRepoPath is .promu.yml's repository.path: github.com/<owner>/<name>.
func releaseRepoPath(t *testing.T) string {
	t.Helper()
	var promu struct {
		Repository struct {
			Path string `yaml:"path"`
		} `yaml:"repository"`
	}
	if err := yaml.Unmarshal([]byte(readRepo(t, ".promu.yml")), &promu); err != nil {
		t.Fatal(err)
	}
	owner, ok := strings.CutPrefix(promu.Repository.Path, "github.com/")
	if !ok || strings.Count(owner, "/") != 1 {
		t.Fatalf(".promu.yml: repository.path %q, want github.com/<owner>/<name>", promu.Repository.Path)
	}
	return promu.Repository.Path
}

// releaseImage is the image repository a release publishes:
// ghcr.io/<owner>/<name> of .promu.yml's repository.path.
func releaseImage(t *testing.T) string {
	t.Helper()
	return "ghcr.io/" + strings.TrimPrefix(releaseRepoPath(t), "github.com/")
}

// TestReleaseNamesAgree keeps every place that names the release in step
// with VERSION and .promu.yml: the image of the manifests, the chart, the
// kustomize component and the examples; the chart's versions; the plugin's
// version; the changelog.
func TestReleaseNamesAgree(t *testing.T) {
	version, repo := releaseVersion(t), releaseImage(t)
	want := repo + ":v" + version

	imageLine := regexp.MustCompile(`(?m)^\s*(?:-\s*)?image:\s*"?([^"\s]+)"?\s*$`)
	var seen int
	err := filepath.WalkDir(repoRoot+"/deploy", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".yaml") {
			return err
		}
		if strings.Contains(filepath.ToSlash(p), "/helm/testdata/") {
			return nil // renders, checked by deploy/verify
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range imageLine.FindAllStringSubmatch(string(b), -1) {
			if strings.Contains(m[1], "sglang-watchdog/sglang-watchdog") {
				seen++
				if m[1] != want {
					t.Errorf("%s: image %s, want %s (VERSION and .promu.yml)", p, m[1], want)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen < 6 {
		t.Errorf("found %d watchdog images under deploy/, want the manifests, the component and the examples", seen)
	}

	var chart struct {
		Version    string `yaml:"version"`
		AppVersion string `yaml:"appVersion"`
	}
	if err := yaml.Unmarshal([]byte(readRepo(t, "deploy/helm/sglang-watchdog/Chart.yaml")), &chart); err != nil {
		t.Fatal(err)
	}
	if chart.Version != version || chart.AppVersion != version {
		t.Errorf("Chart.yaml: version %q, appVersion %q; want both %s (VERSION)", chart.Version, chart.AppVersion, version)
	}
	var values struct {
		Image struct {
			Repository string `yaml:"repository"`
			Tag        string `yaml:"tag"`
		} `yaml:"image"`
	}
	if err := yaml.Unmarshal([]byte(readRepo(t, "deploy/helm/sglang-watchdog/values.yaml")), &values); err != nil {
		t.Fatal(err)
	}
	if values.Image.Repository != repo || values.Image.Tag != "" {
		t.Errorf("chart values: image %s:%s, want %s with the tag left to v<appVersion>", values.Image.Repository, values.Image.Tag, repo)
	}

	if m := regexp.MustCompile(`(?m)^version = "([^"]+)"$`).FindStringSubmatch(readRepo(t, "sglang_plugin/pyproject.toml")); m == nil || m[1] != version {
		t.Errorf("sglang_plugin/pyproject.toml: version %v, want %s (VERSION)", m, version)
	}
	changelog := readRepo(t, "CHANGELOG.md")
	if !strings.Contains(changelog, "\n## "+version+" ") && !strings.Contains(changelog, "\n## "+version+"\n") {
		t.Errorf("CHANGELOG.md has no entry \"## %s\"", version)
	}
	if !strings.Contains(changelog, "\n## Unreleased\n") {
		t.Error("CHANGELOG.md has no \"## Unreleased\" section")
	}

	// Runbook links name the release's tag, so that an alert links to the
	// runbook of the rules that raised it. alerts.RunbookBaseURL is checked
	// against the mixin's runbookURLPattern (mixin), the rendered rules
	// (alerts) and, through them, the promtool tests and deploy/'s copies.
	if want := "https://" + releaseRepoPath(t) + "/blob/v" + version + "/docs/runbook.md"; alerts.RunbookBaseURL != want {
		t.Errorf("alerts.RunbookBaseURL is %s, want %s (VERSION): change alerts/files.go, mixin/config.libsonnet and alerts/*_test.yml, then make generate", alerts.RunbookBaseURL, want)
	}
}

// versionScript runs scripts/version.sh copied into dir (a scratch
// repository) and returns its output.
func versionScript(t *testing.T, dir string) (string, error) {
	t.Helper()
	out, err := exec.Command("bash", filepath.Join(dir, "scripts", "version.sh")).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func TestVersionScript(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git not found")
	}
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "scripts"), 0o755); err != nil {
		t.Fatal(err)
	}
	script := readRepo(t, "scripts/version.sh")
	write := func(name, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	git := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "tag.gpgSign=false", "-c", "commit.gpgSign=false"}, args...)...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	expect := func(what, want string) {
		t.Helper()
		got, err := versionScript(t, dir)
		if err != nil || got != want {
			t.Errorf("%s: version.sh = %q (%v), want %q", what, got, err, want)
		}
	}
	expectError := func(what, msg string) {
		t.Helper()
		got, err := versionScript(t, dir)
		if err == nil || !strings.Contains(got, msg) {
			t.Errorf("%s: version.sh = %q (%v), want an error containing %q", what, got, err, msg)
		}
	}

	// One string per commit, the VERSION file's, as promu stamps it:
	// whatever the tree's state, only the revision tells commits apart.
	write("scripts/version.sh", script)
	write("VERSION", "0.3.0\n")
	expect("no git", "0.3.0")

	git("init", "-q")
	git("add", ".")
	git("commit", "-q", "-m", "one")
	expect("untagged", "0.3.0")

	git("tag", "v0.3.0")
	expect("release tag", "0.3.0")

	write("VERSION", "0.3.0 \n") // a tracked change
	expect("dirty tree at the tag", "0.3.0")
	git("checkout", "-q", "VERSION")

	write("VERSION", "0.4.0\n")
	git("commit", "-q", "-am", "two")
	git("tag", "v0.5.0")
	expectError("tag and VERSION disagree", "but VERSION says 0.4.0")

	write("VERSION", "v0.4.0\n")
	expectError("leading v", "want a semantic version")
}

// TestReleaseSnapshot builds the release snapshot with promu
// (scripts/release-snapshot.sh) and checks the two binaries: static, for
// the right machine, stamped with VERSION and the git revision, the same
// version line as scripts/build.sh's binary of the same commit (make build,
// CI).
func TestReleaseSnapshot(t *testing.T) {
	if testing.Short() {
		t.Skip("cross-builds the binary twice")
	}
	promu := os.Getenv("PROMU")
	if promu == "" {
		m := regexp.MustCompile(`(?m)^PROMU_VERSION=(\S+)$`).FindStringSubmatch(readRepo(t, "scripts/release-tools.sh"))
		if m == nil {
			t.Fatal("scripts/release-tools.sh has no PROMU_VERSION")
		}
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, _ := os.UserHomeDir()
			cache = filepath.Join(home, ".cache")
		}
		promu = filepath.Join(cache, "sglang-watchdog", "bin", "promu-"+m[1], "promu")
	}
	if _, err := os.Stat(promu); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("promu not found at %s; scripts/deps.sh builds it", promu)
		}
		t.Skipf("promu not found at %s; run scripts/deps.sh", promu)
	}
	revision, err := exec.Command("git", "-C", repoRoot, "rev-parse", "HEAD").Output()
	if err != nil {
		t.Skipf("not a git checkout: %v", err)
	}
	version := releaseVersion(t)

	out := t.TempDir()
	cmd := exec.Command("bash", filepath.Join(repoRoot, "scripts", "release-snapshot.sh"), out)
	cmd.Env = append(os.Environ(), "PROMU="+promu)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("release-snapshot.sh: %v\n%s", err, b)
	}
	for arch, machine := range map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64} {
		bin := filepath.Join(out, "linux-"+arch, "sglang-watchdog")
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatalf("linux/%s: %v", arch, err)
		}
		if f.Machine != machine {
			t.Errorf("linux/%s: ELF machine %v", arch, f.Machine)
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
				t.Errorf("linux/%s: dynamically linked", arch)
			}
		}
		f.Close()
		info, err := buildinfo.ReadFile(bin)
		if err != nil {
			t.Fatal(err)
		}
		settings := map[string]string{}
		for _, s := range info.Settings {
			settings[s.Key] = s.Value
		}
		for k, v := range map[string]string{"GOOS": "linux", "GOARCH": arch, "CGO_ENABLED": "0", "-trimpath": "true"} {
			if settings[k] != v {
				t.Errorf("linux/%s: build setting %s=%q, want %q", arch, k, settings[k], v)
			}
		}
		// With -trimpath the build info leaves out -ldflags, so look for the
		// stamped values themselves (--version below shows them in place on
		// the host's architecture).
		data, err := os.ReadFile(bin)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{strings.TrimSpace(string(revision)), version} {
			if !bytes.Contains(data, []byte(want)) {
				t.Errorf("linux/%s: the binary does not carry the stamped %q", arch, want)
			}
		}
		if arch == runtime.GOARCH && runtime.GOOS == "linux" {
			v, err := exec.Command(bin, "--version").CombinedOutput()
			if err != nil || !strings.Contains(string(v), "version "+version+" ") || !strings.Contains(string(v), "revision: "+strings.TrimSpace(string(revision))) {
				t.Errorf("linux/%s --version: %v\n%s", arch, err, v)
			}
			dev := filepath.Join(out, "build.sh", "sglang-watchdog")
			if b, err := exec.Command("bash", filepath.Join(repoRoot, "scripts", "build.sh"), dev).CombinedOutput(); err != nil {
				t.Fatalf("build.sh: %v\n%s", err, b)
			}
			d, err := exec.Command(dev, "--version").CombinedOutput()
			if first := func(b []byte) string { return strings.SplitN(string(b), "\n", 2)[0] }; err != nil || first(d) != first(v) {
				t.Errorf("build.sh's binary says %q (%v), promu's %q: one version string per commit", first(d), err, first(v))
			}
		}
	}
}

// TestPluginWheel builds the plugin's wheel offline with Debian's
// python3-build (scripts/deps-release.sh installs it) and checks that it
// holds the package, the sglang.srt.plugins entry point and the .pth loader
// at the root of site-packages.
func TestPluginWheel(t *testing.T) {
	const python = "/usr/bin/python3" // Debian's, which python3-build belongs to
	if err := exec.Command(python, "-c", "import build, wheel, setuptools").Run(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s cannot import build, wheel and setuptools (%v); scripts/deps.sh installs them", python, err)
		}
		t.Skipf("%s cannot import build, wheel and setuptools; run scripts/deps.sh", python)
	}
	// Build from a copy: setuptools writes build/ and *.egg-info next to
	// the sources.
	src := filepath.Join(t.TempDir(), "sglang_plugin")
	plugin := filepath.Join(repoRoot, "sglang_plugin")
	err := filepath.WalkDir(plugin, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(plugin, p)
		if d.IsDir() {
			if d.Name() == "__pycache__" || d.Name() == "build" || strings.HasSuffix(d.Name(), ".egg-info") {
				return filepath.SkipDir
			}
			return os.MkdirAll(filepath.Join(src, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(src, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	dist := t.TempDir()
	cmd := exec.Command(python, "-m", "build", "--no-isolation", "--wheel", "--outdir", dist, src)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("python3 -m build: %v\n%s", err, out)
	}
	wheels, _ := filepath.Glob(filepath.Join(dist, "*.whl"))
	if len(wheels) != 1 {
		t.Fatalf("want one wheel, have %q", wheels)
	}
	version := releaseVersion(t)
	if want := "sglang_watchdog_plugin-" + version + "-py3-none-any.whl"; filepath.Base(wheels[0]) != want {
		t.Errorf("wheel %s, want %s", filepath.Base(wheels[0]), want)
	}
	z, err := zip.OpenReader(wheels[0])
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	files := map[string]string{}
	for _, f := range z.File {
		r, err := f.Open()
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(r)
		r.Close()
		if err != nil {
			t.Fatal(err)
		}
		files[f.Name] = string(b)
	}
	distInfo := "sglang_watchdog_plugin-" + version + ".dist-info/"
	pth, err := os.ReadFile(filepath.Join(plugin, "sglang_watchdog_plugin.pth"))
	if err != nil {
		t.Fatal(err)
	}
	if files["sglang_watchdog_plugin.pth"] != string(pth) {
		t.Error("the wheel lacks sglang_watchdog_plugin.pth at its root (site-packages), or it differs from the source")
	}
	modules, _ := filepath.Glob(filepath.Join(plugin, "sglang_watchdog_plugin", "*.py"))
	if len(modules) == 0 {
		t.Fatal("no plugin modules found")
	}
	for _, m := range modules {
		if _, ok := files["sglang_watchdog_plugin/"+filepath.Base(m)]; !ok {
			t.Errorf("the wheel lacks sglang_watchdog_plugin/%s", filepath.Base(m))
		}
	}
	for name := range files {
		if strings.HasPrefix(name, "tests/") || strings.Contains(name, "bench_hook") {
			t.Errorf("the wheel ships %s, which is not part of the plugin", name)
		}
	}
	ep := files[distInfo+"entry_points.txt"]
	if !regexp.MustCompile(`(?m)^\[sglang\.srt\.plugins\]\s*\nsglang_watchdog\s*=\s*sglang_watchdog_plugin:register\s*$`).MatchString(ep) {
		t.Errorf("entry_points.txt lacks sglang_watchdog = sglang_watchdog_plugin:register in [sglang.srt.plugins]:\n%s", ep)
	}
	meta := files[distInfo+"METADATA"]
	for _, want := range []string{"Name: sglang-watchdog-plugin", "Version: " + version, "License: Apache-2.0", "Requires-Python: >=3.10"} {
		if !strings.Contains(meta, want+"\n") {
			t.Errorf("METADATA lacks %q", want)
		}
	}
	license, err := os.ReadFile(filepath.Join(repoRoot, "LICENSE"))
	if err != nil {
		t.Fatal(err)
	}
	if files[distInfo+"LICENSE"] != string(license) {
		t.Error("the wheel's .dist-info lacks LICENSE, or it is not the repository's (copy LICENSE to sglang_plugin/)")
	}
	if !strings.Contains(files[distInfo+"RECORD"], "sglang_watchdog_plugin.pth,") {
		t.Error("RECORD does not list the .pth file, so pip would not uninstall it")
	}
}
