#!/usr/bin/env bash
# Builds the sglang-watchdog binary: static (CGO off), -trimpath, with the
# build stamped into github.com/prometheus/common/version.
#
# CI and the Dockerfile both call this script, so the binary that CI tests is
# built exactly like the one in the image.
#
# Usage: scripts/build.sh [OUTPUT]        (default ./sglang-watchdog)
#
# Environment (each optional; an empty value counts as unset):
#   VERSION     default: scripts/version.sh: the VERSION file, as promu
#               stamps it (.promu.yml); the revision tells commits apart
#   REVISION    default: git rev-parse HEAD, else "unknown"
#   BRANCH      default: git rev-parse --abbrev-ref HEAD, else "unknown"
#   BUILD_USER  default: $(id -un)@$(hostname)
#   BUILD_DATE  default: now (or SOURCE_DATE_EPOCH), UTC, as 20060102-15:04:05
#   GOOS, GOARCH, GOFLAGS are passed through to go build (cross builds need no
#   C toolchain because CGO is off).
set -euo pipefail

out="${1:-./sglang-watchdog}"
# The output path is relative to the caller's directory, not the repo root.
case "${out}" in
/*) ;;
*) out="${PWD}/${out}" ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"

git_out() {
	# Quiet: a tree without .git (a Docker build context) or without git
	# falls back to the defaults.
	command -v git >/dev/null 2>&1 || return 1
	git -C "${root}" "$@" 2>/dev/null
}

if [[ -z "${VERSION:-}" ]]; then
	VERSION="$(bash "${root}/scripts/version.sh")"
fi
REVISION="${REVISION:-$(git_out rev-parse HEAD || echo unknown)}"
BRANCH="${BRANCH:-$(git_out rev-parse --abbrev-ref HEAD || echo unknown)}"
BUILD_USER="${BUILD_USER:-$(id -un 2>/dev/null || echo unknown)@$(hostname 2>/dev/null || echo unknown)}"
if [[ -z "${BUILD_DATE:-}" ]]; then
	if [[ -n "${SOURCE_DATE_EPOCH:-}" ]]; then
		BUILD_DATE="$(date -u -d "@${SOURCE_DATE_EPOCH}" +%Y%m%d-%H:%M:%S)"
	else
		BUILD_DATE="$(date -u +%Y%m%d-%H:%M:%S)"
	fi
fi

pkg=github.com/prometheus/common/version
# Each -X value is quoted so that a value with spaces stays one argument
# (go build splits -ldflags with shell-like quoting).
ldflags="-s -w"
ldflags+=" -X '${pkg}.Version=${VERSION}'"
ldflags+=" -X '${pkg}.Revision=${REVISION}'"
ldflags+=" -X '${pkg}.Branch=${BRANCH}'"
ldflags+=" -X '${pkg}.BuildUser=${BUILD_USER}'"
ldflags+=" -X '${pkg}.BuildDate=${BUILD_DATE}'"

echo ">> building ${out} (version ${VERSION}, revision ${REVISION})" >&2
CGO_ENABLED=0 go build -trimpath -ldflags "${ldflags}" -o "${out}" .
