#!/usr/bin/env bash
# Builds the linters from the Go module proxy into the tool cache, once per
# version, like scripts/deps-release.sh (safe to run again; a second run
# takes a second):
#   - govulncheck (golang.org/x/vuln)
#   - jsonnet-lint (github.com/google/go-jsonnet, the version go.mod uses),
#     which `make lint` and scripts/test.sh run on the mixin
#   - golangci-lint, with --golangci (scripts/lint.sh): about 75 s cold on 2
#     cores (docs/ci.md).
# mixtool is not served by the Go module proxy here; docs/ci.md says what
# replaces its lint.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/release-tools.sh
source scripts/release-tools.sh

build_go_tool() { # name version package
	local name=$1 version=$2 pkg=$3
	local bin
	bin="$(tool_path "${name}" "${version}")"
	[ -x "${bin}" ] && return
	echo "deps-lint: building ${name} ${version} into ${bin%/*}" >&2
	local start tmp
	start=$(date +%s)
	tmp="$(mktemp -d)"
	mkdir -p "${bin%/*}"
	# A throwaway module pins the exact version (see scripts/deps-release.sh).
	(
		cd "${tmp}"
		go mod init "build-${name}" >/dev/null 2>&1
		go get "${pkg}@${version}" >/dev/null 2>&1 || go get "${pkg}@${version}"
		CGO_ENABLED=0 nice go build -trimpath -ldflags "-s -w" -o "${bin}.tmp" "${pkg}"
	)
	rm -rf "${tmp}"
	mv "${bin}.tmp" "${bin}"
	echo "deps-lint: ${name} ${version} built in $(($(date +%s) - start)) s" >&2
}

build_go_tool govulncheck "${GOVULNCHECK_VERSION}" golang.org/x/vuln/cmd/govulncheck
build_go_tool jsonnet-lint "${JSONNET_VERSION}" github.com/google/go-jsonnet/cmd/jsonnet-lint
if [ "${1:-}" = "--golangci" ]; then
	build_go_tool golangci-lint "${GOLANGCI_LINT_VERSION}" github.com/golangci/golangci-lint/v2/cmd/golangci-lint
fi
