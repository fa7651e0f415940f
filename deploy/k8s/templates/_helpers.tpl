{{/* Names: <release>-stormserve (or the release name when it holds the chart name), 63 characters at most. */}}
{{- define "stormserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stormserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: <fullname>-<component> (50 + 10 characters leave room for pod suffixes);
with a "group" (scheduler.groups > 1), <fullname>-<component>-<group>. A component's context is
(dict "root" $ "component" "worker"), with "group" in a serving group, and for a worker pool of
worker.disaggregation also "role" (its label) and "values" (the pool's worker values, read in
place of .Values.worker; worker.yaml). */}}
{{- define "stormserve.component" -}}
{{- if hasKey . "group" -}}
{{- printf "%s-%s-%d" (include "stormserve.fullname" .root) .component (int .group) -}}
{{- else -}}
{{- printf "%s-%s" (include "stormserve.fullname" .root) .component -}}
{{- end -}}
{{- end -}}

{{- define "stormserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stormserve.labels" -}}
helm.sh/chart: {{ include "stormserve.chart" . }}
app.kubernetes.io/name: {{ include "stormserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stormserve
{{- end -}}

{{/* Selector labels of one component; call with (dict "root" $ "component" "edge"). */}}
{{- define "stormserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stormserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- include "stormserve.groupLabel" . }}
{{- end -}}

{{- define "stormserve.componentLabels" -}}
{{ include "stormserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- include "stormserve.groupLabel" . }}
{{- end -}}

{{/* The serving group of a scheduler or worker, when scheduler.groups > 1; and the
role of a worker pool, with worker.disaggregation.enabled (the worker Service, whose
context has no role, selects both pools). */}}
{{- define "stormserve.groupLabel" -}}
{{- if hasKey . "group" }}
stormserve.io/group: {{ .group | quote }}
{{- end -}}
{{- if hasKey . "role" }}
stormserve.io/role: {{ .role }}
{{- end -}}
{{- end -}}

{{- define "stormserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "stormserve.workerImage" -}}
{{- $repository := default .Values.image.repository .Values.worker.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.worker.image.tag -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/* host:port of a component's Service, e.g. the tokenizer for the edge. */}}
{{- define "stormserve.address" -}}
{{- printf "%s:%d" (include "stormserve.component" .) (index .root.Values.ports .component | int) -}}
{{- end -}}

{{/* host:port of every serving group's scheduler Service, comma-separated (scheduler.groups > 1). */}}
{{- define "stormserve.schedulerAddresses" -}}
{{- $addresses := list -}}
{{- range $g := until (int .Values.scheduler.groups) -}}
{{- $addresses = append $addresses (include "stormserve.address" (dict "root" $ "component" "scheduler" "group" (toString $g))) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* "true" when the tokenizers find the serving groups' schedulers through the EndpointSlices
of the schedulers' Service (scheduler.groups > 1, tokenizer.schedulerDiscovery=endpointslices). */}}
{{- define "stormserve.schedulerDiscovery" -}}
{{- if and (gt (int (default 1 .Values.scheduler.groups)) 1) (eq .Values.tokenizer.schedulerDiscovery "endpointslices") -}}
true
{{- end -}}
{{- end -}}

{{/* The headless Service of every serving group's scheduler pod, whose EndpointSlices the tokenizers watch. */}}
{{- define "stormserve.schedulersService" -}}
{{- printf "%s-schedulers" (include "stormserve.fullname" .) -}}
{{- end -}}

{{/* A Role that may read EndpointSlices in the release's namespace (get, list, watch: nothing
else), bound to the ServiceAccount of one component; call with its context
(dict "root" $ "component" "scheduler"). */}}
{{- define "stormserve.endpointSliceReader" -}}
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ include "stormserve.component" . }}
  labels:
    {{- include "stormserve.componentLabels" . | nindent 4 }}
rules:
  - apiGroups: ["discovery.k8s.io"]
    resources: ["endpointslices"]
    verbs: ["get", "list", "watch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ include "stormserve.component" . }}
  labels:
    {{- include "stormserve.componentLabels" . | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ include "stormserve.component" . }}
subjects:
  - kind: ServiceAccount
    name: {{ include "stormserve.component" . }}
    namespace: {{ .root.Release.Namespace }}
{{- end -}}

{{/* The headless Service through which Envoy reaches each pod of a component (edge, tokenizer). */}}
{{- define "stormserve.envoyUpstream" -}}
{{- printf "%s-pods" (include "stormserve.component" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stormserve.envoyUpstreamAddress" -}}
{{- printf "%s:%d" (include "stormserve.envoyUpstream" .) (index .root.Values.ports .component | int) -}}
{{- end -}}

{{/* One component's drain timeout in seconds. */}}
{{- define "stormserve.drainTimeout" -}}
{{- $c := get . "values" | default (index .root.Values .component) -}}
{{- if kindIs "invalid" $c.drainTimeoutSeconds -}}
{{- .root.Values.drain.timeoutSeconds | int -}}
{{- else -}}
{{- $c.drainTimeoutSeconds | int -}}
{{- end -}}
{{- end -}}

{{/* preStop sleep + drain timeout + margin: Kubernetes never kills a pod still draining. */}}
{{- define "stormserve.terminationGrace" -}}
{{- add .root.Values.drain.preStopSleepSeconds (include "stormserve.drainTimeout" . | int) .root.Values.drain.graceMarginSeconds -}}
{{- end -}}

{{/* The pod-level settings every component shares; call with (dict "root" $ "component" "edge"). */}}
{{- define "stormserve.podSpecCommon" -}}
{{- $c := get . "values" | default (index .root.Values .component) -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ include "stormserve.terminationGrace" . }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod template metadata: selector labels (and .labels, when given), the config checksum (pods restart when the ConfigMap changes), annotations. */}}
{{- define "stormserve.podMetadata" -}}
{{- $c := get . "values" | default (index .root.Values .component) -}}
metadata:
  labels:
    {{- include "stormserve.componentLabels" . | nindent 4 }}
    {{- with .root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
    {{- with .root.Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $c.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* Container settings every component shares: image, security, config, drain, scratch mounts. */}}
{{- define "stormserve.containerCommon" -}}
{{- $c := get . "values" | default (index .root.Values .component) -}}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
command: ["python", "-m", "services.{{ .module }}"]
securityContext:
  {{- toYaml .root.Values.securityContext | nindent 2 }}
envFrom:
  - configMapRef:
      name: {{ include "stormserve.fullname" .root }}-config
resources:
  {{- include "stormserve.resources" . | nindent 2 }}
lifecycle:
  preStop:
    exec:
      {{- if eq .component "envoy" }}
      # Envoy cuts its streams on SIGTERM: drain it gracefully first (services/envoy/drain.py).
      command: ["sh", "-c", "sleep {{ .root.Values.drain.preStopSleepSeconds }} && exec python -m services.envoy --drain"]
      {{- else }}
      command: ["sleep", "{{ .root.Values.drain.preStopSleepSeconds }}"]
      {{- end }}
{{- end -}}

{{/* Env of one container: where it listens, its drain timeout, then its own extra settings. */}}
{{- define "stormserve.env" -}}
{{- $c := get . "values" | default (index .root.Values .component) -}}
- name: STORMSERVE_HOST
  value: {{ .root.Values.listenHost | quote }}
- name: STORMSERVE_PORT
  value: {{ index .root.Values.ports .component | quote }}
- name: STORMSERVE_DRAIN_TIMEOUT_S
  value: {{ include "stormserve.drainTimeout" . | quote }}
{{- if and .root.Values.metrics.enabled (ne .component "edge") }}
- name: STORMSERVE_METRICS_PORT
  value: {{ .root.Values.metrics.port | quote }}
{{- end }}
{{- if has .component (list "scheduler" "worker") }}
# The serving group, the `group` label of every metric this process exports.
- name: STORMSERVE_SERVING_GROUP
  value: {{ default "0" .group | quote }}
{{- end }}
{{- if and .root.Values.tls.internal.enabled (has .component (list "tokenizer" "scheduler" "worker")) }}
- name: STORMSERVE_HEALTH_PORT
  value: {{ .root.Values.tls.internal.healthPort | quote }}
{{- end }}
{{- with .root.Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ $.root.Values.tracing.insecure | toString | quote }}
- name: OTEL_SERVICE_NAME
  value: stormserve-{{ $.component }}
{{- end }}
# The root filesystem is read-only: libraries that write under ~ write to /tmp.
- name: HOME
  value: /tmp
{{- range $name, $value := $c.env }}
- name: STORMSERVE_{{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{- define "stormserve.scratchMounts" -}}
- name: cache
  mountPath: {{ .Values.cache.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "stormserve.scratchVolumes" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmp.sizeLimit }}
{{- end -}}

{{/* The model volume (none for the bundled model, which is in the image). */}}
{{- define "stormserve.modelMount" -}}
{{- if ne .Values.model.source "bundled" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "stormserve.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- end }}
{{- end -}}

{{/* Probes of a gRPC service: readiness on the standard health service with its full
service name (NOT_SERVING until it and the services behind it are ready, and while it
drains); liveness on the port alone, so that a pod waiting for the services behind it
is not restarted. With internal TLS the kubelet, which speaks plaintext gRPC only, asks
the plaintext health-only port. Call with (dict "root" $ "port" <grpc port> "service" <name>). */}}
{{- define "stormserve.grpcProbes" -}}
readinessProbe:
  grpc:
    port: {{ include "stormserve.grpcProbePort" . }}
    service: {{ .service }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  tcpSocket:
    port: grpc
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

{{/* The port a gRPC probe asks: the service's own, or with internal TLS its plaintext health-only port. */}}
{{- define "stormserve.grpcProbePort" -}}
{{- if .root.Values.tls.internal.enabled -}}
{{- .root.Values.tls.internal.healthPort -}}
{{- else -}}
{{- .port -}}
{{- end -}}
{{- end -}}

{{/* Internal mutual TLS (tls.internal): the Secret holding tls.crt, tls.key and ca.crt
(the operator's, or the one cert-manager fills from internal-tls.yaml's Certificate),
where every container reads it, and what the gRPC services add. */}}
{{- define "stormserve.internalTlsSecret" -}}
{{- default (printf "%s-internal-tls" (include "stormserve.fullname" .)) .Values.tls.internal.secretName -}}
{{- end -}}

{{/* API keys: the key file, mounted from its Secret in the edge and the tokenizer
(both check keys), so that an edited Secret reaches them without a restart. */}}
{{- define "stormserve.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.keys .Values.apiKeys.existingSecret }}true{{ end }}
{{- end -}}

{{- define "stormserve.apiKeysEnv" -}}
{{- if include "stormserve.apiKeysEnabled" . }}
- name: STORMSERVE_API_KEY_FILE
  value: /etc/stormserve/api-keys/{{ .Values.apiKeys.existingSecretKey }}
{{- end }}
{{- end -}}

{{- define "stormserve.apiKeysMount" -}}
{{- if include "stormserve.apiKeysEnabled" . }}
- name: api-keys
  mountPath: /etc/stormserve/api-keys
  readOnly: true
{{- end }}
{{- end -}}

{{- define "stormserve.apiKeysVolume" -}}
{{- if include "stormserve.apiKeysEnabled" . }}
- name: api-keys
  secret:
    secretName: {{ default (printf "%s-api-keys" (include "stormserve.fullname" .)) .Values.apiKeys.existingSecret }}
{{- end }}
{{- end -}}

{{- define "stormserve.internalTlsDir" -}}
/etc/stormserve/internal-tls
{{- end -}}

{{- define "stormserve.internalTlsMount" -}}
{{- if .Values.tls.internal.enabled }}
- name: internal-tls
  mountPath: {{ include "stormserve.internalTlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "stormserve.internalTlsVolume" -}}
{{- if .Values.tls.internal.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "stormserve.internalTlsSecret" . }}
{{- end }}
{{- end -}}

{{- define "stormserve.healthContainerPort" -}}
{{- if .Values.tls.internal.enabled }}
- name: health
  containerPort: {{ .Values.tls.internal.healthPort }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Static worker list: <sts>-<i>.<headless service>.<namespace>.svc:<port>, one per replica
(with worker.nodes > 1, the leader pods <lws>-<i> under the LeaderWorkerSet's own headless Service;
with worker.disaggregation.enabled, the prefill pool's pods <sts>-prefill-<i>, then the decode pool's). */}}
{{- define "stormserve.staticWorkers" -}}
{{- $root := .root -}}
{{- $name := include "stormserve.component" . -}}
{{- $sets := list (list $name (int $root.Values.worker.replicas)) -}}
{{- if gt (int $root.Values.worker.nodes) 1 -}}
{{- $name = include "stormserve.workerGroupsName" . -}}
{{- $sets = list (list $name (int $root.Values.worker.replicas)) -}}
{{- else if $root.Values.worker.disaggregation.enabled -}}
{{- $sets = list -}}
{{- range $role := list "prefill" "decode" -}}
{{- $sets = append $sets (list (printf "%s-%s" $name $role) (int (index $root.Values.worker.disaggregation $role).replicas)) -}}
{{- end -}}
{{- end -}}
{{- $addresses := list -}}
{{- range $set := $sets -}}
{{- range $i := until (index $set 1) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc:%d" (index $set 0) $i $name $root.Release.Namespace (int $root.Values.ports.worker)) -}}
{{- end -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* The extended resource the worker requests: "" on cpu, else the override or the accelerator's default. */}}
{{- define "stormserve.acceleratorResource" -}}
{{- $w := .Values.worker -}}
{{- if ne $w.accelerator "cpu" -}}
{{- $default := get (dict "cuda" "nvidia.com/gpu" "npu" "huawei.com/Ascend910") $w.accelerator -}}
{{- default $default $w.acceleratorResource.name -}}
{{- end -}}
{{- end -}}

{{/* A component's resources; a cuda or npu worker's also request its accelerator, count per rank times its ranks (requests = limits, as extended resources need). */}}
{{- define "stormserve.resources" -}}
{{- $resources := deepCopy (get . "values" | default (index .root.Values .component)).resources -}}
{{- if eq .component "worker" -}}
{{- $name := include "stormserve.acceleratorResource" .root -}}
{{- if $name -}}
{{- $count := mul .root.Values.worker.acceleratorResource.count .root.Values.worker.tensorParallelSize -}}
{{- $_ := set $resources "requests" (set (default (dict) $resources.requests) $name $count) -}}
{{- $_ := set $resources "limits" (set (default (dict) $resources.limits) $name $count) -}}
{{- end -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- /* The `metrics` port of a gRPC service's container and Service, when metrics are on. */ -}}
{{- define "stormserve.metricsContainerPort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end -}}

{{- define "stormserve.metricsServicePort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  port: {{ .Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
{{- end }}
{{- end -}}
