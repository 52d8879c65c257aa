{{- define "ppserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The RayService name; KubeRay derives <fullname>-serve-svc and <fullname>-head-svc from it. */}}
{{- define "ppserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "ppserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "ppserve.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "ppserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ppserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ppserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "ppserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ppserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/* build_app's args: the set engine options, the set server options (serve.* but the chart's
own keys), then serve.extraArgs. Unset: null, "" or an empty list. */}}
{{- define "ppserve.serveArgs" -}}
{{- $args := dict }}
{{- $s := .Values.serve }}
{{- $server := omit $s "autoscaling" "num_replicas" "port" "runtimeEnv" "extraArgs" }}
{{- range $k, $v := merge (deepCopy .Values.engine) $server }}
{{- if not (or (kindIs "invalid" $v) (eq (toString $v) "") (and (kindIs "slice" $v) (empty $v))) }}{{ $_ := set $args $k $v }}{{ end }}
{{- end }}
{{- if $s.autoscaling.enabled }}
{{- $_ := set $args "autoscaling_config" (omit $s.autoscaling "enabled") }}
{{- else }}
{{- $_ := set $args "num_replicas" $s.num_replicas }}
{{- end }}
{{- if .Values.apiKey.value }}{{ $_ := set $args "api_key" .Values.apiKey.value }}{{ end }}
{{- toYaml (mergeOverwrite $args $s.extraArgs) }}
{{- end }}

{{- define "ppserve.serveConfig" -}}
http_options:
  host: 0.0.0.0
  port: {{ .Values.serve.port }}
proxy_location: EveryNode
applications:
  - name: ppserve
    route_prefix: /
    import_path: app.server:build_app
    {{- with .Values.serve.runtimeEnv }}
    runtime_env:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    args:
      {{- include "ppserve.serveArgs" . | nindent 6 }}
{{- end }}

{{/* Pod metadata, env and volumes shared by head and workers. */}}
{{- define "ppserve.podMeta" -}}
labels:
  {{- include "ppserve.selectorLabels" . | nindent 2 }}
  {{- with .Values.podLabels }}{{ toYaml . | nindent 2 }}{{ end }}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "ppserve.env" -}}
{{- if .Values.apiKey.secretName }}
- name: PPSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Fail early when one pipeline cannot fit the worker groups at their largest. */}}
{{- define "ppserve.checkCapacity" -}}
{{- if eq .Values.engine.device "cuda" }}
{{- $gpus := 0 }}
{{- range .Values.workerGroups }}{{ $gpus = add $gpus (mul .gpusPerPod .maxReplicas) }}{{ end }}
{{- $tp := int (default 1 .Values.engine.tp) }}
{{- $need := mul (int .Values.engine.pp) $tp }}
{{- if lt (int $gpus) $need }}
{{- fail (printf "engine.pp=%v x engine.tp=%v needs %v GPUs, but the worker groups hold at most %v (gpusPerPod x maxReplicas)" .Values.engine.pp $tp $need $gpus) }}
{{- end }}
{{- $widest := 0 }}
{{- range .Values.workerGroups }}{{ if gt (int .gpusPerPod) $widest }}{{ $widest = int .gpusPerPod }}{{ end }}{{ end }}
{{- if gt $tp $widest }}
{{- fail (printf "engine.tp=%v: a stage's ranks share one node, but no worker group has more than %v GPUs per pod" $tp $widest) }}
{{- end }}
{{- end }}
{{- end }}
