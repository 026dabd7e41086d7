# The conventional targets, over the project's scripts (which CI runs through
# .ci/run -> scripts/test.sh), named as in Prometheus' Makefile.common. Tools
# are built from the Go module proxy into
# $(XDG_CACHE_HOME or ~/.cache)/sglang-watchdog/bin, once per version.

SHELL := bash
# The image repository docker-publish and docker-manifest push to; set it to
# your registry's (make docker-publish docker-manifest IMAGE=...).
IMAGE ?= ghcr.io/sglang-watchdog/sglang-watchdog
# The tag: the one the chart and the manifests run.
DOCKER_TAG ?= v$(shell cat VERSION)
# The architectures of the published image (.promu.yml's crossbuild
# platforms are linux/ of these).
DOCKER_ARCHS ?= amd64 arm64
# This machine's, for the image make docker loads.
GOARCH ?= $(shell go env GOARCH)
PROMU ?= $(shell source scripts/release-tools.sh && tool_path promu "$$PROMU_VERSION")

.PHONY: all build test lint format check_license vulncheck generate release-snapshot crossbuild tarball \
	docker image docker-publish docker-manifest clean

all: lint test build

# ./sglang-watchdog for this machine: static, stamped with VERSION and the
# git revision like promu's binaries (scripts/build.sh).
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

# gofmt -w (go fmt) over both modules.
format:
	go fmt ./...
	cd deploy/verify && go fmt ./...

# Prometheus' check_license, adapted: the project's files carry no header
# (LICENSE, Apache-2.0, covers them all), so a Go file may carry none, or an
# Apache-2.0 one (code kept from Prometheus projects), or a generated-code
# mark; any other licence or copyright in its first lines fails.
check_license:
	bash scripts/check-license.sh $(LICENSE_DIRS)

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

# promu crossbuild: every platform of .promu.yml in Prometheus' builder
# images (needs Docker); release-snapshot builds the same binaries without.
crossbuild:
	$(PROMU) crossbuild

# promu tarball of each snapshot binary, with LICENSE and CHANGELOG.md:
# .tarballs/sglang-watchdog-<VERSION>.linux-<arch>.tar.gz.
tarball: release-snapshot
	for arch in $(DOCKER_ARCHS); do \
		GOOS=linux GOARCH=$$arch $(PROMU) tarball --prefix .tarballs .build/linux-$$arch || exit 1; \
	done

# The image of architecture $(1) from promu's binaries (the Dockerfile
# builds nothing itself), labelled with the version and revision. TARGETARCH
# is passed for Docker's legacy builder, which does not set it; without
# attestations, each pushed tag is an image a manifest list can name.
docker_build = BUILDX_NO_DEFAULT_ATTESTATIONS=1 docker build --platform linux/$(1) \
	--build-arg TARGETOS=linux --build-arg TARGETARCH=$(1) \
	--build-arg VERSION="$$(bash scripts/version.sh)" \
	--build-arg REVISION="$$(git rev-parse HEAD)" \
	--build-arg BUILD_DATE="$$(date -u +%Y%m%d-%H:%M:%S)" \
	-t $(2) .

# The image for this machine, loaded into the local Docker as
# $(IMAGE):$(DOCKER_TAG) (kind load docker-image takes it from there).
docker: release-snapshot
	$(call docker_build,$(GOARCH),$(IMAGE):$(DOCKER_TAG))

image: docker

# One image per architecture, pushed as $(IMAGE):$(DOCKER_TAG)-<arch>; the
# image copies a binary and runs nothing at build, so no emulation is needed.
docker-publish: release-snapshot
	for arch in $(DOCKER_ARCHS); do \
		$(call docker_build,$$arch,$(IMAGE):$(DOCKER_TAG)-$$arch) && \
		docker push $(IMAGE):$(DOCKER_TAG)-$$arch || exit 1; \
	done

# The manifest list $(IMAGE):$(DOCKER_TAG) over the per-architecture tags
# docker-publish pushed.
docker-manifest:
	docker manifest create --amend $(IMAGE):$(DOCKER_TAG) $(foreach arch,$(DOCKER_ARCHS),$(IMAGE):$(DOCKER_TAG)-$(arch))
	docker manifest push $(IMAGE):$(DOCKER_TAG)

clean:
	rm -rf .build .tarballs sglang-watchdog
