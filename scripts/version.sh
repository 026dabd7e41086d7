#!/usr/bin/env bash
# Prints the version every build path stamps (scripts/build.sh for `make
# build` and CI, promu from .promu.yml for the release binaries, the
# tarballs and the image): the VERSION file's content, e.g. 0.1.0, for every
# commit. This is the Prometheus convention: promu reads VERSION as it is,
# and the commit is told apart by the stamped revision (--version shows
# both), so a binary reports the same version and revision whichever path
# built it.
#
# It checks what promu does not: VERSION holds a semantic version without a
# leading v, and a release tag v* at HEAD names that version (the tag and the
# file must agree).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ ! -s "${root}/VERSION" ]]; then
	echo "version.sh: ${root}/VERSION is missing or empty" >&2
	exit 1
fi
version="$(tr -d ' \t\r\n' <"${root}/VERSION")"
if [[ ! "${version}" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]]; then
	echo "version.sh: VERSION holds \"${version}\", want a semantic version such as 1.2.3 (no leading v)" >&2
	exit 1
fi

# Quiet without git or outside a repository (a Docker build context).
tags="$(git -C "${root}" tag --points-at HEAD --list 'v[0-9]*' 2>/dev/null || true)"
if [[ -n "${tags}" ]] && ! grep -qxF "v${version}" <<<"${tags}"; then
	echo "version.sh: HEAD is tagged $(tr '\n' ' ' <<<"${tags}")but VERSION says ${version}; tag v${version} or fix VERSION" >&2
	exit 1
fi
echo "${version}"
