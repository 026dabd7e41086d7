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
{{- if lt (int $r.plugin.ranks) 0 -}}
{{- fail (printf "roles.%s.plugin.ranks is %v; want 0 or more" $name $r.plugin.ranks) -}}
{{- end -}}
{{- if and (eq (int $r.plugin.ranks) 0) (eq (toString $r.forceFailMode) "auto") -}}
{{- fail (printf "roles.%s: forceFailMode auto needs the plugin (plugin.ranks > 0)" $name) -}}
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
{{- if gt (int (index $.Values.roles $name).plugin.ranks) 0 -}}{{- $uses = true -}}{{- end -}}
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
{{- $ranks := int $r.plugin.ranks -}}
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
  - --sglang.metrics-url=http://127.0.0.1:{{ $r.sglangPort }}/metrics
{{- range $i := until $ranks }}
  - --plugin.url=http://127.0.0.1:{{ add (int $r.plugin.basePort) $i }}
{{- end }}
{{- if gt $ranks 0 }}
  - --plugin.token-file={{ include "sglang-watchdog.tokenDir" $root }}/token
{{- end }}
  - --force-fail.mode={{ $r.forceFailMode }}
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
ports:
  - name: metrics
    containerPort: {{ $s.port }}
    protocol: TCP
  - name: probes
    containerPort: {{ $s.probePort }}
    protocol: TCP
# No readinessProbe, on purpose: a native sidecar's readiness counts toward
# Pod Ready (docs/deployment.md).
startupProbe:
  httpGet:
    path: /-/healthy
    port: probes
  {{- toYaml $s.startupProbe | nindent 2 }}
livenessProbe:
  httpGet:
    path: /-/healthy
    port: probes
  {{- toYaml $s.livenessProbe | nindent 2 }}
resources:
  {{- toYaml $s.resources | nindent 2 }}
securityContext:
  {{- toYaml $s.securityContext | nindent 2 }}
terminationMessagePolicy: FallbackToLogsOnError
{{- $httpConfig := include "sglang-watchdog.httpConfigSecret" (dict "root" $root "role" .role) }}
{{- if or (gt $ranks 0) $httpConfig }}
volumeMounts:
{{- if gt $ranks 0 }}
  {{- include "sglang-watchdog.tokenVolumeMount" $root | nindent 2 }}
{{- end }}
{{- if include "sglang-watchdog.restarts" (dict "root" $root "role" .role) }}
  - name: watchdog-restart-state
    mountPath: {{ include "sglang-watchdog.restartStateDir" $root }}
{{- end }}
{{- if $httpConfig }}
  - name: prefill-watchdog-http-config
    mountPath: {{ include "sglang-watchdog.httpConfigDir" $root }}
    readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/* "true" when restart escalation applies to a role: restart.enabled, a
prefill role, with the plugin. Call with (dict "root" $ "role" <name>). */}}
{{- define "sglang-watchdog.restarts" -}}
{{- $r := index .root.Values.roles .role -}}
{{- if and .root.Values.restart.enabled (eq $r.mode "prefill") (gt (int $r.plugin.ranks) 0) (ne (toString $r.forceFailMode) "off") -}}true{{- end -}}
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
- name: SGLANG_PLUGINS
  value: sglang_watchdog
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
