{{/*
Shared pieces of the example-csi templates. Object names are fixed
(example-csi-*): the CSIDriver exists once per cluster, so does the release.
*/}}

{{- define "example-csi.driverName" -}}example.csi.k8s.io{{- end }}

{{/* Labels of every object: the one the kustomize overlays set, and Helm's. */}}
{{- define "example-csi.labels" -}}
app.kubernetes.io/part-of: example-csi
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Selector (and pod) labels of a workload: (dict "component" NAME). */}}
{{- define "example-csi.selectorLabels" -}}
app.kubernetes.io/name: example-csi
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "example-csi.central" -}}
{{- if has .Values.flavor (list "central" "central-attach") }}true{{ end }}
{{- end }}

{{/* image: "repository:tag" of an image value, (dict "image" VALUE "default" TAG). */}}
{{- define "example-csi.image" -}}
{{ .image.repository }}:{{ .image.tag | default .default }}
{{- end }}

{{- define "example-csi.driverImage" -}}
{{ include "example-csi.image" (dict "image" .Values.driver.image "default" (printf "v%s" .Chart.AppVersion)) }}
{{- end }}

{{/* The host path of the CSI socket, which the kubelet is told. */}}
{{- define "example-csi.socketDir" -}}
{{ .Values.kubeletDir }}/plugins/{{ include "example-csi.driverName" . }}
{{- end }}

{{/* The securityContext of every unprivileged container. */}}
{{- define "example-csi.restricted" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The settings every driver container starts with. */}}
{{- define "example-csi.driverCommonArgs" -}}
- --endpoint=$(CSI_ENDPOINT)
- --nodeid=$(NODE_ID)
- --drivername={{ include "example-csi.driverName" . }}
{{- end }}

{{- define "example-csi.driverEnv" -}}
- name: CSI_ENDPOINT
  value: unix:///csi/csi.sock
- name: NODE_ID
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}

{{/* The pools, state and logging flags of a driver that holds volumes. */}}
{{- define "example-csi.driverStorageArgs" -}}
{{- range .Values.pools }}
- --pool={{ .name }}={{ .path }}
{{- end }}
- --state-dir={{ .Values.dataDir }}/state
- --default-fstype={{ .Values.driver.defaultFsType }}
- --metrics-address=0.0.0.0:{{ .Values.metrics.port }}
- --log-format={{ .Values.driver.logFormat }}
- --log-level={{ .Values.driver.logLevel }}
{{- end }}

{{/* Optional flags: (dict "ctx" $ "controller" BOOL "node" BOOL), by the services served. */}}
{{- define "example-csi.driverOptionalArgs" -}}
{{- $d := .ctx.Values.driver }}
{{- if and .controller (kindIs "slice" $d.mutableParameters) }}
- --mutable-parameters={{ join "," $d.mutableParameters }}
{{- end }}
{{- if and .node $d.maxVolumesPerNode }}
- --max-volumes-per-node={{ $d.maxVolumesPerNode }}
{{- end }}
{{- if and .controller (not $d.expediteFreeze) }}
- --expedite-freeze=false
{{- end }}
{{- end }}

{{/* The driver's ports and livenessProbe: the livenessprobe sidecar's port, or its own metrics port. */}}
{{- define "example-csi.driverHealth" -}}
ports:
  {{- if not .Values.builtinSidecars }}
  # Served by the livenessprobe sidecar, probed here so that a failing
  # Probe restarts the driver container.
  - name: healthz
    containerPort: 9898
    protocol: TCP
  {{- end }}
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{ include "example-csi.driverProbe" . }}
{{- end }}

{{- define "example-csi.driverProbe" -}}
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ if .Values.builtinSidecars }}metrics{{ else }}healthz{{ end }}
  initialDelaySeconds: 10
  timeoutSeconds: 3
  periodSeconds: 10
  failureThreshold: 5
{{- end }}

{{/* hostPath volumes of the pools, made if missing (the driver refuses a missing pool directory). */}}
{{- define "example-csi.poolVolumes" -}}
- name: data-dir
  hostPath:
    path: {{ .Values.dataDir }}
    type: DirectoryOrCreate
{{- range .Values.pools }}
- name: pool-{{ .name }}
  hostPath:
    path: {{ .path }}
    type: DirectoryOrCreate
{{- end }}
{{- end }}

{{/* Mounts of the data directory and the pools: (dict "ctx" $ "propagation" MODE). */}}
{{- define "example-csi.poolMounts" -}}
- name: data-dir
  mountPath: {{ .ctx.Values.dataDir }}
  mountPropagation: {{ .propagation }}
{{- range .ctx.Values.pools }}
- name: pool-{{ .name }}
  mountPath: {{ .path }}
  mountPropagation: {{ $.propagation }}
{{- end }}
{{- end }}

{{/* A kubernetes-csi sidecar's image, pull policy, securityContext,
resources and socket mount: (dict "ctx" $ "sidecar" VALUES). */}}
{{- define "example-csi.sidecarCommon" -}}
image: {{ include "example-csi.image" (dict "image" .sidecar.image "default" "") }}
imagePullPolicy: {{ .sidecar.image.pullPolicy }}
securityContext:
  {{- include "example-csi.restricted" . | nindent 2 }}
resources:
  {{- toYaml .sidecar.resources | nindent 2 }}
{{- end }}

{{- define "example-csi.socketMount" -}}
- name: socket-dir
  mountPath: /csi
{{- end }}

{{- define "example-csi.namespaceEnv" -}}
- name: NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end }}

{{- define "example-csi.leaderElectionArgs" -}}
- --leader-election
- --leader-election-namespace=$(NAMESPACE)
{{- end }}

{{/* A sidecar that elects a leader (resizer, attacher): (dict "ctx" $ "name" NAME "sidecar" VALUES). */}}
{{- define "example-csi.electedSidecar" -}}
- name: {{ .name }}
  {{- include "example-csi.sidecarCommon" . | nindent 2 }}
  args:
    - --csi-address=/csi/csi.sock
    - --v={{ .ctx.Values.sidecars.logLevel }}
    - --timeout=60s
    {{- include "example-csi.leaderElectionArgs" . | nindent 4 }}
  env:
    {{- include "example-csi.namespaceEnv" . | nindent 4 }}
  volumeMounts:
    {{- include "example-csi.socketMount" . | nindent 4 }}
{{- end }}

{{- define "example-csi.livenessProbeSidecar" -}}
{{- if not .Values.builtinSidecars }}
- name: liveness-probe
  {{- include "example-csi.sidecarCommon" (dict "ctx" . "sidecar" .Values.sidecars.livenessProbe) | nindent 2 }}
  args:
    - --csi-address=/csi/csi.sock
    - --http-endpoint=:9898
    - --probe-timeout=3s
  volumeMounts:
    {{- include "example-csi.socketMount" . | nindent 4 }}
{{- end }}
{{- end }}

{{/* Scheduling of a workload's pods from its values (controller, node, resizer). */}}
{{- define "example-csi.scheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "example-csi.pullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Checks that JSON schema cannot express. */}}
{{- define "example-csi.validate" -}}
{{- include "example-csi.checkPath" (dict "what" "kubeletDir" "path" .Values.kubeletDir) }}
{{- include "example-csi.checkPath" (dict "what" "dataDir" "path" .Values.dataDir) }}
{{- range .Values.pools }}
{{- include "example-csi.checkPath" (dict "what" (printf "pools: %s: the path" .name) "path" .path) }}
{{- end }}
{{- $names := list }}
{{- $paths := list .Values.dataDir }}
{{- range .Values.pools }}
{{- if has .name $names }}
{{- fail (printf "pools: the name %q is given twice" .name) }}
{{- end }}
{{- if has .path $paths }}
{{- fail (printf "pools: %s: the path %s is already dataDir or another pool's" .name .path) }}
{{- end }}
{{- $names = append $names .name }}
{{- $paths = append $paths .path }}
{{- end }}
{{- range .Values.storageClasses }}
{{- if and .pool (not (has .pool $names)) }}
{{- fail (printf "storageClasses: %s names pool %q, which is not in pools (%s)" .name .pool (join ", " $names)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Leader election Leases in the release's namespace for a ServiceAccount: (dict "ctx" $ "sa" NAME). */}}
{{- define "example-csi.leaseRole" }}
# Leader election of the sidecars (Lease objects in this namespace only).
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ .sa }}-leases
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "example-csi.labels" .ctx | nindent 4 }}
rules:
  - apiGroups: ["coordination.k8s.io"]
    resources: ["leases"]
    verbs: ["get", "watch", "list", "delete", "update", "create"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ .sa }}-leases
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "example-csi.labels" .ctx | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ .sa }}-leases
subjects:
  - kind: ServiceAccount
    name: {{ .sa }}
    namespace: {{ .ctx.Release.Namespace }}
{{- end }}

{{/* The Role of a provisioner with --enable-capacity: CSIStorageCapacity objects
in the release's namespace, and the objects it reads to find their owner.
(dict "ctx" $ "sa" NAME "owner" WHAT "replicasets" BOOL) */}}
{{- define "example-csi.capacityRole" }}
# Storage capacity tracking: CSIStorageCapacity objects in this namespace,
# {{ .owner }}
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ .sa }}-capacity
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "example-csi.labels" .ctx | nindent 4 }}
rules:
  - apiGroups: ["storage.k8s.io"]
    resources: ["csistoragecapacities"]
    verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["get"]
  {{- if .replicasets }}
  - apiGroups: ["apps"]
    resources: ["replicasets"]
    verbs: ["get"]
  {{- end }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ .sa }}-capacity
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "example-csi.labels" .ctx | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ .sa }}-capacity
subjects:
  - kind: ServiceAccount
    name: {{ .sa }}
    namespace: {{ .ctx.Release.Namespace }}
{{- end }}

{{/* A host path the driver gets as a flag: absolute (the schema), plain, and
free of ',' (--pool takes comma-separated lists). (dict "what" NAME "path" PATH) */}}
{{- define "example-csi.checkPath" -}}
{{- if or (not (regexMatch "^(/[^/,]+)+$" .path)) (regexMatch "(^|/)[.][.]?(/|$)" .path) }}
{{- fail (printf "%s %q must be an absolute path without '.' or '..' parts, '//', a trailing '/' or ','" .what .path) }}
{{- end }}
{{- end }}
