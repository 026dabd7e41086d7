# The conventional targets, over the project's scripts (which CI runs through
# .ci/run -> scripts/test.sh). Tools are built from the Go module proxy into
# $(XDG_CACHE_HOME or ~/.cache)/sglang-watchdog/bin, once per version.

SHELL := bash
IMAGE ?= ghcr.io/sglang-watchdog/sglang-watchdog
PLATFORMS ?= linux/amd64,linux/arm64

.PHONY: all build test lint vulncheck generate release-snapshot image clean

all: lint test build

# ./sglang-watchdog for this machine: static, stamped as a development build
# (<VERSION>-dev+<revision> off a release tag; scripts/build.sh).
build:
	bash scripts/build.sh

# Every test, as CI runs them (installs what they need first).
test:
	bash scripts/test.sh

# gofmt, go vet, jsonnet-lint on the mixin, golangci-lint on every package
# (as CI runs them), and govulncheck when GOVULNDB names a local copy of its database (without it,
# lint says so and goes on).
lint:
	bash scripts/lint.sh

# govulncheck needs the Go vulnerability database, which this project cannot
# reach (no network beyond the Go module proxy): point GOVULNDB at a copy.
vulncheck:
	@if [ -z "$(GOVULNDB)" ]; then \
		echo "vulncheck: set GOVULNDB=file:///path/to/a/copy of the Go vulnerability database; this project reaches no network beyond the Go module proxy (docs/ci.md)" >&2; \
		exit 2; \
	fi
	bash scripts/deps-lint.sh
	source scripts/release-tools.sh && bin="$$(tool_path govulncheck "$$GOVULNCHECK_VERSION")" && \
		"$$bin" -db "$(GOVULNDB)" ./... && (cd deploy/verify && "$$bin" -db "$(GOVULNDB)" ./...)

# Regenerate the rule files, the dashboard and their copies in deploy/.
generate:
	go generate ./mixin/
	go run ./deploy/kubernetes/gen

# The release binaries with promu (.promu.yml): .build/linux-amd64 and
# .build/linux-arm64, stamped with VERSION and the git revision.
release-snapshot:
	bash scripts/release-snapshot.sh .build

# The image, from promu's binaries (the Dockerfile builds nothing itself).
image: release-snapshot
	docker buildx build --platform $(PLATFORMS) \
		--build-arg VERSION="$$(bash scripts/version.sh)" \
		--build-arg REVISION="$$(git rev-parse HEAD)" \
		--build-arg BUILD_DATE="$$(date -u +%Y%m%d-%H:%M:%S)" \
		-t $(IMAGE):v$$(cat VERSION) .

clean:
	rm -rf .build sglang-watchdog
