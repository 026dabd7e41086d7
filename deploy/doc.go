// Package deploy holds the project's packaging: the Kubernetes manifests in
// deploy/kubernetes, the Helm chart in deploy/helm, the kustomize component
// in deploy/kustomize and the LeaderWorkerSet and RoleBasedGroup examples in
// deploy/examples. Its tests keep the repository's Dockerfile,
// scripts/build.sh and the release files honest (an image that copies
// promu's static release binary and runs it as non-root on distroless; a
// static, version-stamped development build; a promu snapshot for
// linux/amd64 and linux/arm64; the plugin's wheel; one release name
// everywhere), and SidecarArgs hands every shipped sidecar's
// args to the main package, which parses them with the real flag set.
//
// The tests that need helm, kustomize's Go API or prometheus-operator's
// types live in deploy/verify, a Go module of its own.
package deploy
