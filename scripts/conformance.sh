#!/usr/bin/env bash
# The plugin on SGLang's own PD code: the conformance suite once per release.
#
#   bash scripts/conformance.sh                 every release whose source tarball is in SGLANG_SRC_DIR
#   SGLANG_SRC=DIR bash scripts/conformance.sh  one unpacked source tree (DIR/python/sglang)
#
# SGLANG_SRC_DIR defaults to ../shared/sglang-src beside the checkout, where
# the tarballs (sglang-vX.Y.Z.tar.xz, every .py file of python/sglang) are
# kept; they are unpacked once into a cache folder. Runs with Debian's
# python3, where scripts/deps.sh installs torch, numpy and zmq.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${CONFORMANCE_PYTHON:-/usr/bin/python3}
# One process per backend (and one for the rest): SGLang keeps sockets and
# threads in class-level state that one backend's tests must not hand the other.
run() {
  local src=$1 name=$2 part rc=0
  for part in nixl mooncake ascend other; do
    echo "conformance: SGLang $name ($src), $part"
    (cd sglang_plugin && SGLANG_SRC="$src" timeout 900 "$PY" -W ignore -m conformance_tests "$part") || rc=1
  done
  return $rc
}

if [ -n "${SGLANG_SRC:-}" ]; then
  run "$SGLANG_SRC" "$(basename "$SGLANG_SRC")"
  exit 0
fi

dir=${SGLANG_SRC_DIR:-../shared/sglang-src}
cache="${XDG_CACHE_HOME:-$HOME/.cache}/sglang-watchdog/sglang-src"
shopt -s nullglob
tarballs=("$dir"/sglang-v*.tar.xz)
if [ ${#tarballs[@]} -eq 0 ]; then
  echo "conformance: SKIPPED: no SGLang source at all (no $dir/sglang-v*.tar.xz, no SGLANG_SRC); nothing was proven on SGLang's own code" >&2
  exit 0
fi
for tarball in "${tarballs[@]}"; do
  name=$(basename "$tarball" .tar.xz)
  target="$cache/$name"
  if [ ! -f "$target/.unpacked" ] || [ "$tarball" -nt "$target/.unpacked" ]; then
    rm -rf "$target"
    mkdir -p "$target"
    tar -xJf "$tarball" -C "$target"
    touch "$target/.unpacked"
  fi
done
# The releases run side by side, CONFORMANCE_JOBS at a time (default 3):
# their scenarios mostly wait on timed transfers (about a third of a core
# each), and every run has its own ports and processes. Each release's
# output is printed whole once it ends.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
jobs=${CONFORMANCE_JOBS:-3}
running=0
names=()
for tarball in "${tarballs[@]}"; do
  name=$(basename "$tarball" .tar.xz)
  names+=("$name")
  (run "$cache/$name" "${name#sglang-}" >"$logs/$name.log" 2>&1; echo $? >"$logs/$name.rc") &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait
failed=()
for name in "${names[@]}"; do
  cat "$logs/$name.log"
  if [ "$(cat "$logs/$name.rc" 2>/dev/null)" != 0 ]; then
    failed+=("${name#sglang-}")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "conformance: FAILED on ${failed[*]}" >&2
  exit 1
fi
