{{- define "moemesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "moemesh.labels" -}}
app.kubernetes.io/name: moemesh
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "moemesh.operatorName" -}}{{ include "moemesh.fullname" . }}-operator{{- end -}}
{{- define "moemesh.redisName" -}}{{ include "moemesh.fullname" . }}-redis{{- end -}}

{{- define "moemesh.redisSecretName" -}}
{{- if .Values.redis.existingSecret -}}{{ .Values.redis.existingSecret }}{{- else -}}{{ include "moemesh.redisName" . }}{{- end -}}
{{- end -}}

{{- define "moemesh.redisSecretEnabled" -}}
{{- if or .Values.redis.existingSecret .Values.redis.managed -}}true{{- end -}}
{{- end -}}

{{- define "moemesh.redisUrl" -}}
{{- if .Values.redis.managed -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "moemesh.redisName" .) .Release.Namespace -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.managed is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "moemesh.servicesImage" -}}
{{- printf "%s:%s" .Values.image.services.repository (default .Chart.AppVersion .Values.image.services.tag) -}}
{{- end -}}

{{- define "moemesh.podSecurityContext" -}}
runAsNonRoot: true
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "moemesh.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* NetworkPolicy ingress rule: Prometheus (networkPolicy.monitoring) to the metrics port;
     no selector given = the namespace named "monitoring". */}}
{{- define "moemesh.monitoringIngress" -}}
{{- $monitoring := .Values.networkPolicy.monitoring -}}
{{- $peer := dict -}}
{{- with $monitoring.namespaceSelector }}{{ $_ := set $peer "namespaceSelector" . }}{{ end -}}
{{- with $monitoring.podSelector }}{{ $_ := set $peer "podSelector" . }}{{ end -}}
{{- if not $peer }}
{{- $_ := set $peer "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" "monitoring")) }}
{{- end -}}
{{- toYaml (list (dict "from" (list $peer) "ports" (list (dict "port" "metrics" "protocol" "TCP")))) -}}
{{- end -}}

{{/* One line naming the default mesh's model source, for NOTES.txt. */}}
{{- define "moemesh.sourceSummary" -}}
{{- $source := .Values.mesh.model.source | default (dict "builtin" "smollm2") -}}
{{- if $source.builtin }}builtin {{ $source.builtin }}
{{- else if $source.pvc }}PVC {{ $source.pvc.claimName }}, path {{ $source.pvc.path }}
{{- else if $source.hostPath }}node path {{ $source.hostPath.path }}
{{- else if $source.hf }}Hugging Face {{ $source.hf.repo }}@{{ $source.hf.revision | default "main" }}
{{- end -}}
{{- end -}}
