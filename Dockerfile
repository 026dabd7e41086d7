# syntax=docker/dockerfile:1
#
# sglang-watchdog image: promu's static release binary on distroless, running
# as nonroot. The image adds no build of its own: it copies the binary that
# promu built from .promu.yml (scripts/release-snapshot.sh, `make
# release-snapshot`), so the image and the release tarballs carry the same
# binary, stamped once. Build it with the Makefile: `make docker` loads this
# machine's image, `make docker-publish docker-manifest IMAGE=<repository>`
# pushes one image per architecture and their manifest list. Each runs, per
# architecture:
#
#   bash scripts/release-snapshot.sh      # .build/linux-amd64, .build/linux-arm64
#   docker build --platform linux/<arch> \
#     --build-arg TARGETOS=linux --build-arg TARGETARCH=<arch> \
#     --build-arg VERSION="$(bash scripts/version.sh)" \
#     --build-arg REVISION="$(git rev-parse HEAD)" \
#     --build-arg BUILD_DATE="$(date -u +%Y%m%d-%H:%M:%S)" \
#     -t ghcr.io/sglang-watchdog/sglang-watchdog:v"$(cat VERSION)" .
#
# The build context is only those binaries and LICENSE (.dockerignore). The
# tag is what the chart and the manifests run:
# ghcr.io/sglang-watchdog/sglang-watchdog:v<VERSION>.
FROM gcr.io/distroless/static-debian13:nonroot

# Set by BuildKit for each platform, and by the Makefile for Docker's legacy
# builder; the defaults serve a plain docker build on amd64.
ARG TARGETOS=linux
ARG TARGETARCH=amd64
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

# promu's layout: .build/<os>-<arch>/<binary>.
COPY .build/${TARGETOS}-${TARGETARCH}/sglang-watchdog /bin/sglang-watchdog
COPY LICENSE /LICENSE

# Static binary: no libc, no shell. The :nonroot tag already runs as
# 65532:65532; USER makes it explicit (and numeric, for runAsNonRoot).
USER 65532:65532
EXPOSE 9433
ENTRYPOINT ["/bin/sglang-watchdog"]
