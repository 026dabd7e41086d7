#!/usr/bin/env bash
# The linters, on the main module and on deploy/verify:
#   - go mod tidy -diff: go.mod and go.sum say exactly what the code imports;
#   - scripts/check-license.sh (make check_license): no Go file under a
#     licence other than LICENSE's;
#   - gofmt and go vet;
#   - jsonnet-lint on the mixin's sources (mixtool is not served by the Go
#     module proxy: docs/ci.md);
#   - golangci-lint (.golangci.yml) on every package, built by
#     scripts/deps-lint.sh;
#   - govulncheck, only with GOVULNDB set to a copy of the Go vulnerability
#     database (file:///...): this project reaches no network beyond the Go
#     module proxy, so without it this says so and goes on (docs/ci.md).
# Usage: scripts/lint.sh (scripts/test.sh and make lint alike)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/release-tools.sh
source scripts/release-tools.sh

bash scripts/deps-lint.sh --golangci

for module in . deploy/verify; do
	if ! (cd "${module}" && go mod tidy -diff); then
		echo "lint: ${module}/go.mod or go.sum is not tidy: run go mod tidy there" >&2
		exit 1
	fi
done

bash scripts/check-license.sh

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

golangci="$(tool_path golangci-lint "${GOLANGCI_LINT_VERSION}")"
start=$(date +%s)
nice "${golangci}" run ./...
(cd deploy/verify && nice "${golangci}" run --config ../../.golangci.yml ./...)
echo "lint: golangci-lint ${GOLANGCI_LINT_VERSION}: clean in $(($(date +%s) - start)) s" >&2

if [ -n "${GOVULNDB:-}" ]; then
	govulncheck="$(tool_path govulncheck "${GOVULNCHECK_VERSION}")"
	"${govulncheck}" -db "${GOVULNDB}" ./...
	(cd deploy/verify && "${govulncheck}" -db "${GOVULNDB}" ./...)
else
	echo "lint: govulncheck skipped: the Go vulnerability database is not reachable from here; set GOVULNDB=file:///path/to/a/copy (docs/ci.md)" >&2
fi
