// Package deploy holds the project's packaging: the Kubernetes manifests in
// deploy/kubernetes, and tests that keep the repository's Dockerfile and
// scripts/build.sh honest (the image builds a static, version-stamped binary
// with the same script CI uses, and runs it as non-root on distroless).
package deploy
