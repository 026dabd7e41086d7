#!/usr/bin/env bash
# Every test of the project: Go (unit, golden, end-to-end against the
# simulator, the Python plugin and real Prometheus/Alertmanager, short fuzz
# runs) and the plugin's Python unit tests. Run scripts/deps.sh first on a
# fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
  echo "gofmt would change: $unformatted" >&2
  exit 1
fi
go vet ./...

# The Python plugin, stdlib only.
(cd sglang_plugin && python3 -m unittest discover -s tests -t .)

go test -count=1 -timeout 20m ./...

# Short fuzz runs of the ingestion paths; longer runs are in docs/hardening.md.
go test -run '^$' -fuzz '^FuzzParseMetrics$' -fuzztime 20s ./collector
go test -run '^$' -fuzz '^FuzzDecodeListing$' -fuzztime 20s ./pluginapi
go test -run '^$' -fuzz '^FuzzDecodeWireFast$' -fuzztime 20s ./pluginapi

# Packaging: the Helm chart (helm lint, helm template, strict decoding), the
# kustomize component, the LeaderWorkerSet/RoleBasedGroup examples and the
# operator's monitoring/v1 types live in a Go module of their own, which
# `go test ./...` above does not enter. (The release snapshot and the
# plugin's wheel are tested in ./deploy above.)
(cd deploy/verify && go vet ./... && go test -count=1 ./...)
