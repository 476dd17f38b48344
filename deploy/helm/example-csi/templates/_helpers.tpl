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

{{/* The cluster flavor's mesh: where each node's agent listens (the router
dials it, the NetworkPolicy lets the controller pods reach it), the Secret of
the mesh authorities (the controller's, the nodes') and where they are
mounted. */}}
{{- define "example-csi.agentPort" -}}9820{{- end }}
{{- define "example-csi.meshSecret" -}}example-csi-mesh{{- end }}
{{- define "example-csi.meshNodeSecret" -}}example-csi-mesh-node{{- end }}
{{- define "example-csi.meshDir" -}}/etc/example-csi/mesh{{- end }}

{{/* A mesh authority's Secret as a pod volume: (dict "secret" NAME "optional" BOOL "mode" OCTAL). */}}
{{- define "example-csi.meshVolume" -}}
- name: mesh
  secret:
    secretName: {{ .secret }}
    {{- if .optional }}
    optional: true
    {{- end }}
    defaultMode: {{ .mode }}
{{- end }}

{{- define "example-csi.meshMount" -}}
- name: mesh
  mountPath: {{ include "example-csi.meshDir" . }}
  readOnly: true
{{- end }}

{{/* image: "repository:tag", or "repository:tag@digest" where the value
names a digest, of an image value, (dict "image" VALUE "default" TAG). */}}
{{- define "example-csi.image" -}}
{{ .image.repository }}:{{ .image.tag | default .default }}{{ with .image.digest }}@{{ . }}{{ end }}
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

{{/* A container that runs as uid 65532 in the socket's group, as the
sidecars do but node-driver-registrar. */}}
{{- define "example-csi.nonRoot" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: {{ .Values.socketGroup }}
{{- end }}

{{/* Every driver instance gives its socket to the sidecars' group. */}}
{{- define "example-csi.socketGroupArg" -}}
# The socket (0660) goes to the group the non-root sidecars run in.
- --socket-group={{ .Values.socketGroup }}
{{- end }}

{{/* The settings every driver container starts with. */}}
{{- define "example-csi.driverCommonArgs" -}}
- --endpoint=$(CSI_ENDPOINT)
{{ include "example-csi.socketGroupArg" . }}
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

{{/* Optional flags: (dict "ctx" $ "controller" BOOL "node" BOOL "router" BOOL), by
the services served. The router holds no volumes, but offers ControllerModifyVolume
only when parameters are mutable. */}}
{{- define "example-csi.driverOptionalArgs" -}}
{{- $d := .ctx.Values.driver }}
{{- if and (or .controller .router) (kindIs "slice" $d.mutableParameters) }}
- --mutable-parameters={{ join "," $d.mutableParameters }}
{{- end }}
{{- if and .node $d.maxVolumesPerNode }}
- --max-volumes-per-node={{ $d.maxVolumesPerNode }}
{{- end }}
{{- if and .controller (not $d.expediteFreeze) }}
- --expedite-freeze=false
{{- end }}
{{- end }}

{{/* The driver's ports and livenessProbe: the livenessprobe sidecar's port, or
its own metrics port; with "agent", the node agent's port of the cluster flavor.
(dict "ctx" $ "agent" BOOL) */}}
{{- define "example-csi.driverHealth" -}}
ports:
  {{- if .agent }}
  - name: agent
    containerPort: {{ include "example-csi.agentPort" . }}
    protocol: TCP
  {{- end }}
  {{- if not .ctx.Values.builtinSidecars }}
  # Served by the livenessprobe sidecar, probed here so that a failing
  # Probe restarts the driver container.
  - name: healthz
    containerPort: 9898
    protocol: TCP
  {{- end }}
  - name: metrics
    containerPort: {{ .ctx.Values.metrics.port }}
    protocol: TCP
{{ include "example-csi.driverProbe" .ctx }}
{{- end }}

{{- define "example-csi.driverProbe" -}}
{{ include "example-csi.probe" (dict "port" (ternary "metrics" "healthz" .Values.builtinSidecars)) }}
{{- end }}

{{/* The driver container's livenessProbe on a named port: (dict "port" NAME). */}}
{{- define "example-csi.probe" -}}
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
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

{{/* A kubernetes-csi sidecar's image, pull policy, securityContext (uid
65532 in the socket's group, or with "root" the image's user, root) and
resources: (dict "ctx" $ "sidecar" VALUES ["root" true]). */}}
{{- define "example-csi.sidecarCommon" -}}
image: {{ include "example-csi.image" (dict "image" .sidecar.image "default" "") }}
imagePullPolicy: {{ .sidecar.image.pullPolicy }}
securityContext:
  {{- include "example-csi.restricted" . | nindent 2 }}
  {{- if not .root }}
  {{- include "example-csi.nonRoot" .ctx | nindent 2 }}
  {{- end }}
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

{{/* How fast a controller sidecar may call the API server (root context). */}}
{{- define "example-csi.kubeApiArgs" -}}
- --kube-api-qps={{ .Values.sidecars.kubeApi.qps }}
- --kube-api-burst={{ .Values.sidecars.kubeApi.burst }}
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
    {{- include "example-csi.kubeApiArgs" .ctx | nindent 4 }}
  env:
    {{- include "example-csi.namespaceEnv" . | nindent 4 }}
  volumeMounts:
    {{- include "example-csi.socketMount" . | nindent 4 }}
{{- end }}

{{/* The external-provisioner of a controller Deployment (central, cluster):
leader-elected, publishing CSIStorageCapacity owned by the Deployment.
(dict "ctx" $ "strictTopology" BOOL) */}}
{{- define "example-csi.controllerProvisioner" -}}
- name: csi-provisioner
  {{- include "example-csi.sidecarCommon" (dict "ctx" .ctx "sidecar" .ctx.Values.sidecars.provisioner) | nindent 2 }}
  args:
    - --csi-address=/csi/csi.sock
    - --v={{ .ctx.Values.sidecars.logLevel }}
    - --timeout=60s
    - --extra-create-metadata
    {{- include "example-csi.leaderElectionArgs" . | nindent 4 }}
    {{- include "example-csi.kubeApiArgs" .ctx | nindent 4 }}
    {{- if .strictTopology }}
    # The node the scheduler chose is the one node a volume may
    # go to: the router makes it there (and a copy of another
    # node's volume, there).
    - --strict-topology
    {{- end }}
    # Publish CSIStorageCapacity for the pools, owned by the
    # Deployment (2: pod, ReplicaSet, Deployment), so they outlive
    # a replaced pod and go with the release.
    - --enable-capacity
    - --capacity-ownerref-level=2
  env:
    {{- include "example-csi.namespaceEnv" . | nindent 4 }}
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
  volumeMounts:
    {{- include "example-csi.socketMount" . | nindent 4 }}
{{- end }}

{{/* The external-snapshotter of a controller Deployment, leader-elected, with
volume group snapshots. */}}
{{- define "example-csi.controllerSnapshotter" -}}
- name: csi-snapshotter
  {{- include "example-csi.sidecarCommon" (dict "ctx" . "sidecar" .Values.sidecars.snapshotter) | nindent 2 }}
  args:
    - --csi-address=/csi/csi.sock
    - --v={{ .Values.sidecars.logLevel }}
    # A snapshot without reflink is a full (sparse-aware) copy.
    - --timeout=300s
    - --extra-create-metadata
    {{- include "example-csi.leaderElectionArgs" . | nindent 4 }}
    {{- include "example-csi.kubeApiArgs" . | nindent 4 }}
    # GA and on by default since v8.7.0; said here so that an
    # older snapshotter put in its place still makes them.
    - --feature-gates=CSIVolumeGroupSnapshot=true
  env:
    {{- include "example-csi.namespaceEnv" . | nindent 4 }}
  volumeMounts:
    {{- include "example-csi.socketMount" . | nindent 4 }}
{{- end }}

{{- define "example-csi.livenessProbeSidecar" -}}
{{- if not .Values.builtinSidecars }}
{{- include "example-csi.livenessProbeContainer" . }}
{{- end }}
{{- end }}

{{/* The livenessprobe sidecar, whatever builtinSidecars says (the router has
no /healthz of its own). */}}
{{- define "example-csi.livenessProbeContainer" -}}
- name: liveness-probe
  {{- include "example-csi.sidecarCommon" (dict "ctx" . "sidecar" .Values.sidecars.livenessProbe) | nindent 2 }}
  args:
    - --csi-address=/csi/csi.sock
    - --http-endpoint=:9898
    - --probe-timeout=3s
  volumeMounts:
    {{- include "example-csi.socketMount" . | nindent 4 }}
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
{{- if and .Values.snapshotMetadata.enabled (not (include "example-csi.central" .)) }}
{{- fail "snapshotMetadata.enabled needs a central flavor: in the distributed flavor each node's driver holds that node's snapshots, which one service address cannot reach" }}
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
