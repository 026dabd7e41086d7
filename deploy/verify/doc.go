// Package verify tests the project's Kubernetes packaging with the heavy
// dependencies that the main module does without: the Helm chart
// (deploy/helm, through the helm binary that scripts/deps.sh builds), the
// kustomize component (deploy/kustomize, through sigs.k8s.io/kustomize/api),
// the LeaderWorkerSet and RoleBasedGroup examples (deploy/examples), and
// every PodMonitor and PrometheusRule decoded strictly into
// prometheus-operator's monitoring/v1 types.
//
// It is a Go module of its own (replace points at the repository root) so
// that the main module's dependency graph stays small; scripts/test.sh runs
// its tests explicitly: (cd deploy/verify && go test ./...).
package verify
