{{/* The release's full name, used for every object (63 characters at most). */}}
{{- define "kvfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator's pods; immutable once the Deployment exists. */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels on every object the chart creates. */}}
{{- define "kvfleet.labels" -}}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The uid and gid the operator runs as: the user docker/operator.Dockerfile creates. It is
kvfleet.contract.KVFLEET_UID; tests/deploy/test_one_uid.py keeps every copy equal. */}}
{{- define "kvfleet.uid" -}}10001{{- end -}}

{{/* The Lease the replicas elect the active one through (--lease-name; the leader-election
Role grants get and update on this name only). */}}
{{- define "kvfleet.leaseName" -}}{{ include "kvfleet.fullname" . }}{{- end -}}

{{/* What the operator does to InferenceServices and their children: the rules of the
ClusterRole when every namespace is watched, of one Role per namespace with watchNamespaces.
Each verb is one the operator sends (tests/operator/test_rbac_coverage.py runs it and checks
both ways); manifests/rbac.yaml holds the same rules (tests/deploy compares them). */}}
{{- define "kvfleet.namespacedRules" -}}
# The InferenceServices: kopf lists and watches them and patches its bookkeeping annotations
# onto them; the handlers and the autoscaler read one (get).
- apiGroups: [kvfleet.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
# Status is written through the subresource, never with the spec.
- apiGroups: [kvfleet.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
# The children, server-side applied (a PATCH; the API server also checks `create` when that
# PATCH creates the object). kopf watches Deployments and Services to put back drift; the
# autoscaler reads the Deployment and merge-patches its replicas (not deployments/scale).
# delete: the router's Deployment and its <name>-replicas Service when spec.router is
# turned off.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [list, watch, create, patch, delete]
# spec.router (mode kvfleet): the router's ServiceAccount, and a Role letting it list pods
# in its namespace with its RoleBinding; applied, deleted when the router is turned off.
# Granting `list pods` needs no `escalate`/`bind`: the operator holds it (below).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create, patch, delete]
# Scale to zero: the router's Role may read and patch the runtime Deployment's scale (its
# activator wakes it, 0 -> 1). A Role grants only what its creator holds, so the operator
# holds these too; it never uses them itself.
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch]
# spec.router (mode inferencePool): GIE's InferencePool, where its CRD is installed.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [create, patch, delete]
# The PodDisruptionBudget for more than one replica: read, applied, deleted when replicas go
# down to one (garbage collection removes it with its InferenceService).
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
# Pods: kopf watches them for status (crash loops); the reconciler and the autoscaler list them.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# The autoscaler's ScaledUp/ScaledDown Events and the LoRA adapters' (core/v1; kopf posts
# none: its log-to-Event posting is off).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# spec.loras with spec.apiKeySecretRef: the operator loads adapters through the runtime's
# /v1 API, which wants the pods' API key, so it reads that one Secret (get, never list or
# watch). It adds no reach: what creates Deployments in a namespace can hand a pod any of
# its Secrets already.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end -}}
