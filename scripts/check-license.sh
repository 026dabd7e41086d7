#!/usr/bin/env bash
# Prometheus' check_license, adapted to this project. The repository's
# LICENSE (Apache-2.0) covers every file, and the project's own files carry
# no header. A Go file may carry, in its first three lines, no licence
# mention at all, an Apache-2.0 header (code kept from Prometheus projects,
# with its copyright), or a generated-code mark. Any other licence or
# copyright there (code copied from elsewhere) fails, naming the file.
#
# Usage: scripts/check-license.sh [DIR...]   (default: the tracked Go files)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! grep -q 'Apache License' LICENSE || ! grep -q 'Version 2.0' LICENSE; then
	echo "check_license: LICENSE is not the Apache License 2.0" >&2
	exit 1
fi

if [[ $# -gt 0 ]]; then
	mapfile -t files < <(find "$@" -type f -name '*.go' | sort)
else
	mapfile -t files < <(git ls-files '*.go')
fi
bad=()
for f in "${files[@]}"; do
	head="$(head -n 3 "$f")"
	if grep -Eqi 'copyright|licen[cs]e|spdx' <<<"${head}" &&
		! grep -Eq 'Apache License|Apache-2\.0|Code generated .* DO NOT EDIT' <<<"${head}"; then
		bad+=("$f")
	fi
done
if [[ ${#bad[@]} -gt 0 ]]; then
	echo "check_license: a licence other than the project's Apache-2.0 (LICENSE) in the header of:" >&2
	printf '  %s\n' "${bad[@]}" >&2
	exit 1
fi
echo "check_license: ${#files[@]} Go files, none under a foreign licence" >&2
