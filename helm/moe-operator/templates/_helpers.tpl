{{/* Chart name, truncated to the 63 characters Kubernetes names allow. */}}
{{- define "moe-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, with the chart name unless the release already contains it. */}}
{{- define "moe-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "moe-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Recommended labels (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/). */}}
{{- define "moe-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "moe-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: moe-operator
{{- end -}}

{{- define "moe-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "moe-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs, and nothing else. */}}
{{- define "moe-operator.rules" -}}
- apiGroups: [serving.moe.io]
  resources: [moedeployments]
  verbs: [get, list, watch, patch, update]
- apiGroups: [serving.moe.io]
  resources: [moedeployments/status]
  verbs: [get, patch, update]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- if .Values.kuberay.enabled }}
- apiGroups: [ray.io]
  resources: [rayservices]
  verbs: [get, list, watch, create, update, patch, delete]
{{- end }}
{{- if .Values.readTokenSecrets }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
{{- end -}}

{{/* Peering (HA): kopf's peering objects, cluster-wide or per namespace. */}}
{{- define "moe-operator.peeringRules" -}}
{{- if gt (int .Values.replicas) 1 }}
- apiGroups: [kopf.dev]
  resources: [{{ if .Values.watchNamespaces }}kopfpeerings{{ else }}clusterkopfpeerings{{ end }}]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}
