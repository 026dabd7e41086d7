# syntax=docker/dockerfile:1
#
# sglang-watchdog image: a static Go binary on distroless, running as nonroot.
#
#   docker build \
#     --build-arg VERSION="$(bash scripts/version.sh)" \
#     --build-arg REVISION="$(git rev-parse HEAD)" \
#     --build-arg BRANCH="$(git rev-parse --abbrev-ref HEAD)" \
#     --build-arg BUILD_DATE="$(date -u +%Y%m%d-%H:%M:%S)" \
#     -t ghcr.io/sglang-watchdog/sglang-watchdog:v"$(cat VERSION)" .
#
# .git is not in the build context (.dockerignore), so without these build
# args the binary reports version <VERSION>-dev and revision "unknown".
# Multi-arch: docker buildx build --platform linux/amd64,linux/arm64 (the
# builder cross-compiles; CGO is off). The tag is what the chart and the
# manifests run: ghcr.io/sglang-watchdog/sglang-watchdog:v<VERSION>.

# ---- build stage --------------------------------------------------------------
FROM --platform=$BUILDPLATFORM golang:1.26-trixie AS build

WORKDIR /src

# Dependencies first, so that source edits do not invalidate this layer.
COPY go.mod go.sum ./
RUN go mod download

COPY . .

ARG TARGETOS
ARG TARGETARCH
ARG VERSION
ARG REVISION
ARG BRANCH
ARG BUILD_USER=docker
ARG BUILD_DATE

# The same script CI uses: CGO_ENABLED=0, -trimpath, version stamping.
RUN --mount=type=cache,target=/root/.cache/go-build \
    GOOS="${TARGETOS}" GOARCH="${TARGETARCH}" \
    VERSION="${VERSION}" REVISION="${REVISION}" BRANCH="${BRANCH}" \
    BUILD_USER="${BUILD_USER}" BUILD_DATE="${BUILD_DATE}" \
    bash scripts/build.sh /out/sglang-watchdog

# ---- runtime stage ------------------------------------------------------------
# Static binary: no libc, no shell. The :nonroot tag already runs as
# 65532:65532; USER below makes it explicit (and numeric, for runAsNonRoot).
FROM gcr.io/distroless/static-debian13:nonroot

ARG VERSION
ARG REVISION
ARG BUILD_DATE

LABEL org.opencontainers.image.title="sglang-watchdog" \
      org.opencontainers.image.description="Prometheus exporter and stuck-request watchdog for SGLang prefill/decode disaggregated serving" \
      org.opencontainers.image.source="https://github.com/sglang-watchdog/sglang-watchdog" \
      org.opencontainers.image.url="https://github.com/sglang-watchdog/sglang-watchdog" \
      org.opencontainers.image.documentation="https://github.com/sglang-watchdog/sglang-watchdog/blob/main/docs/deployment.md" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${BUILD_DATE}"

COPY --from=build /out/sglang-watchdog /bin/sglang-watchdog
COPY LICENSE /LICENSE

USER 65532:65532
EXPOSE 9433
ENTRYPOINT ["/bin/sglang-watchdog"]
