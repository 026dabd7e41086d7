#!/usr/bin/env bash
# Every test of the project: Go (unit, golden, end-to-end against the
# simulator, the Python plugin and real Prometheus/Alertmanager 2.x and 3.x,
# short fuzz runs), the plugin's Python unit tests, the dashboard's schema
# check and the monitoring mixin. Installs what the tests need first
# (scripts/deps.sh; a second or two when everything is there).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/deps.sh

# gofmt, go vet, jsonnet-lint on the mixin, golangci-lint on both modules,
# govulncheck where its database is available (scripts/lint.sh, docs/ci.md).
bash scripts/lint.sh

# The Python plugin, stdlib only.
(cd sglang_plugin && python3 -m unittest discover -s tests -t .)

# The plugin inside SGLang's own PD code, once per release in ../shared/sglang-src.
bash scripts/conformance.sh

go test -count=1 -timeout 20m ./...

# Short fuzz runs of the ingestion paths; longer runs are in docs/hardening.md.
# Counted in executions, not seconds: Go 1.26's fuzzer can fail with "context
# deadline exceeded" when a timed run ends (fixed in Go 1.27), which a busy
# 2-core CI machine hit.
go test -run '^$' -fuzz '^FuzzParseMetrics$' -fuzztime 100000x ./collector
go test -run '^$' -fuzz '^FuzzDecodeListing$' -fuzztime 300000x ./pluginapi
go test -run '^$' -fuzz '^FuzzDecodeWireFast$' -fuzztime 300000x ./pluginapi

# The dashboard against Grafana's own schema (@grafana/schema, with the
# TypeScript compiler, offline), and a dashboard with known faults that the
# check must reject.
node dashboards/schema-check/check.mjs dashboards/sglang-watchdog.json
if node dashboards/schema-check/check.mjs dashboards/schema-check/testdata/invalid.json >/dev/null 2>&1; then
  echo "the schema check accepted dashboards/schema-check/testdata/invalid.json" >&2
  exit 1
fi

# The mixin, run as README.md "Use the mixin" shows it. Regenerating must
# change nothing (the mixin's Go test compares the same files), and rendering
# your own _config must work; the Go tests check both renderings in detail.
generated=(alerts/*.rules.yml dashboards/sglang-watchdog.json mixin/dashboards/sglang-watchdog.json)
before=$(cat "${generated[@]}" | sha256sum)
go generate ./mixin/
if [ "$(cat "${generated[@]}" | sha256sum)" != "$before" ]; then
  echo "go generate ./mixin/ changed the committed files: review and commit them" >&2
  exit 1
fi
go run ./mixin/render -config mixin/example-config.libsonnet -out /tmp/sglang-watchdog-mixin

# Packaging: the Helm chart (helm lint, helm template, strict decoding), the
# kustomize component, the LeaderWorkerSet/RoleBasedGroup examples and the
# operator's monitoring/v1 types live in a Go module of their own, which
# `go test ./...` above does not enter. (The release snapshot and the
# plugin's wheel are tested in ./deploy above.)
(cd deploy/verify && go vet ./... && go test -count=1 ./...)
