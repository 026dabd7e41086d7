{{/* The watchdog's container name and token path: the manifests and the
plugin docs use the same. */}}
{{- define "sglang-watchdog.containerName" -}}sglang-watchdog{{- end -}}
{{- define "sglang-watchdog.tokenDir" -}}/var/run/secrets/sglang-watchdog{{- end -}}

{{- define "sglang-watchdog.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sglang-watchdog.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "sglang-watchdog.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "sglang-watchdog.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sglang-watchdog.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "sglang-watchdog.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sglang-pd
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "sglang-watchdog.image" -}}
{{- $tag := .Values.image.tag | default (printf "v%s" .Chart.AppVersion) -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "sglang-watchdog.tokenSecretName" -}}
{{- .Values.token.existingSecret | default (printf "%s-plugin-token" (include "sglang-watchdog.fullname" .)) -}}
{{- end -}}

{{/* The enabled roles, checked (and the sidecar's two ports):
"sglang-watchdog.roles" returns their names as a JSON list. */}}
{{- define "sglang-watchdog.roles" -}}
{{- if eq (int .Values.sidecar.probePort) (int .Values.sidecar.port) -}}
{{- fail (printf "sidecar.probePort and sidecar.port are both %v; the probe listener needs a port of its own" .Values.sidecar.port) -}}
{{- end -}}
{{- if and .Values.hostNetwork .Values.networkPolicy.enabled -}}
{{- fail "hostNetwork and networkPolicy.enabled: a NetworkPolicy does not apply to pods on the node's network, so it would protect nothing; turn it off and guard the node's ports (the sidecar's port and probePort) another way" -}}
{{- end -}}
{{- $out := list -}}
{{- range $name, $r := .Values.roles -}}
{{- if $r.enabled -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "roles.%s: a role name must be a DNS label" $name) -}}
{{- end -}}
{{- if not (has (toString $r.forceFailMode) (list "off" "dry-run" "auto")) -}}
{{- fail (printf "roles.%s.forceFailMode is %v; want \"off\", \"dry-run\" or \"auto\" (quote \"off\": YAML reads a bare off as false)" $name $r.forceFailMode) -}}
{{- end -}}
{{- if hasKey $r.plugin "ranks" -}}
{{- fail (printf "roles.%s.plugin.ranks is gone: describe the instance in roles.%s.topology instead (nnodes, tpSize, dpSize, ppSize, dpAttention, as SGLang was launched; a single-node server with ranks: N is nnodes: 1, dpSize: N / ppSize) and plugin.enabled (false for ranks: 0). Each pod's sidecar then watches exactly its own node's ranks" $name $name) -}}
{{- end -}}
{{- if and (not $r.plugin.enabled) (eq (toString $r.forceFailMode) "auto") -}}
{{- fail (printf "roles.%s: forceFailMode auto needs the plugin (plugin.enabled)" $name) -}}
{{- end -}}
{{- include "sglang-watchdog.checkTopology" (dict "name" $name "r" $r) -}}
{{- range concat ($r.extraArgs | default list) ($.Values.sidecar.extraArgs | default list) -}}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" | trimPrefix "--" -}}
{{- if has $flag (list "web.listen-address" "web.probe-listen-address" "sglang.metrics-url" "plugin.url" "plugin.token-file" "plugin.base-port" "force-fail.mode" "force-fail.mode-file" "sglang.nnodes" "sglang.node-rank" "sglang.tp-size" "sglang.dp-size" "sglang.pp-size" "sglang.enable-dp-attention" "watchdog.max-rooms" "restart.mode" "restart.min-interval" "restart.state-file") -}}
{{- fail (printf "extraArgs of role %s: --%s is set by the chart (a flag given twice is refused by the watchdog); set it through its value (values.yaml: sglangMetrics, topology, plugin, forceFailMode, sidecar.maxRooms, restart)" $name $flag) -}}
{{- end -}}
{{- end -}}
{{- if empty $r.podSelector -}}
{{- fail (printf "roles.%s.podSelector is empty: it would select every pod" $name) -}}
{{- end -}}
{{- $pw := $r.prefillWatchdog | default dict -}}
{{- if $pw.enabled -}}
{{- if ne $r.mode "decode" -}}
{{- fail (printf "roles.%s.prefillWatchdog is for decode roles; this role's mode is %s" $name $r.mode) -}}
{{- end -}}
{{- if empty $pw.networks -}}
{{- fail (printf "roles.%s.prefillWatchdog.networks is empty: list the CIDRs of the prefill pods (e.g. the pod CIDR); only hosts in them are asked" $name) -}}
{{- end -}}
{{- range $pw.networks -}}
{{- if or (eq . "0.0.0.0/0") (eq . "::/0") -}}
{{- fail (printf "roles.%s.prefillWatchdog.networks has %s: the bootstrap host comes from listing data, so keep it to the prefill pods' CIDRs" $name .) -}}
{{- end -}}
{{- end -}}
{{- $peer := index $.Values.roles (toString $pw.role) -}}
{{- if not (and $peer $peer.enabled (eq $peer.mode "prefill")) -}}
{{- fail (printf "roles.%s.prefillWatchdog.role %q is not an enabled prefill role" $name (toString $pw.role)) -}}
{{- end -}}
{{- end -}}
{{- $out = append $out $name -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{- define "sglang-watchdog.usesToken" -}}
{{- $uses := false -}}
{{- range $name := include "sglang-watchdog.roles" . | fromJsonArray -}}
{{- if (index $.Values.roles $name).plugin.enabled -}}{{- $uses = true -}}{{- end -}}
{{- end -}}
{{- if $uses -}}true{{- end -}}
{{- end -}}

{{/*
"sglang-watchdog.sidecar": the watchdog container of one role, a native
sidecar (an init container with restartPolicy Always). Call it with the root
context and the role's name:
  initContainers:
    - {{- include "sglang-watchdog.sidecar" (dict "root" $ "role" "prefill") | nindent 6 }}
*/}}
{{- define "sglang-watchdog.sidecar" -}}
{{- $root := .root -}}
{{- $r := index $root.Values.roles .role -}}
{{- $s := $root.Values.sidecar -}}
{{- $t := $r.topology -}}
{{- $kind := include "sglang-watchdog.workloadKind" $r -}}
name: {{ include "sglang-watchdog.containerName" $root }}
image: {{ include "sglang-watchdog.image" $root }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
restartPolicy: Always
args:
  - --web.listen-address=:{{ $s.port }}
  # Probes get a plain-HTTP listener of their own (only /-/healthy and
  # /-/ready): it keeps answering when --web.config.file adds TLS or basic
  # auth to the metrics port.
  - --web.probe-listen-address=:{{ $s.probePort }}
{{- if $r.sglangMetrics }}
  # Every node serves its own schedulers' gauges on SGLang's --port.
  - --sglang.metrics-url=http://127.0.0.1:{{ $r.sglangPort }}/metrics
{{- else }}
  - --sglang.metrics-url=off
{{- end }}
{{- if $r.plugin.enabled }}
  # The instance's parallelism and this pod's node: the sidecar watches the
  # plugin listeners of its own node's schedulers, on basePort + dp_rank *
  # pp_size + pp_rank (docs/deployment.md, "Multi-node instances").
{{- if eq $kind "Deployment" }}
  - --sglang.nnodes=1
  - --sglang.node-rank=0
{{- else }}
  - --sglang.nnodes=$(SGLANG_WATCHDOG_NNODES)
  - --sglang.node-rank=$(SGLANG_WATCHDOG_NODE_RANK)
{{- end }}
  - --sglang.tp-size={{ $t.tpSize }}
  - --sglang.dp-size={{ $t.dpSize }}
  - --sglang.pp-size={{ $t.ppSize }}
{{- if $t.dpAttention }}
  # A bool flag: kingpin refuses a value on it.
  - --sglang.enable-dp-attention
{{- end }}
  - --plugin.base-port={{ $r.plugin.basePort }}
  - --plugin.token-file={{ include "sglang-watchdog.tokenDir" $root }}/token
{{- end }}
  # The mode of the ConfigMap, re-read while the pod runs; this flag while
  # the ConfigMap is missing.
  - --force-fail.mode={{ $r.forceFailMode }}
  - --force-fail.mode-file={{ include "sglang-watchdog.modeDir" $root }}/mode
  - --watchdog.max-rooms={{ $s.maxRooms }}
{{- if include "sglang-watchdog.restarts" (dict "root" $root "role" .role) }}
  # Restart escalation (restart.enabled): a restart loses every request
  # inside the server.
  - --restart.mode={{ $r.forceFailMode }}
  - --restart.min-interval={{ $root.Values.restart.minInterval }}
  # The time of the last restart, on an emptyDir that outlives this
  # container: a crash-looping watchdog must not restart SGLang again
  # before the interval is over.
  - --restart.state-file={{ include "sglang-watchdog.restartStateDir" $root }}/restart-state.json
{{- end }}
{{- if eq $r.mode "decode" }}
{{- with $r.decodeDeadline }}
  - --watchdog.decode-deadline={{ . }}
{{- end }}
{{- $pw := $r.prefillWatchdog | default dict }}
{{- if $pw.enabled }}
  # The prefill pods' watchdogs, asked for a room's verdict before a
  # started transfer is released ({host}: the request's bootstrap host).
  - --decode.prefill-watchdog-url={{ $pw.scheme | default "http" }}://{host}:{{ $s.port }}
{{- range $pw.networks }}
  - --decode.prefill-networks={{ . }}
{{- end }}
{{- with $pw.timeout }}
  - --decode.prefill-watchdog-timeout={{ . }}
{{- end }}
{{- if $pw.httpConfigSecret }}
  - --decode.prefill-watchdog-http-config-file={{ include "sglang-watchdog.httpConfigDir" $root }}/http-config.yml
{{- end }}
{{- end }}
{{- end }}
{{- range concat ($r.extraArgs | default list) ($s.extraArgs | default list) }}
  - {{ . | quote }}
{{- end }}
env:
  - name: GOMAXPROCS
    value: {{ $s.gomaxprocs | quote }}
  # No GOMEMLIMIT: the watchdog gives the Go runtime 90% of its memory
  # limit itself; one set here would win, at 100%.
{{- if and $r.plugin.enabled (ne $kind "Deployment") }}
  # This pod's node rank and its group's size, from the pod's own labels
  # (the downward API): {{ $kind }} sets them on every pod, and one
  # template then serves the leader and every worker.
  - name: SGLANG_WATCHDOG_NODE_RANK
    valueFrom:
      fieldRef:
        fieldPath: {{ include "sglang-watchdog.nodeRankField" $kind }}
  - name: SGLANG_WATCHDOG_NNODES
    valueFrom:
      fieldRef:
        fieldPath: {{ include "sglang-watchdog.nnodesField" $kind }}
{{- end }}
ports:
  - name: metrics
    containerPort: {{ $s.port }}
    protocol: TCP
  - name: probes
    containerPort: {{ $s.probePort }}
    protocol: TCP
# No readinessProbe, on purpose: a native sidecar's readiness counts toward
# Pod Ready (docs/deployment.md).
{{- if $s.gateSGLangStart }}
# sidecar.gateSGLangStart: SGLang starts once this probe passed.
startupProbe:
  httpGet:
    path: /-/healthy
    port: probes
  {{- toYaml $s.startupProbe | nindent 2 }}
{{- end }}
livenessProbe:
  httpGet:
    path: /-/healthy
    port: probes
  {{- toYaml $s.livenessProbe | nindent 2 }}
resources:
  {{- toYaml (include "sglang-watchdog.resources" $root | fromYaml) | nindent 2 }}
securityContext:
  {{- toYaml $s.securityContext | nindent 2 }}
terminationMessagePolicy: FallbackToLogsOnError
volumeMounts:
  - name: watchdog-mode
    mountPath: {{ include "sglang-watchdog.modeDir" $root }}
    readOnly: true
{{- if $r.plugin.enabled }}
  {{- include "sglang-watchdog.tokenVolumeMount" $root | nindent 2 }}
{{- end }}
{{- if include "sglang-watchdog.restarts" (dict "root" $root "role" .role) }}
  - name: watchdog-restart-state
    mountPath: {{ include "sglang-watchdog.restartStateDir" $root }}
{{- end }}
{{- if include "sglang-watchdog.httpConfigSecret" (dict "root" $root "role" .role) }}
  - name: prefill-watchdog-http-config
    mountPath: {{ include "sglang-watchdog.httpConfigDir" $root }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* A role's workloadKind, checked. */}}
{{- define "sglang-watchdog.workloadKind" -}}
{{- $k := .workloadKind | default "Deployment" -}}
{{- if not (has $k (list "Deployment" "LeaderWorkerSet" "RoleBasedGroup")) -}}
{{- fail (printf "workloadKind %q: want Deployment, LeaderWorkerSet or RoleBasedGroup" $k) -}}
{{- end -}}
{{- $k -}}
{{- end -}}

{{/* Where a pod of a multi-node instance finds its node rank and its
group's size: LeaderWorkerSet labels every pod with its worker index (the
leader 0) and annotates it with the group size (api/leaderworkerset/v1);
RoleBasedGroup's leaderWorkerPattern labels its pods with component-index
(the leader 0, worker n: n) and component-size (v0.8.0-alpha.5,
api/workloads/constants/label.go). RoleBasedGroup injects its
RBG_LWP_WORKER_INDEX only into spec.containers (pkg/discovery/injector.go),
not into a native sidecar, hence the labels. */}}
{{- define "sglang-watchdog.nodeRankField" -}}
{{- if eq . "RoleBasedGroup" -}}metadata.labels['rbg.workloads.x-k8s.io/component-index']{{- else -}}metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']{{- end -}}
{{- end -}}
{{- define "sglang-watchdog.nnodesField" -}}
{{- if eq . "RoleBasedGroup" -}}metadata.labels['rbg.workloads.x-k8s.io/component-size']{{- else -}}metadata.annotations['leaderworkerset.sigs.k8s.io/size']{{- end -}}
{{- end -}}

{{/* A role's topology, checked as SGLang checks it (server_args.py,
v0.5.18): nnodes divides tp_size * pp_size, multi-node data parallelism
needs DP attention, DP attention needs dp_size to divide tp_size; and a
Deployment runs one node. Call with (dict "name" <role> "r" <role values>). */}}
{{- define "sglang-watchdog.checkTopology" -}}
{{- $t := .r.topology -}}
{{- $n := int $t.nnodes -}}{{- $tp := int $t.tpSize -}}{{- $dp := int $t.dpSize -}}{{- $pp := int $t.ppSize -}}
{{- if and (gt $n 1) (eq (include "sglang-watchdog.workloadKind" .r) "Deployment") -}}
{{- fail (printf "roles.%s.topology.nnodes is %d, but a Deployment runs one pod per instance: set workloadKind LeaderWorkerSet or RoleBasedGroup" .name $n) -}}
{{- end -}}
{{- if ne (mod (mul $tp $pp) $n) 0 -}}
{{- fail (printf "roles.%s.topology: nnodes %d does not divide tpSize * ppSize (%d); SGLang refuses it" .name $n (mul $tp $pp)) -}}
{{- end -}}
{{- if and (gt $dp 1) (gt $n 1) (not $t.dpAttention) -}}
{{- fail (printf "roles.%s.topology: dpSize %d over %d nodes without dpAttention; SGLang refuses multi-node data parallelism without DP attention" .name $dp $n) -}}
{{- end -}}
{{- if and $t.dpAttention (ne (mod $tp $dp) 0) -}}
{{- fail (printf "roles.%s.topology: with dpAttention, dpSize %d must divide tpSize %d" .name $dp $tp) -}}
{{- end -}}
{{- end -}}

{{/* The sidecar's resources, with limits.memory from sidecar.maxRooms
(32 MiB + maxRooms x 2 KiB, the watchdog's own rule: internal/memlimit
ForRooms, below which it warns at start), or the user's limit checked
against it. */}}
{{- define "sglang-watchdog.resources" -}}
{{- $s := .Values.sidecar -}}
{{- $needKiB := add (mul 32 1024) (mul (int $s.maxRooms) 2) -}}
{{- $res := deepCopy ($s.resources | default dict) -}}
{{- $limits := $res.limits | default dict -}}
{{- if $limits.memory -}}
{{- $m := toString $limits.memory -}}
{{- if not (regexMatch "^[0-9]+(Mi|Gi)$" $m) -}}
{{- fail (printf "sidecar.resources.limits.memory %q: give it in Mi or Gi, or leave it out and the chart sizes it from sidecar.maxRooms" $m) -}}
{{- end -}}
{{- $mi := int (trimSuffix "Mi" (trimSuffix "Gi" $m)) -}}
{{- if hasSuffix "Gi" $m -}}{{- $mi = mul $mi 1024 -}}{{- end -}}
{{- if lt (mul $mi 1024) $needKiB -}}
{{- fail (printf "sidecar.resources.limits.memory %s is below what %d rooms take (32 MiB + %d x 2 KiB = %d MiB; BENCHMARKS.md, Footprint): raise it, lower sidecar.maxRooms, or leave it out and the chart sizes it" $m (int $s.maxRooms) (int $s.maxRooms) (div (add $needKiB 1023) 1024)) -}}
{{- end -}}
{{- else -}}
{{- $_ := set $limits "memory" (printf "%dMi" (div (add $needKiB 1023) 1024)) -}}
{{- end -}}
{{- $_ := set $res "limits" $limits -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "sglang-watchdog.modeDir" -}}/etc/sglang-watchdog/mode{{- end -}}
{{- define "sglang-watchdog.modeConfigMap" -}}{{ include "sglang-watchdog.fullname" . }}-mode{{- end -}}

{{/* The mode volume of a role's pods: its key of the mode ConfigMap,
optional so that a pod starts without it. */}}
{{- define "sglang-watchdog.modeVolume" -}}
- name: watchdog-mode
  configMap:
    name: {{ include "sglang-watchdog.modeConfigMap" .root }}
    optional: true
    items:
      - key: {{ .role }}
        path: mode
{{- end -}}

{{/* "true" when restart escalation applies to a role: restart.enabled, a
prefill role, with the plugin. Call with (dict "root" $ "role" <name>). */}}
{{- define "sglang-watchdog.restarts" -}}
{{- $r := index .root.Values.roles .role -}}
{{- if and .root.Values.restart.enabled (eq $r.mode "prefill") $r.plugin.enabled (ne (toString $r.forceFailMode) "off") -}}true{{- end -}}
{{- end -}}

{{/* The Secret of a decode role's prefill watchdog HTTP client settings,
or nothing. Call with (dict "root" $ "role" <name>). */}}
{{- define "sglang-watchdog.httpConfigSecret" -}}
{{- $r := index .root.Values.roles .role -}}
{{- $pw := $r.prefillWatchdog | default dict -}}
{{- if and (eq $r.mode "decode") $pw.enabled $pw.httpConfigSecret -}}{{ $pw.httpConfigSecret }}{{- end -}}
{{- end -}}

{{- define "sglang-watchdog.httpConfigDir" -}}/etc/sglang-watchdog/prefill-watchdog{{- end -}}

{{/* The token volume of a pod with the plugin (the pod's volumes list). */}}
{{- define "sglang-watchdog.tokenVolume" -}}
- name: watchdog-token
  secret:
    secretName: {{ include "sglang-watchdog.tokenSecretName" . }}
    defaultMode: 0444
    items:
      - key: {{ .Values.token.key }}
        path: token
{{- end -}}

{{/* The token mount, the same in the sidecar and the SGLang container. */}}
{{- define "sglang-watchdog.tokenVolumeMount" -}}
- name: watchdog-token
  mountPath: {{ include "sglang-watchdog.tokenDir" . }}
  readOnly: true
{{- end -}}

{{/* The SGLang container's plugin settings for one role (its env list);
call with (dict "root" $ "role" "prefill"). */}}
{{- define "sglang-watchdog.sglangEnv" -}}
{{- $r := index .root.Values.roles .role -}}
{{- /* No SGLANG_PLUGINS: SGLang's plugin framework loads every installed
plugin while it is unset (srt/plugins/__init__.py, v0.5.18: it is a
whitelist), releases before the framework load the plugin through its .pth
file, and a value here would overwrite the workload's own list. */}}
- name: SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE
  value: {{ include "sglang-watchdog.tokenDir" .root }}/token
- name: SGLANG_WATCHDOG_PLUGIN_HOST
  value: 127.0.0.1
- name: SGLANG_WATCHDOG_PLUGIN_PORT
  value: {{ $r.plugin.basePort | quote }}
{{- if include "sglang-watchdog.restarts" . }}
# restart.enabled: POST /admin/restart may end this server, losing every
# request inside it. The plugin keeps restart.minInterval itself, with the
# time of the last restart in the watchdog-state emptyDir, which outlives
# the container that the restart ends.
- name: SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART
  value: "1"
- name: SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL
  value: {{ include "sglang-watchdog.seconds" .root.Values.restart.minInterval | quote }}
- name: SGLANG_WATCHDOG_PLUGIN_STATE_DIR
  value: {{ include "sglang-watchdog.stateDir" .root }}
{{- end }}
{{- end -}}

{{- define "sglang-watchdog.stateDir" -}}/var/run/sglang-watchdog-state{{- end -}}

{{/* The sidecar's own restart record (--restart.state-file), apart from
the plugin's stateDir: each container writes only its own volume. */}}
{{- define "sglang-watchdog.restartStateDir" -}}/var/lib/sglang-watchdog{{- end -}}

{{/* A duration of one unit (s, m or h; values.schema.json) in seconds. */}}
{{- define "sglang-watchdog.seconds" -}}
{{- $d := toString . -}}
{{- $n := int (trimSuffix "s" (trimSuffix "m" (trimSuffix "h" $d))) -}}
{{- if hasSuffix "h" $d -}}{{ mul $n 3600 }}{{- else if hasSuffix "m" $d -}}{{ mul $n 60 }}{{- else -}}{{ $n }}{{- end -}}
{{- end -}}

{{/* The pod-spec part of a role's patch: hostNetwork, pull secrets, the
sidecar, SGLang's plugin settings and the volumes. No
automountServiceAccountToken and no SGLANG_PLUGINS: the workload's own stay.
Call with (dict "root" $ "role" <name>). */}}
{{- define "sglang-watchdog.podPatch" -}}
{{- $root := .root -}}
{{- $r := index $root.Values.roles .role -}}
{{- $httpConfig := include "sglang-watchdog.httpConfigSecret" . -}}
{{- $restarts := include "sglang-watchdog.restarts" . -}}
{{- if $root.Values.hostNetwork }}
# hostNetwork: the node's ports; ClusterFirstWithHostNet keeps cluster
# DNS names resolving.
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
initContainers:
  - {{- include "sglang-watchdog.sidecar" . | nindent 4 }}
{{- if $r.plugin.enabled }}
containers:
  - name: {{ $r.sglangContainer }}
    env:
      {{- include "sglang-watchdog.sglangEnv" . | nindent 6 }}
    volumeMounts:
      {{- include "sglang-watchdog.tokenVolumeMount" $root | nindent 6 }}
      {{- if $restarts }}
      - name: watchdog-state
        mountPath: {{ include "sglang-watchdog.stateDir" $root }}
      {{- end }}
{{- end }}
volumes:
  {{- include "sglang-watchdog.modeVolume" . | nindent 2 }}
  {{- if $r.plugin.enabled }}
  {{- include "sglang-watchdog.tokenVolume" $root | nindent 2 }}
  {{- end }}
  {{- if $restarts }}
  # Kept across container restarts (not pod replacements): the plugin's
  # record of the last restart.
  - name: watchdog-state
    emptyDir:
      sizeLimit: 1Mi
  # The sidecar's record of the last restart (--restart.state-file), kept
  # across the sidecar's own restarts.
  - name: watchdog-restart-state
    emptyDir:
      sizeLimit: 1Mi
  {{- end }}
  {{- if $httpConfig }}
  - name: prefill-watchdog-http-config
    secret:
      secretName: {{ $httpConfig }}
      defaultMode: 0444
      items:
        - key: http-config.yml
          path: http-config.yml
  {{- end }}
{{- end -}}

{{/* "true" when the cluster serves a Prometheus Operator kind: the kind
(monitoring.coreos.com/v1/PodMonitor, as a live cluster reports it) or
the group/version alone (helm template --api-versions
monitoring.coreos.com/v1). Call with (dict "root" $ "kind" "PodMonitor"). */}}
{{- define "sglang-watchdog.serves" -}}
{{- $api := .root.Capabilities.APIVersions -}}
{{- if or ($api.Has (printf "monitoring.coreos.com/v1/%s" .kind)) ($api.Has "monitoring.coreos.com/v1") -}}true{{- end -}}
{{- end -}}
