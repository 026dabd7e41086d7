package deploy

import (
	"bufio"
	"debug/elf"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// repoRoot is the repository root, seen from this package's directory.
const repoRoot = ".."

// instruction is one Dockerfile instruction, continuation lines joined.
type instruction struct {
	line int    // first line, 1-based
	cmd  string // upper case: FROM, RUN, ...
	args string // the rest, trimmed
}

type stage struct {
	from   instruction
	image  string // the base image reference
	name   string // AS name, or ""
	instrs []instruction
}

// parseDockerfile splits a Dockerfile into stages. It handles comments,
// parser directives and backslash continuations, which is all this
// project's Dockerfile uses (no heredocs).
func parseDockerfile(t *testing.T, path string) []stage {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var (
		instrs  []instruction
		cur     strings.Builder
		start   int
		lineNum int
	)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		lineNum++
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") || (trimmed == "" && cur.Len() == 0) {
			continue // comments (also inside continuations) and blank lines
		}
		if cur.Len() == 0 {
			start = lineNum
		}
		if strings.HasSuffix(trimmed, `\`) {
			cur.WriteString(strings.TrimSuffix(trimmed, `\`))
			cur.WriteString(" ")
			continue
		}
		cur.WriteString(trimmed)
		text := strings.TrimSpace(cur.String())
		cur.Reset()
		if text == "" {
			continue
		}
		cmd, args, _ := strings.Cut(text, " ")
		instrs = append(instrs, instruction{line: start, cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args)})
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur.Len() != 0 {
		t.Fatalf("%s: dangling line continuation at the end", path)
	}

	var stages []stage
	for _, in := range instrs {
		if in.cmd == "FROM" {
			var fields []string
			for _, f := range strings.Fields(in.args) {
				if !strings.HasPrefix(f, "--") { // --platform=...
					fields = append(fields, f)
				}
			}
			st := stage{from: in}
			if len(fields) > 0 {
				st.image = fields[0]
			}
			if len(fields) == 3 && strings.EqualFold(fields[1], "AS") {
				st.name = fields[2]
			}
			stages = append(stages, st)
			continue
		}
		if len(stages) == 0 {
			if in.cmd != "ARG" {
				t.Fatalf("%s:%d: %s before the first FROM", path, in.line, in.cmd)
			}
			continue
		}
		stages[len(stages)-1].instrs = append(stages[len(stages)-1].instrs, in)
	}
	return stages
}

func (s stage) find(cmd string) []instruction {
	var out []instruction
	for _, in := range s.instrs {
		if in.cmd == cmd {
			out = append(out, in)
		}
	}
	return out
}

func TestDockerfile(t *testing.T) {
	stages := parseDockerfile(t, filepath.Join(repoRoot, "Dockerfile"))
	if len(stages) != 1 {
		t.Fatalf("want one stage that copies promu's binary, have %d stage(s)", len(stages))
	}
	final := stages[0]

	// No build in the image: the binary is promu's (one stamping path for
	// the release tarballs and the image).
	if runs := final.find("RUN"); len(runs) != 0 {
		t.Errorf("line %d: the image builds nothing; it copies promu's output", runs[0].line)
	}
	args := map[string]bool{}
	for _, in := range final.find("ARG") {
		name, _, _ := strings.Cut(in.args, "=")
		args[name] = true
	}
	if !args["TARGETOS"] || !args["TARGETARCH"] {
		t.Error("the stage must declare ARG TARGETOS and TARGETARCH to pick promu's binary of the platform")
	}

	// Runtime: distroless static on Debian 13, nonroot, promu's binary of
	// the target platform.
	if final.image != "gcr.io/distroless/static-debian13:nonroot" {
		t.Errorf("runtime image %q: want gcr.io/distroless/static-debian13:nonroot", final.image)
	}
	var binPath string
	for _, in := range final.find("COPY") {
		f := strings.Fields(in.args)
		if len(f) == 2 && f[0] == ".build/${TARGETOS}-${TARGETARCH}/sglang-watchdog" {
			binPath = f[1]
		}
	}
	if binPath == "" {
		t.Fatal("the stage does not COPY .build/${TARGETOS}-${TARGETARCH}/sglang-watchdog (promu's layout) <dest>")
	}
	// scripts/release-snapshot.sh writes exactly those platforms.
	snapshot := readRepo(t, "scripts/release-snapshot.sh")
	for _, platform := range []string{"linux/amd64", "linux/arm64"} {
		if !strings.Contains(snapshot, platform) {
			t.Errorf("scripts/release-snapshot.sh does not build %s", platform)
		}
	}

	users := final.find("USER")
	if len(users) == 0 {
		t.Error("runtime stage has no USER")
	} else {
		user := users[len(users)-1].args
		uid, _, _ := strings.Cut(user, ":")
		n, err := strconv.Atoi(uid)
		if err != nil || n == 0 {
			t.Errorf("USER %q: want a numeric non-root uid (Kubernetes runAsNonRoot checks numeric uids)", user)
		}
		if n != 65532 {
			t.Errorf("USER %q: the manifests run the image as 65532 (distroless nonroot)", user)
		}
	}

	var exposed bool
	for _, in := range final.find("EXPOSE") {
		for _, p := range strings.Fields(in.args) {
			if p == "9433" || p == "9433/tcp" {
				exposed = true
			}
		}
	}
	if !exposed {
		t.Error("runtime stage does not EXPOSE 9433")
	}

	eps := final.find("ENTRYPOINT")
	if len(eps) != 1 {
		t.Fatalf("runtime stage needs exactly one ENTRYPOINT, have %d", len(eps))
	}
	var argv []string
	if err := json.Unmarshal([]byte(eps[0].args), &argv); err != nil || len(argv) == 0 {
		t.Fatalf("ENTRYPOINT %s: want exec form (a JSON array): %v", eps[0].args, err)
	}
	if argv[0] != binPath {
		t.Errorf("ENTRYPOINT runs %q, the binary is copied to %q", argv[0], binPath)
	}
	if len(final.find("CMD")) != 0 {
		t.Error("runtime stage has a CMD; the manifests pass every flag as args")
	}

	labels := strings.Join(func() []string {
		var out []string
		for _, in := range final.find("LABEL") {
			out = append(out, in.args)
		}
		return out
	}(), " ")
	for _, l := range []string{"org.opencontainers.image.source", "org.opencontainers.image.version", "org.opencontainers.image.revision"} {
		if !strings.Contains(labels, l) {
			t.Errorf("runtime stage lacks the OCI label %s", l)
		}
	}
}

// TestDockerignoreKeepsOnlyTheBinaries: the build context is promu's
// binaries and LICENSE, which the Dockerfile copies, and nothing else.
func TestDockerignoreKeepsOnlyTheBinaries(t *testing.T) {
	var lines []string
	for _, line := range strings.Split(readRepo(t, ".dockerignore"), "\n") {
		if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
			lines = append(lines, l)
		}
	}
	want := []string{"*", "!.build/linux-*/sglang-watchdog", "!LICENSE"}
	if strings.Join(lines, "\n") != strings.Join(want, "\n") {
		t.Errorf(".dockerignore patterns %q, want %q", lines, want)
	}
}

func TestBuildScriptDisablesCGO(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "scripts", "build.sh"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "github.com/prometheus/common/version"} {
		if !strings.Contains(s, want) {
			t.Errorf("scripts/build.sh lacks %q", want)
		}
	}
	for _, v := range []string{"Version", "Revision", "Branch", "BuildUser", "BuildDate"} {
		if !strings.Contains(s, ".version."+v) && !strings.Contains(s, "}."+v+"=") {
			t.Errorf("scripts/build.sh does not stamp version.%s", v)
		}
	}
}

// TestBuildScriptBuildsStaticStampedBinary runs scripts/build.sh like CI and
// the Dockerfile do, then checks the binary it made.
func TestBuildScriptBuildsStaticStampedBinary(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("checks a Linux ELF binary")
	}
	if matches, _ := filepath.Glob(filepath.Join(repoRoot, "*.go")); len(matches) == 0 {
		t.Skip("the main package (repository root) has no Go files yet")
	}
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("bash not found")
	}
	bin := filepath.Join(t.TempDir(), "sglang-watchdog")
	const (
		version  = "0.0.0-deploytest"
		revision = "0123456789abcdef0123456789abcdef01234567"
		branch   = "deploy-test"
		user     = "deploy-test@localhost"
		date     = "20260102-03:04:05"
	)
	cmd := exec.Command("bash", filepath.Join(repoRoot, "scripts", "build.sh"), bin)
	cmd.Env = append(os.Environ(),
		"VERSION="+version, "REVISION="+revision, "BRANCH="+branch,
		"BUILD_USER="+user, "BUILD_DATE="+date,
		"CGO_ENABLED=1", // the script must turn it off whatever the caller says
	)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("scripts/build.sh: %v\n%s", err, out)
	}

	out, err := exec.Command(bin, "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("%s --version: %v\n%s", bin, err, out)
	}
	for _, want := range []string{"sglang-watchdog", "version " + version, revision, branch, user, date} {
		if !strings.Contains(string(out), want) {
			t.Errorf("--version output lacks %q:\n%s", want, out)
		}
	}

	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		switch p.Type {
		case elf.PT_INTERP:
			t.Error("binary has a PT_INTERP header: it is dynamically linked")
		case elf.PT_DYNAMIC:
			t.Error("binary has a PT_DYNAMIC header: it is dynamically linked")
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		t.Fatal(err)
	}
	if len(libs) != 0 {
		t.Errorf("binary needs shared libraries %q", libs)
	}
}
