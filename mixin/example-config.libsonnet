// _config overrides for a deployment that differs from the defaults in every
// way the mixin supports: `go run ./mixin/render -config
// mixin/example-config.libsonnet -out DIR` (README.md, "Use the mixin").
// The mixin's tests render it and check the result.
{
  scrapeInterval: '30s',
  watchdogSelector: 'job="llm/sglang-watchdog"',
  sglangSelector: 'job="llm/sglang"',
  clusterLabel: 'k8s_cluster',
  showMultiCluster: true,
  runbookURLPattern: 'https://runbooks.example.com/sglang#%s',
  dashboardUID: 'sglang-watchdog-llm',
  dashboardTitle: 'SGLang PD watchdog (llm)',
  dashboardTags: ['sglang', 'llm'],
}
