#!/usr/bin/env bash
# Installs what the tests need, and only what is missing, so a second run takes
# a second or two; scripts/test.sh runs it first, so nobody needs to call it.
#   - Debian packages: Prometheus 2.x with promtool, Alertmanager, python3 for
#     the plugin, Node and npm for the dashboard schema check.
#   - Prometheus 3.x (prometheus and promtool) and a current Alertmanager,
#     built from the Go module proxy into a cache folder keyed by version
#     (internal/prombin finds them there). The first build takes minutes.
#   - npm packages of dashboards/schema-check, and the Go modules.
set -euo pipefail
cd "$(dirname "$0")/.."

# Built from the Go module proxy; internal/prombin holds the same versions.
PROMETHEUS_VERSION=v0.316.0
ALERTMANAGER_VERSION=v0.35.0
BIN="${XDG_CACHE_HOME:-$HOME/.cache}/sglang-watchdog/bin"

# Debian packages.
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
# SGLang's own PD code on CPU (scripts/conformance.sh): Debian's python3 with
# the libraries SGLang's disaggregation modules import and run, and
# prometheus_client for SGLang's own metrics collector (the real-code server).
sglang_py=(python3-torch python3-numpy python3-zmq python3-requests python3-aiohttp python3-psutil
  python3-dill python3-tqdm python3-packaging python3-pil python3-typing-extensions python3-fastapi
  python3-prometheus-client xz-utils)
/usr/bin/python3 -c 'import torch, numpy, zmq, requests, aiohttp, psutil, dill, tqdm, packaging, PIL, fastapi, prometheus_client' \
  >/dev/null 2>&1 || missing+=("${sglang_py[@]}")
command -v xz >/dev/null 2>&1 || missing+=(xz-utils)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "deps: missing ${missing[*]}; install them with apt-get as root" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null
fi

# go_install DIR TAGS PACKAGE@VERSION...: builds the packages with the build
# tags into DIR unless every binary is there. One `go install` builds them all,
# so they share compilation; the binaries land in DIR only once all are built.
go_install() {
  local dir=$1 tags=$2 pkg have=1
  shift 2
  for pkg in "$@"; do
    pkg=${pkg%@*}
    [ -x "$dir/${pkg##*/}" ] || have=0
  done
  [ "$have" = 1 ] && return 0
  echo "deps: building $* into $dir (once; minutes on 2 cores)" >&2
  local tmp
  tmp=$(mktemp -d)
  GOBIN="$tmp" GOFLAGS=-buildvcs=false nice go install -tags="$tags" "$@"
  mkdir -p "$dir"
  mv "$tmp"/* "$dir"/
  rmdir "$tmp"
}
# remove_all_sd leaves out every service discovery but static, file and http
# configs (the tests use static ones), which cuts the first build to about a
# third; the folder name says so (internal/prombin).
go_install "$BIN/prometheus-$PROMETHEUS_VERSION-nosd" remove_all_sd \
  "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION" \
  "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION"

# Alertmanager's module has no web UI assets (ui/web.go embeds ui/app/dist,
# which only its release build makes), so `go install` fails; build it from a
# copy of the module with two placeholder pages instead. The API and the
# webhook notifier, which the tests use, do not need the UI.
am_dir="$BIN/alertmanager-$ALERTMANAGER_VERSION"
if [ ! -x "$am_dir/alertmanager" ]; then
  echo "deps: building Alertmanager $ALERTMANAGER_VERSION into $am_dir (once; a few minutes on 2 cores)" >&2
  src=$(go mod download -json "github.com/prometheus/alertmanager@$ALERTMANAGER_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  tmp=$(mktemp -d)
  cp -r "$src" "$tmp/src"
  chmod -R u+w "$tmp/src"
  for ui in elm mantine; do
    mkdir -p "$tmp/src/ui/app/dist/$ui"
    echo "Alertmanager built without its web UI (scripts/deps.sh)." >"$tmp/src/ui/app/dist/$ui/index.html"
  done
  (cd "$tmp/src" && GOFLAGS=-buildvcs=false nice go build -o "$tmp/alertmanager" ./cmd/alertmanager)
  mkdir -p "$am_dir"
  mv "$tmp/alertmanager" "$am_dir/"
  rm -rf "$tmp"
fi

# The dashboard schema check's npm packages, pinned by its package-lock.json.
lock=dashboards/schema-check/package-lock.json
if ! cmp -s "$lock" dashboards/schema-check/node_modules/.installed-lock.json 2>/dev/null; then
  (cd dashboards/schema-check && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  cp "$lock" dashboards/schema-check/node_modules/.installed-lock.json
fi

go mod download
bash scripts/deps-release.sh   # helm, promu, python3-build (packaging and release tests)
