#!/usr/bin/env bash
# Installs the packaging and release tools the tests use (called by
# scripts/deps.sh; safe to run again):
#   - helm and promu, built from the Go module proxy into a cache keyed by
#     version, so a second run (and a second CI run on the same machine)
#     reuses them: ${XDG_CACHE_HOME:-$HOME/.cache}/sglang-watchdog/bin/<tool>-<version>/
#   - Debian's python3-build, python3-wheel and python3-setuptools, which build
#     the plugin's wheel offline.
# scripts/release-tools.sh prints where the tools are; the tests find them
# the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/release-tools.sh
source scripts/release-tools.sh

build_tool() { # name version package [ldflags]
	local name=$1 version=$2 pkg=$3 ldflags=${4:-}
	local bin
	bin="$(tool_path "${name}" "${version}")"
	if [ -x "${bin}" ]; then
		return
	fi
	echo "deps-release: building ${name} ${version} into ${bin%/*}" >&2
	local start tmp
	start=$(date +%s)
	tmp="$(mktemp -d)"
	# A throwaway module pins the exact version: `go install pkg@version`
	# would also ask the proxy for the module's version list, which it may
	# refuse.
	(
		cd "${tmp}"
		go mod init "build-${name}" >/dev/null 2>&1
		go get "${pkg}@${version}" >/dev/null 2>&1 || go get "${pkg}@${version}"
		CGO_ENABLED=0 go build -trimpath -ldflags "-s -w ${ldflags}" -o "${bin}.tmp" "${pkg}"
	)
	rm -rf "${tmp}"
	mv "${bin}.tmp" "${bin}"
	echo "deps-release: ${name} ${version} built in $(($(date +%s) - start)) s" >&2
}

mkdir -p "$(dirname "$(tool_path helm "${HELM_VERSION}")")" "$(dirname "$(tool_path promu "${PROMU_VERSION}")")"
# What helm's Makefile stamps: its version, and the Kubernetes version of its
# client libraries, which `helm template` and `helm lint` assume (an unstamped
# build assumes 1.20 and refuses the chart's kubeVersion).
build_tool helm "${HELM_VERSION}" helm.sh/helm/v3/cmd/helm \
	"-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} \
	 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=${HELM_K8S_MINOR} \
	 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${HELM_K8S_MINOR}"
build_tool promu "${PROMU_VERSION}" github.com/prometheus/promu

# Debian's own interpreter: another python3 first on PATH (pyenv) does not
# see Debian's packages.
if ! "${DEB_PYTHON}" -c 'import build, wheel, setuptools' >/dev/null 2>&1; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "deps-release: ${DEB_PYTHON} lacks build/wheel/setuptools; install python3-build python3-wheel python3-setuptools with apt-get as root" >&2
		exit 1
	fi
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends python3-build python3-wheel python3-setuptools python3-venv >/dev/null
fi

# The Go module of the packaging tests (helm, kustomize, prometheus-operator
# types) is separate from the main one: fetch its modules too.
(cd deploy/verify && go mod download)
