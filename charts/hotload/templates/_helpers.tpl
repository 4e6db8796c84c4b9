{{/* The chart name, or nameOverride. */}}
{{- define "hotload.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>" (or fullnameOverride), the prefix of every object's name. */}}
{{- define "hotload.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels that select the operator pod (immutable once installed). */}}
{{- define "hotload.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hotload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object the chart creates. */}}
{{- define "hotload.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "hotload.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hotload
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "hotload.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hotload.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: the digest wins, the tag defaults to
the chart's appVersion. Call with (dict "image" .Values.image "chart" .Chart). */}}
{{- define "hotload.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* The subject every operator binding names. */}}
{{- define "hotload.subject" -}}
- kind: ServiceAccount
  name: {{ include "hotload.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}

{{/* An alert's labels: its severity, then alerts.alertLabels. Call with (list $ "warning"). */}}
{{- define "hotload.alertLabels" -}}
severity: {{ index . 1 }}
{{- with (index . 0).Values.alerts.alertLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of the regional cache's objects (hotload.labels with its own component). */}}
{{- define "hotload.regionalCacheLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "hotload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: regional-cache
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hotload
{{- end }}
