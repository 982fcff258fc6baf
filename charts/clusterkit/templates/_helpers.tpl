{{/* Resource name prefix: fullnameOverride or the release name, short enough for "-scheduler". */}}
{{- define "clusterkit.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 53 | trimSuffix "-" -}}
{{- end -}}

{{- define "clusterkit.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include "clusterkit.selector" (list . "scheduler") */}}
{{- define "clusterkit.selector" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.operator.enabled -}}
dask.org/cluster-name: {{ include "clusterkit.fullname" $root }}
dask.org/component: {{ index . 1 }}
{{- else -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}
{{- end -}}

{{/* Every pod of this release (scheduler, workers, the helm test). */}}
{{- define "clusterkit.releasePods" -}}
{{- if .Values.operator.enabled -}}
dask.org/cluster-name: {{ include "clusterkit.fullname" . }}
{{- else -}}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- end -}}

{{- define "clusterkit.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- end -}}

{{- define "clusterkit.schedulerHost" -}}
{{ include "clusterkit.fullname" . }}-scheduler.{{ .Release.Namespace }}.svc.cluster.local
{{- end -}}

{{- define "clusterkit.schedulerAddress" -}}
{{ .Values.protocol }}://{{ include "clusterkit.schedulerHost" . }}:{{ .Values.scheduler.port }}
{{- end -}}

{{/* "true" when the release generates its own CA and certificates (tls, no tls.secretName). */}}
{{- define "clusterkit.generatesTLS" -}}
{{- and (eq .Values.protocol "tls") (not .Values.tls.secretName) -}}
{{- end -}}

{{/* The Secret (ca.crt, tls.crt, tls.key) one component mounts: tls.secretName, else the
release's generated one. include "clusterkit.tlsSecret" (list . "scheduler"|"worker"|"client") */}}
{{- define "clusterkit.tlsSecret" -}}
{{- $root := index . 0 -}}
{{- $root.Values.tls.secretName | default (printf "%s-%s-tls" (include "clusterkit.fullname" $root) (index . 1)) -}}
{{- end -}}

{{/* Command-line flags for TLS files, as YAML list items. */}}
{{- define "clusterkit.tlsArgs" -}}
{{- if eq .Values.protocol "tls" }}
- --tls-ca-file
- /etc/dask/tls/ca.crt
- --tls-cert
- /etc/dask/tls/tls.crt
- --tls-key
- /etc/dask/tls/tls.key
{{- end }}
{{- end -}}

{{/* The web pages' gate: every Dask process preloads it from the release's web Secret (the
stock Dask image has no clusterkit); its secret's file comes by environment (clusterkit.env). */}}
{{- define "clusterkit.gateArgs" -}}
{{- if .Values.webAuth.enabled }}
- --preload
- /etc/clusterkit/web/clusterkit_webauth.py
{{- end }}
{{- end -}}

{{/* The Secret holding the web pages' secret (key "token") and gate. */}}
{{- define "clusterkit.webSecret" -}}
{{- .Values.webAuth.existingSecret | default (printf "%s-web" (include "clusterkit.fullname" .)) -}}
{{- end -}}

{{- define "clusterkit.schedulerArgs" -}}
- dask
- scheduler
- --protocol
- {{ .Values.protocol }}
- --port
- {{ .Values.scheduler.port | quote }}
- --dashboard-address
- {{ printf ":%v" .Values.scheduler.dashboardPort | quote }}
{{- include "clusterkit.tlsArgs" . }}
{{- include "clusterkit.gateArgs" . }}
{{- range .Values.scheduler.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Dask resources each worker process advertises: GPU=1 per dask-cuda worker, plus extras. */}}
{{- define "clusterkit.daskResources" -}}
{{- $pairs := list -}}
{{- if gt (int .Values.worker.gpus) 0 -}}
{{- $pairs = append $pairs "GPU=1" -}}
{{- end -}}
{{- range $key, $value := .Values.worker.daskResources -}}
{{- if ne $key "GPU" -}}
{{- $pairs = append $pairs (printf "%s=%v" $key $value) -}}
{{- end -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{- define "clusterkit.workerArgs" -}}
{{- if gt (int .Values.worker.gpus) 0 }}
- dask
- cuda
- worker
{{- else }}
- dask
- worker
{{- end }}
- {{ include "clusterkit.schedulerAddress" . }}
- --name
- $(POD_NAME)
- --nthreads
- {{ .Values.worker.threads | quote }}
- --memory-limit
- {{ .Values.worker.memoryLimit | quote }}
- --local-directory
- /worker-space
- --dashboard-address
- {{ printf ":%v" .Values.worker.dashboardPort | quote }}
{{- with include "clusterkit.daskResources" . }}
- --resources
- {{ . | quote }}
{{- end }}
{{- range .Values.worker.preload }}
- --preload
- {{ . | quote }}
{{- end }}
{{- include "clusterkit.tlsArgs" . }}
{{- include "clusterkit.gateArgs" . }}
{{- range .Values.worker.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Container resources of a worker: the values plus nvidia.com/gpu limits (strings). */}}
{{- define "clusterkit.workerResources" -}}
{{- $resources := deepCopy (default dict .Values.worker.resources) -}}
{{- if gt (int .Values.worker.gpus) 0 -}}
{{- $limits := default dict $resources.limits -}}
{{- $_ := set $limits "nvidia.com/gpu" (toString .Values.worker.gpus) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- $out := dict -}}
{{- range $kind, $quantities := $resources -}}
{{- $strings := dict -}}
{{- range $name, $quantity := $quantities -}}
{{- $_ := set $strings $name (toString $quantity) -}}
{{- end -}}
{{- $_ := set $out $kind $strings -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{- define "clusterkit.stringResources" -}}
{{- $out := dict -}}
{{- range $kind, $quantities := . -}}
{{- $strings := dict -}}
{{- range $name, $quantity := $quantities -}}
{{- $_ := set $strings $name (toString $quantity) -}}
{{- end -}}
{{- $_ := set $out $kind $strings -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{- define "clusterkit.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: HOME
  value: /tmp
- name: DASK_TEMPORARY_DIRECTORY
  value: /tmp
{{- if eq .Values.protocol "tls" }}
- name: DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION
  value: "True"
{{- end }}
{{- if .Values.webAuth.enabled }}
- name: CLUSTERKIT_WEB_TOKEN_FILE
  value: /etc/clusterkit/web/token
{{- if .Values.operator.enabled }}
- name: CLUSTERKIT_WEB_OPEN_PATHS
  value: /api/v1/
{{- end }}
{{- end }}
{{- range $key, $value := .Values.env }}
- name: {{ $key | quote }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{/* Writable mounts under a read-only root filesystem, plus the TLS files (keys are files only,
never args or env). include "clusterkit.volumeMounts" (dict "root" . "component" "worker") */}}
{{- define "clusterkit.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if eq .component "worker" }}
- name: worker-space
  mountPath: /worker-space
{{- end }}
{{- if eq .root.Values.protocol "tls" }}
- name: tls
  mountPath: /etc/dask/tls
  readOnly: true
{{- end }}
{{- if and .root.Values.webAuth.enabled (ne .component "test") }}
- name: web
  mountPath: /etc/clusterkit/web
  readOnly: true
{{- end }}
{{- end -}}

{{- define "clusterkit.volumes" -}}
- name: tmp
  emptyDir: {}
{{- if eq .component "worker" }}
- name: worker-space
  emptyDir: {}
{{- end }}
{{- if eq .root.Values.protocol "tls" }}
- name: tls
  secret:
    secretName: {{ include "clusterkit.tlsSecret" (list .root (eq .component "test" | ternary "client" .component)) }}
    defaultMode: 0400
{{- end }}
{{- if and .root.Values.webAuth.enabled (ne .component "test") }}
- name: web
  secret:
    secretName: {{ include "clusterkit.webSecret" .root }}
    defaultMode: 0400
{{- end }}
{{- end -}}

{{- define "clusterkit.probes" -}}
readinessProbe:
  httpGet:
    path: /health
    port: {{ .port }}
  initialDelaySeconds: 5
  periodSeconds: 10
livenessProbe:
  httpGet:
    path: /health
    port: {{ .port }}
  initialDelaySeconds: 30
  periodSeconds: 20
  failureThreshold: 6
{{- end -}}

{{/* Dask worker processes that attach: one per GPU with dask-cuda, else one per pod. */}}
{{- define "clusterkit.daskWorkers" -}}
{{- mul (int .Values.worker.replicas) (max 1 (int .Values.worker.gpus)) -}}
{{- end -}}

{{/* The clusterkit `address` profile researchers attach with (printed by NOTES). */}}
{{- define "clusterkit.profile" -}}
{{- $dir := printf "~/.config/clusterkit/tls/%s" (include "clusterkit.fullname" .) -}}
backend: address
description: {{ printf "Dask cluster %s in namespace %s (helm chart clusterkit)" (include "clusterkit.fullname" .) .Release.Namespace | quote }}
protocol: {{ .Values.protocol }}
address: {{ include "clusterkit.schedulerAddress" . }}
workers: {{ include "clusterkit.daskWorkers" . }}
{{- if eq .Values.protocol "tls" }}
tls:
  ca_file: {{ $dir }}/ca.crt
  cert_file: {{ $dir }}/tls.crt
  key_file: {{ $dir }}/tls.key
{{- end }}
{{- end -}}

{{- define "clusterkit.notes" -}}
{{- $name := include "clusterkit.fullname" . -}}
{{- $dir := printf "~/.config/clusterkit/tls/%s" $name -}}
{{- $ns := .Release.Namespace -}}
Dask cluster {{ $name }} ({{ if .Values.operator.enabled }}DaskCluster for the dask-kubernetes operator{{ else }}scheduler + {{ .Values.worker.replicas }} worker pod(s){{ end }}, {{ if gt (int .Values.worker.gpus) 0 }}{{ .Values.worker.gpus }} GPU(s) per pod, dask-cuda{{ else }}CPU workers{{ end }}, protocol {{ .Values.protocol }}).

Scheduler: {{ include "clusterkit.schedulerAddress" . }}
Dashboard: kubectl -n {{ $ns }} port-forward deploy/{{ $name }}-scheduler {{ .Values.scheduler.dashboardPort }}
{{- if .Values.webAuth.enabled }}
           then open http://localhost:{{ .Values.scheduler.dashboardPort }}/status?token=$(kubectl -n {{ $ns }} get secret {{ include "clusterkit.webSecret" . }} -o jsonpath='{.data.token}' | base64 -d)
           (the page needs the web secret once; the browser keeps a cookie)
{{- else }}
           then open http://localhost:{{ .Values.scheduler.dashboardPort }}
{{- end }}
Check:     helm test {{ .Release.Name }} -n {{ $ns }}
{{- if eq .Values.protocol "tls" }}
{{- $secret := include "clusterkit.tlsSecret" (list . "client") }}

Scheduler and workers require mutual TLS. The client certificate, its key and the CA are in the
Secret {{ $ns }}/{{ $secret }}{{ if eq (include "clusterkit.generatesTLS" .) "true" }} (generated by this release, signed by its own CA, kept across upgrades){{ end }}:
whoever may read it can run code on the cluster, so grant `get` on it (the Role
{{ $name }}-client-tls-reader, bound to tls.clientReaders) only to the researchers of this cluster.
Fetch it into owner-only files:
  (umask 077 && mkdir -p {{ $dir }})
{{- range list "ca.crt" "tls.crt" "tls.key" }}
  (umask 077 && kubectl -n {{ $ns }} get secret {{ $secret }} -o jsonpath='{.data.{{ . | replace "." "\\." }}}' | base64 -d > {{ $dir }}/{{ . }})
{{- end }}
{{- else if eq .Values.protocol "tcp" }}

WARNING: protocol tcp has no encryption and no authentication: anyone who can reach the Service can run code as the workers.
{{- end }}

Give researchers this clusterkit profile, saved as ~/.config/clusterkit/profiles/{{ $name }}.yaml:

# --- clusterkit profile: {{ $name }}
{{ include "clusterkit.profile" . }}
# ---

and they attach with:  clusterkit.get_client("{{ $name }}")
{{- end -}}

{{/*
checkov reads suppressions of Kubernetes checks from annotations (not comments); each one
names the check and why it does not apply:
- CKV_K8S_21: the namespace is the release's (helm -n); checkov renders with "default".
- CKV_K8S_15: image.pullPolicy is a value; IfNotPresent with a pinned tag avoids a registry
  round trip for every (GPU) pod start. Set Always for multi-tenant private registries.
- CKV_K8S_43: the image is pinned by tag; set image.digest to pull by digest.
*/}}
{{- define "clusterkit.checkovSkips" -}}
checkov.io/skip1: CKV_K8S_21=namespace is the release namespace chosen with helm -n
checkov.io/skip2: CKV_K8S_15=image.pullPolicy is a value and the default tag is pinned
checkov.io/skip3: CKV_K8S_43=image is pinned by tag and image.digest pulls by digest
{{- end -}}

{{/* Dask's default scheduler HTTP routes plus its API, for the operator (see daskcluster.yaml). */}}
{{- define "clusterkit.operatorRoutes" -}}
["distributed.http.scheduler.prometheus", "distributed.http.scheduler.info", "distributed.http.scheduler.json", "distributed.http.health", "distributed.http.proxy", "distributed.http.statics", "distributed.http.scheduler.api"]
{{- end -}}
