#!/usr/bin/env bash
# Prints the version to stamp into a build (scripts/build.sh calls it).
#
#   - HEAD carries the release tag v<VERSION> and the tree is clean:
#     <VERSION>, e.g. 0.1.0. A release tag v* at HEAD that differs from the
#     VERSION file is an error: the tag and the file must agree.
#   - otherwise: <VERSION>-dev+<short revision>[.dirty], e.g.
#     0.1.0-dev+2a892ad (VERSION names the next release; semver's build
#     metadata after "+" says which commit).
#   - no git (a Docker build context): <VERSION>-dev.
#
# promu (.promu.yml) stamps VERSION as it is, the Prometheus convention; the
# two agree on every release tag.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ ! -s "${root}/VERSION" ]]; then
	echo "version.sh: ${root}/VERSION is missing or empty" >&2
	exit 1
fi
base="$(tr -d ' \t\r\n' <"${root}/VERSION")"
if [[ ! "${base}" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]]; then
	echo "version.sh: VERSION holds \"${base}\", want a semantic version such as 1.2.3 (no leading v)" >&2
	exit 1
fi

git_out() {
	command -v git >/dev/null 2>&1 || return 1
	git -C "${root}" "$@" 2>/dev/null
}

if ! rev="$(git_out rev-parse --short HEAD)"; then
	echo "${base}-dev"
	exit 0
fi
dirty=""
if [[ -n "$(git_out status --porcelain --untracked-files=no || true)" ]]; then
	dirty=".dirty"
fi

tags="$(git_out tag --points-at HEAD --list 'v[0-9]*' || true)"
if [[ -n "${tags}" ]]; then
	if ! grep -qxF "v${base}" <<<"${tags}"; then
		echo "version.sh: HEAD is tagged $(tr '\n' ' ' <<<"${tags}")but VERSION says ${base}; tag v${base} or fix VERSION" >&2
		exit 1
	fi
	if [[ -z "${dirty}" ]]; then
		echo "${base}"
		exit 0
	fi
fi
echo "${base}-dev+${rev}${dirty}"
