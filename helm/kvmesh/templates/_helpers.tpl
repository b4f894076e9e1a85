{{/* Names ------------------------------------------------------------------------------- */}}

{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-kvmesh, or just <release> when the release name already contains "kvmesh". */}}
{{- define "kvmesh.fullname" -}}
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

{{- define "kvmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The StatefulSet name is also the prefix of the worker pod names: <this>-<ordinal>. */}}
{{- define "kvmesh.worker.name" -}}
{{- printf "%s-worker" (include "kvmesh.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.worker.headless" -}}
{{- printf "%s-worker-headless" (include "kvmesh.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.router.name" -}}
{{- printf "%s-router" (include "kvmesh.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.redis.name" -}}
{{- printf "%s-redis" (include "kvmesh.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels ------------------------------------------------------------------------------ */}}

{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ include "kvmesh.chart" . }}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvmesh
{{- end }}

{{/* Selector labels of one component: include "kvmesh.selectorLabels" (list . "worker") */}}
{{- define "kvmesh.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "kvmesh.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Addresses --------------------------------------------------------------------------- */}}

{{- define "kvmesh.svcSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* DNS suffix of the worker pods: <pod>.<this> (no port). */}}
{{- define "kvmesh.worker.domain" -}}
{{- printf "%s.%s" (include "kvmesh.worker.headless" .) (include "kvmesh.svcSuffix" .) }}
{{- end }}

{{- define "kvmesh.router.host" -}}
{{- printf "%s.%s" (include "kvmesh.router.name" .) (include "kvmesh.svcSuffix" .) }}
{{- end }}

{{/* Env var that holds the Redis password, referenced as $(…) in the URL. */}}
{{- define "kvmesh.redis.passwordEnv" -}}KVMESH_REDIS_PASSWORD{{- end }}

{{/* Secret name and key of the Redis password, or "" when Redis has no password. The in-chart
Redis's password is generated into <fullname>-redis-auth unless redis.auth.existingSecret is set. */}}
{{- define "kvmesh.redis.secretName" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.enabled }}{{ default (printf "%s-redis-auth" (include "kvmesh.fullname" .)) .Values.redis.auth.existingSecret }}{{ end }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "kvmesh.redis.secretKey" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.auth.existingSecretPasswordKey }}
{{- else }}{{ .Values.redis.external.existingSecretPasswordKey }}{{ end }}
{{- end }}

{{/* Security (README: Security) ------------------------------------------------------------ */}}

{{/* The cluster token's Secret: security.clusterToken.existingSecret, else the generated one. */}}
{{- define "kvmesh.clusterToken.secretName" -}}
{{- default (printf "%s-cluster-token" (include "kvmesh.fullname" .)) .Values.security.clusterToken.existingSecret }}
{{- end }}

{{/* The TLS Secret (tls.crt, tls.key, ca.crt): an existing one, else the cert-manager Certificate's. */}}
{{- define "kvmesh.tls.secretName" -}}
{{- default (printf "%s-tls" (include "kvmesh.fullname" .)) .Values.security.tls.existingSecret }}
{{- end }}

{{- define "kvmesh.tls.mountPath" -}}/etc/kvmesh/tls{{- end }}
{{- define "kvmesh.apiKeys.mountPath" -}}/etc/kvmesh/api-keys{{- end }}

{{/* --tls-* flags of `kvmesh router` and `kvmesh worker` (mutual TLS between them). */}}
{{- define "kvmesh.tls.args" -}}
{{- if .Values.security.tls.enabled }}
{{- $d := include "kvmesh.tls.mountPath" . }}
- {{ printf "--tls-cert=%s/tls.crt" $d | quote }}
- {{ printf "--tls-key=%s/tls.key" $d | quote }}
- {{ printf "--tls-ca=%s/ca.crt" $d | quote }}
{{- end }}
{{- end }}

{{/* Env of router and worker containers: the Redis password and URL (the URL in the environment,
not in args, so the expanded password never shows in ps), and the cluster token. */}}
{{- define "kvmesh.secretEnv" -}}
{{- with include "kvmesh.redis.passwordEnvVar" . | trim }}
{{ . }}
{{- end }}
- name: KVMESH_REDIS_URL
  value: {{ include "kvmesh.redis.url" . | quote }}
{{- if .Values.security.clusterToken.enabled }}
- name: KVMESH_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.clusterToken.secretName" . }}
      key: {{ .Values.security.clusterToken.existingSecretKey }}
{{- end }}
{{- end }}

{{/* TLS volume (and its mount), for router, worker and test pods. */}}
{{- define "kvmesh.tls.volume" -}}
{{- if .Values.security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "kvmesh.tls.secretName" . }}
{{- end }}
{{- end }}

{{- define "kvmesh.tls.volumeMount" -}}
{{- if .Values.security.tls.enabled }}
- name: tls
  mountPath: {{ include "kvmesh.tls.mountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* A value of a generated Secret: the one already in the cluster (kept across upgrades), else new. */}}
{{- define "kvmesh.generatedValue" -}}
{{- $ctx := index . 0 }}{{ $name := index . 1 }}{{ $key := index . 2 }}
{{- $existing := lookup "v1" "Secret" $ctx.Release.Namespace $name }}
{{- if and $existing (hasKey $existing.data $key) }}{{ index $existing.data $key }}
{{- else }}{{ randAlphaNum 40 | b64enc }}{{ end }}
{{- end }}

{{/*
--redis-url. A password is never rendered: it is read from the Secret into an env var and
Kubernetes expands $(KVMESH_REDIS_PASSWORD) in the container args at start.
*/}}
{{- define "kvmesh.redis.url" -}}
{{- $auth := "" }}
{{- if include "kvmesh.redis.secretName" . }}
{{- $auth = printf ":$(%s)@" (include "kvmesh.redis.passwordEnv" .) }}
{{- end }}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s%s.%s:%d/%d" $auth (include "kvmesh.redis.name" .) (include "kvmesh.svcSuffix" .) (int .Values.redis.port) (int .Values.redis.db) }}
{{- else }}
{{- $url := regexReplaceAll "^(rediss?(?:\\+sentinel)?://)" .Values.redis.external.url (printf "${1}%s" $auth) }}
{{- if and $auth .Values.redis.external.sentinelAuth (contains "+sentinel://" $url) }}
{{- $url = printf "%s%ssentinel_password=$(%s)" $url (ternary "&" "?" (contains "?" $url)) (include "kvmesh.redis.passwordEnv" .) }}
{{- end }}
{{- $url }}
{{- end }}
{{- end }}

{{/* Env entry with the Redis password, when there is one. */}}
{{- define "kvmesh.redis.passwordEnvVar" -}}
{{- $secret := include "kvmesh.redis.secretName" . }}
{{- if $secret }}
- name: {{ include "kvmesh.redis.passwordEnv" . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "kvmesh.redis.secretKey" . }}
{{- end }}
{{- end }}

{{/* Images ------------------------------------------------------------------------------ */}}

{{/* <repository>@<digest> when a digest is set (the tag is then ignored), else <repository>:<tag>.
A digest never follows a ":" (the schema rejects a tag in digest form). (list . tag digest) */}}
{{- define "kvmesh.image" -}}
{{- $ctx := index . 0 }}{{ $tag := index . 1 }}{{ $digest := index . 2 }}
{{- if $digest }}{{ printf "%s@%s" $ctx.Values.image.repository $digest }}
{{- else }}{{ printf "%s:%s" $ctx.Values.image.repository $tag }}{{ end }}
{{- end }}

{{- define "kvmesh.image.worker" -}}
{{- include "kvmesh.image" (list . (default (printf "%s-cuda" .Chart.AppVersion) .Values.image.workerTag) .Values.image.workerDigest) }}
{{- end }}

{{- define "kvmesh.image.router" -}}
{{- include "kvmesh.image" (list . (default (printf "%s-cpu" .Chart.AppVersion) .Values.image.routerTag) .Values.image.routerDigest) }}
{{- end }}

{{/* Volumes ----------------------------------------------------------------------------- */}}

{{/* The model volume: every worker mounts it; the router only when it reads the tokenizer from
it (router.tokenizerSource local/auto; the default, worker, gets it from a worker over gRPC). */}}
{{- define "kvmesh.modelVolume" -}}
- name: models
{{- if eq .Values.modelCache.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
    readOnly: {{ .Values.modelCache.readOnly }}
{{- else if eq .Values.modelCache.type "hostPath" }}
  hostPath:
    path: {{ .Values.modelCache.hostPath }}
    type: {{ .Values.modelCache.hostPathType }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "kvmesh.modelVolumeMount" -}}
- name: models
  mountPath: {{ .Values.modelCache.mountPath }}
  readOnly: {{ .Values.modelCache.readOnly }}
{{- end }}

{{/* Writable scratch of router and worker pods (the root filesystem is read-only): the cache
(HOME, KVMESH_CACHE_DIR: converted weights, the router's tokenizer files) and /tmp. */}}
{{- define "kvmesh.scratchVolumes" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "kvmesh.scratchVolumeMounts" -}}
- name: cache
  mountPath: {{ .Values.cache.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Probes and scaling ------------------------------------------------------------------ */}}

{{/* grpc.health.v1 service of liveness, on router and worker (contracts/health.py
LIVENESS_SERVICE): SERVING while the process makes progress; readiness is the main service. */}}
{{- define "kvmesh.livenessService" -}}kvmesh.v1.Liveness{{- end }}

{{/* The worker pools, as YAML `pools: [...]` (read with fromYaml): the one mixed pool
(<fullname>-worker, worker.*), or with disaggregation.enabled a prefill and a decode pool
(<fullname>-worker-prefill / -decode, `kvmesh worker --role`), each with its own replicas,
resources ({} = worker.resources) and autoscaling (merged over worker.autoscaling). `selector`:
the labels a pool's StatefulSet selects on besides the worker component's. */}}
{{- define "kvmesh.worker.pools" -}}
{{- $w := .Values.worker }}
{{- $pools := list }}
{{- if .Values.disaggregation.enabled }}
{{- range $role := list "prefill" "decode" }}
{{- $d := index $.Values.disaggregation $role }}
{{- $pools = append $pools (dict "role" $role "name" (printf "%s-%s" (include "kvmesh.worker.name" $) $role | trunc 52 | trimSuffix "-")
      "replicas" $d.replicas "resources" (default $w.resources $d.resources)
      "autoscaling" (mergeOverwrite (deepCopy $w.autoscaling) (deepCopy (default dict $d.autoscaling)))
      "selector" (dict "kvmesh.io/role" $role)) }}
{{- end }}
{{- else }}
{{- $pools = list (dict "role" "mixed" "name" (include "kvmesh.worker.name" .) "replicas" $w.replicas
      "resources" $w.resources "autoscaling" $w.autoscaling "selector" dict) }}
{{- end }}
{{- toYaml (dict "pools" $pools) }}
{{- end }}

{{/* "true" when an autoscaler owns a pool's StatefulSet replica count (then not rendered):
the HPA, or KEDA where its ScaledObject API exists (without it nothing is created: NOTES warns).
(list . autoscaling) */}}
{{- define "kvmesh.worker.autoscaled" -}}
{{- $ctx := index . 0 }}{{ $a := index . 1 }}
{{- if or $a.hpa.enabled (and $a.keda.enabled ($ctx.Capabilities.APIVersions.Has "keda.sh/v1alpha1/ScaledObject")) }}true{{ end }}
{{- end }}

{{/* PromQL over the workers of one pool of this release: kvmesh:<metric> summed (requests
waiting: a target per worker) or averaged (KV usage: a target fraction), or the pool's
autoscaling.query as is. (list . pool) */}}
{{- define "kvmesh.worker.autoscalingQuery" -}}
{{- $ctx := index . 0 }}{{ $pool := index . 1 }}{{ $a := $pool.autoscaling }}
{{- if $a.query }}{{ $a.query }}
{{- else }}
{{- $sel := printf "namespace=%q,worker_id=~%q" $ctx.Release.Namespace (printf "%s-[0-9]+" $pool.name) }}
{{- printf "%s(kvmesh:%s{%s})" (ternary "sum" "avg" (eq $a.metric "num_requests_waiting")) $a.metric $sel }}
{{- end }}
{{- end }}

{{- define "kvmesh.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end }}
