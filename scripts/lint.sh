#!/usr/bin/env bash
# The linters, on the main module and on deploy/verify:
#   - gofmt and go vet;
#   - jsonnet-lint on the mixin's sources (mixtool is not served by the Go
#     module proxy: docs/ci.md);
#   - golangci-lint (.golangci.yml), built by scripts/deps-lint.sh;
#   - govulncheck, only with GOVULNDB set to a copy of the Go vulnerability
#     database (file:///...): this project reaches no network beyond the Go
#     module proxy, so without it this says so and goes on (docs/ci.md).
# Usage: scripts/lint.sh [--ci]
#   --ci (scripts/test.sh): golangci-lint on the packages that were clean
#   when it joined CI; without it (make lint), on every package.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/release-tools.sh
source scripts/release-tools.sh

bash scripts/deps-lint.sh --golangci

unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
	echo "gofmt would change: $unformatted" >&2
	exit 1
fi
go vet ./...
(cd deploy/verify && go vet ./...)

find mixin \( -name '*.libsonnet' -o -name '*.jsonnet' \) -print0 | sort -z |
	xargs -0 "$(tool_path jsonnet-lint "${JSONNET_VERSION}")" -J mixin
echo "lint: jsonnet-lint: mixin/ clean" >&2

# Packages with golangci-lint findings from before it ran in CI (docs/ci.md
# lists them): the root package, bench/..., collector, e2e, pluginapi and
# watchdog. CI does not gate on them until they are fixed; make lint does.
# (An import path, then the space before its directory in go list's output.)
ungated='^github.com/sglang-watchdog/sglang-watchdog(/(bench|collector|e2e|pluginapi|watchdog)(/.*)?)? '
pkgs=(./...)
if [ "${1:-}" = "--ci" ]; then
	# golangci-lint takes directories, not import paths.
	mapfile -t pkgs < <(go list -f '{{.ImportPath}} {{.Dir}}' ./... | grep -Ev "${ungated}" | sed "s| ${PWD}| .|; s|^[^ ]* ||")
fi
golangci="$(tool_path golangci-lint "${GOLANGCI_LINT_VERSION}")"
start=$(date +%s)
nice "${golangci}" run "${pkgs[@]}"
(cd deploy/verify && nice "${golangci}" run --config ../../.golangci.yml ./...)
echo "lint: golangci-lint ${GOLANGCI_LINT_VERSION}: clean in $(($(date +%s) - start)) s" >&2

if [ -n "${GOVULNDB:-}" ]; then
	govulncheck="$(tool_path govulncheck "${GOVULNCHECK_VERSION}")"
	"${govulncheck}" -db "${GOVULNDB}" ./...
	(cd deploy/verify && "${govulncheck}" -db "${GOVULNDB}" ./...)
else
	echo "lint: govulncheck skipped: the Go vulnerability database is not reachable from here; set GOVULNDB=file:///path/to/a/copy (docs/ci.md)" >&2
fi
