{{- /* The worker's pods: one pod per worker (a StatefulSet), or a group of
worker.nodes pods per worker (a LeaderWorkerSet, kubernetes-sigs/lws).
Call each with (dict "root" $ "component" "worker" "module" ...). */ -}}

{{/* Selector labels that keep a Service to the leaders of worker groups (LeaderWorkerSet's worker-index label, 0 on the leader pod); none for one-pod workers. */}}
{{- define "stormserve.leadersOnly" -}}
{{- if gt (int .root.Values.worker.nodes) 1 -}}
leaderworkerset.sigs.k8s.io/worker-index: "0"
{{- end -}}
{{- end -}}

{{/* The container of rank 0: it serves WorkerService (and starts its pod's other ranks). */}}
{{- define "stormserve.workerContainer" -}}
{{- $root := .root -}}
{{- $nodes := int $root.Values.worker.nodes -}}
- name: worker
  image: {{ include "stormserve.workerImage" $root }}
  {{- include "stormserve.containerCommon" . | nindent 2 }}
  env:
    {{- include "stormserve.env" . | nindent 4 }}
    - name: STORMSERVE_DEVICE
      value: {{ $root.Values.worker.accelerator | quote }}
    - name: STORMSERVE_TENSOR_PARALLEL_SIZE
      value: {{ mul $nodes $root.Values.worker.tensorParallelSize | quote }}
    - name: STORMSERVE_STEP_PORT
      value: {{ $root.Values.ports.workerSteps | quote }}
    {{- if gt $nodes 1 }}
    - name: STORMSERVE_GROUP_PORT
      value: {{ $root.Values.worker.groupPort | quote }}
    {{- end }}
    {{- if hasKey . "role" }}
    # The pool's role (worker.disaggregation); the scheduler reads it from Describe.
    - name: STORMSERVE_ROLE
      value: {{ .role | quote }}
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- if not (hasKey .values.env "KV_TRANSFER_HOST") }}
    # Where the other workers' transfer engines reach this one's (on a port it picks).
    - name: STORMSERVE_KV_TRANSFER_HOST
      value: $(POD_IP)
    {{- end }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ $root.Values.ports.worker }}
      protocol: TCP
    # The step channel: the scheduler reaches it at the pod's IP and the port Describe reports.
    - name: steps
      containerPort: {{ $root.Values.ports.workerSteps }}
      protocol: TCP
    {{- include "stormserve.metricsContainerPort" $root | nindent 4 }}
    {{- with include "stormserve.healthContainerPort" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if gt $nodes 1 }}
    # Where the group's other ranks meet rank 0 (services/worker/pods.py).
    - name: group-store
      containerPort: {{ $root.Values.worker.groupPort }}
      protocol: TCP
    - name: group-steps
      containerPort: {{ add1 $root.Values.worker.groupPort }}
      protocol: TCP
    {{- end }}
  # The worker listens at once and answers NOT_SERVING until the model is
  # loaded and warmed up: allow worker.startupSeconds for that.
  startupProbe:
    grpc:
      port: {{ include "stormserve.grpcProbePort" (dict "root" $root "port" $root.Values.ports.worker) }}
      service: stormserve.worker.v1.WorkerService
    periodSeconds: 10
    failureThreshold: {{ div $root.Values.worker.startupSeconds 10 | max 1 }}
  {{- include "stormserve.grpcProbes" (dict "root" $root "port" $root.Values.ports.worker "service" "stormserve.worker.v1.WorkerService") | nindent 2 }}
  volumeMounts:
    {{- include "stormserve.scratchMounts" $root | nindent 4 }}
    {{- with include "stormserve.modelMount" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "stormserve.internalTlsMount" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The container of a follower pod: the group's other ranks, which serve nothing (no ports, no probes). */}}
{{- define "stormserve.followerContainer" -}}
{{- $root := .root -}}
{{- $nodes := int $root.Values.worker.nodes -}}
- name: follower
  image: {{ include "stormserve.workerImage" $root }}
  {{- include "stormserve.containerCommon" . | nindent 2 }}
  env:
    {{- include "stormserve.env" . | nindent 4 }}
    - name: STORMSERVE_DEVICE
      value: {{ $root.Values.worker.accelerator | quote }}
    - name: STORMSERVE_TENSOR_PARALLEL_SIZE
      value: {{ mul $nodes $root.Values.worker.tensorParallelSize | quote }}
    - name: STORMSERVE_STEP_PORT
      value: {{ $root.Values.ports.workerSteps | quote }}
    - name: STORMSERVE_GROUP_PORT
      value: {{ $root.Values.worker.groupPort | quote }}
  volumeMounts:
    {{- include "stormserve.scratchMounts" $root | nindent 4 }}
    {{- with include "stormserve.modelMount" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "stormserve.internalTlsMount" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* A worker pod's spec around one container (the include named by "container"). */}}
{{- define "stormserve.workerPodSpec" -}}
{{- $root := .root -}}
automountServiceAccountToken: false
# Service links would put STORMSERVE_<SERVICE>_PORT-style variables, the
# services' own setting prefix, into every container of a release named stormserve.
enableServiceLinks: false
{{- include "stormserve.podSpecCommon" . | trim | nindent 0 }}
containers:
  {{- include .container . | nindent 2 }}
volumes:
  {{- include "stormserve.scratchVolumes" $root | nindent 2 }}
  {{- with include "stormserve.modelVolume" $root | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with include "stormserve.internalTlsVolume" $root | trim }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* Workers that span pods: a LeaderWorkerSet whose groups of worker.nodes
pods each run one worker of nodes × tensorParallelSize ranks. The leader pod
runs rank 0 and its pod's ranks; each other pod its own ranks. Its name is
not the worker Service's: LeaderWorkerSet makes a headless Service of its own
name that publishes every pod of a group, ready or not (the address
LWS_LEADER_ADDRESS names, which followers reach before the leader is ready). */}}
{{- define "stormserve.workerGroups" -}}
{{- $root := .root -}}
{{- $w := $root.Values.worker -}}
{{- $follower := merge (dict "module" "worker.follower" "container" "stormserve.followerContainer") (omit . "module" "container") }}
{{- $leader := merge (dict "module" "worker" "container" "stormserve.workerContainer") (omit . "module" "container") }}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: {{ include "stormserve.workerGroupsName" . }}
  labels:
    {{- include "stormserve.componentLabels" . | nindent 4 }}
spec:
  replicas: {{ $w.replicas }}
  # The leader is ready once every rank of its group has joined: the other
  # pods start with it, not after it (LeaderReady would wait forever).
  startupPolicy: LeaderCreated
  leaderWorkerTemplate:
    size: {{ $w.nodes }}
    # A pod or container of a group that restarts restarts the whole group:
    # the ranks of a torch.distributed group cannot rejoin one by one.
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      {{- /* The label LeaderWorkerSet puts on leader pods, here too: the worker Service's selector visibly matches this template. */}}
      {{- include "stormserve.podMetadata" (merge (dict "labels" (dict "leaderworkerset.sigs.k8s.io/worker-index" "0")) .) | nindent 6 }}
      spec:
        {{- include "stormserve.workerPodSpec" $leader | nindent 8 }}
    workerTemplate:
      {{- include "stormserve.podMetadata" . | nindent 6 }}
      spec:
        {{- include "stormserve.workerPodSpec" $follower | nindent 8 }}
{{- end -}}

{{/* The LeaderWorkerSet's name (and its own headless Service's); call with the worker context. */}}
{{- define "stormserve.workerGroupsName" -}}
{{- printf "%s-lws" (include "stormserve.component" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}
