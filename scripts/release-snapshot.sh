#!/usr/bin/env bash
# A release snapshot: static linux/amd64 and linux/arm64 binaries built by
# promu from .promu.yml, stamped with VERSION and the git revision, in
# OUTDIR/<os>-<arch>/sglang-watchdog (promu's .build layout). It runs
# `promu build` once per platform, which is what `promu crossbuild` does
# inside its builder image; CGO is off, so no Docker and no C toolchain.
#
# Usage: scripts/release-snapshot.sh [OUTDIR]     (default .build)
set -euo pipefail
out="${1:-.build}"
case "${out}" in
/*) ;;
*) out="${PWD}/${out}" ;;
esac
cd "$(dirname "$0")/.."
# shellcheck source=scripts/release-tools.sh
source scripts/release-tools.sh
promu="${PROMU:-$(tool_path promu "${PROMU_VERSION}")}"
if [ ! -x "${promu}" ]; then
	echo "release-snapshot: no promu at ${promu}; run scripts/deps.sh" >&2
	exit 1
fi
for platform in linux/amd64 linux/arm64; do
	os="${platform%/*}" arch="${platform#*/}"
	start=$(date +%s)
	GOOS="${os}" GOARCH="${arch}" "${promu}" build --prefix "${out}/${os}-${arch}" >&2
	echo "release-snapshot: ${platform} in $(($(date +%s) - start)) s" >&2
done
