{{/* The release's name, cut to what Kubernetes allows in a name. */}}
{{- define "orchestr.fullname" -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "orchestr.labels" -}}
app.kubernetes.io/name: orchestr
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "orchestr.selector" -}}
app.kubernetes.io/name: orchestr
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The Secret holding `token` and `metrics-token`. */}}
{{- define "orchestr.secret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-tokens" (include "orchestr.fullname" .)) -}}
{{- end -}}

{{- define "orchestr.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/* The head's control-plane address, through its StatefulSet's headless Service. */}}
{{- define "orchestr.headAddress" -}}
{{- $name := include "orchestr.fullname" . -}}
{{- printf "%s-head-0.%s-head.%s.svc:%d" $name $name .Release.Namespace (int .Values.head.port) -}}
{{- end -}}

{{- define "orchestr.tokenEnv" -}}
- name: ORCHESTR_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "orchestr.secret" . }}
      key: token
{{- end -}}
