# Sourced by scripts/deps-release.sh and scripts/release-snapshot.sh: the
# versions of the packaging tools and where they are cached. The Go tests
# of deploy/ look there too (or at $HELM / $PROMU when set).
HELM_VERSION=v3.22.0
# Minor version of the Kubernetes modules helm v3.22.0 builds with (k8s.io/* v0.37).
HELM_K8S_MINOR=37
PROMU_VERSION=v0.18.0
# Linters (scripts/deps-lint.sh). jsonnet-lint comes from the go-jsonnet
# version go.mod already uses for the mixin.
GOLANGCI_LINT_VERSION=v2.15.0
GOVULNCHECK_VERSION=v1.9.0
JSONNET_VERSION=v0.22.0
# The interpreter that Debian's python3-build belongs to.
DEB_PYTHON=/usr/bin/python3

tool_path() { # name version
	echo "${XDG_CACHE_HOME:-$HOME/.cache}/sglang-watchdog/bin/$1-$2/$1"
}
