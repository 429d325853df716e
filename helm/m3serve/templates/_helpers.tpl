{{/*
Names. KubeRay derives the RayCluster, its Services and Pods from the RayService name (cluster = name + 5
characters, pods add "-head-xxxxx" / "-<group>-worker-xxxxx"), so the base name is kept to 40 characters to leave
room under the 63-character label and DNS limits.
*/}}
{{- define "m3serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "m3serve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "m3serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "m3serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "m3serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "m3serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: m3serve
{{- end -}}

{{- define "m3serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The name of the Secret holding the API key, or "" when the API is open. */}}
{{- define "m3serve.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "m3serve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Roles that run engine groups, in ServeConfig.groups() order. */}}
{{- define "m3serve.roles" -}}
{{- if .Values.serve.disaggregate -}}prefill decode{{- else -}}unified{{- end -}}
{{- end -}}

{{/* The directory the engines load the checkpoint from (ServeConfig.model). */}}
{{- define "m3serve.modelDir" -}}
{{- if .Values.model.subPath -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.subPath -}}
{{- else -}}
{{- .Values.model.mountPath -}}
{{- end -}}
{{- end -}}

{{/*
Cross-field checks that JSON Schema cannot express; `helm template/install` stops with the message.
They mirror workers.config.ParallelConfig and the pod layout (one engine replica = one pod).
*/}}
{{- define "m3serve.validate" -}}
{{- if ge (int .Values.gracefulShutdown.serveTimeoutSeconds) (int .Values.gracefulShutdown.terminationGracePeriodSeconds) -}}
{{- fail "gracefulShutdown: serveTimeoutSeconds must be below terminationGracePeriodSeconds (the pod would be killed mid-drain)" -}}
{{- end -}}
{{- if and .Values.gracefulShutdown.drainIngress (ge (add (include "m3serve.drainGrace" . | float64 | ceil | int) (int .Values.gracefulShutdown.rayStopGraceSeconds)) (int .Values.gracefulShutdown.terminationGracePeriodSeconds)) -}}
{{- fail "gracefulShutdown: serve.drain_grace_s + rayStopGraceSeconds must be below terminationGracePeriodSeconds (preStop drains the ingress, then stops Ray; the pod would be killed mid-drain)" -}}
{{- end -}}
{{- if and .Values.apiKey.value .Values.apiKey.existingSecret -}}
{{- fail "apiKey: set either apiKey.value or apiKey.existingSecret, not both" -}}
{{- end -}}
{{- range $role := splitList " " (include "m3serve.roles" .) -}}
{{- $g := index $.Values.serve $role -}}
{{- $world := mul (int $g.tp) (int $g.dp) -}}
{{- if mod $world (int $g.ep) -}}
{{- fail (printf "serve.%s.ep: %d must divide tp * dp = %d" $role (int $g.ep) $world) -}}
{{- end -}}
{{- $w := include "m3serve.workerGroup" (dict "root" $ "role" $role) | fromYaml -}}
{{- if and (eq $.Values.serve.device "cuda") (gt $world (int $w.maxGpusPerPod)) -}}
{{- fail (printf "serve.%s: tp * dp = %d GPUs per engine replica exceeds workerGroups.%s.maxGpusPerPod = %d (one engine replica runs in one pod)" $role $world $role (int $w.maxGpusPerPod)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The worker settings of one role: `worker` defaults deep-merged with `workerGroups.<role>`. */}}
{{- define "m3serve.workerGroup" -}}
{{- $over := default dict (index .root.Values.workerGroups .role) -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.worker) (deepCopy $over)) -}}
{{- end -}}

{{/*
The ServeConfig (deploy/config.py) the engines run, from `.Values.serve`: the chart fills in what it owns
(the model directory it mounted, the HTTP bind address of the pods). The API key never goes into the
RayService: it reaches the pods as env M3SERVE_API_KEY from a Secret.
*/}}
{{- define "m3serve.serveConfig" -}}
{{- $cfg := deepCopy .Values.serve -}}
{{- if not $cfg.model -}}
{{- if ne .Values.model.source "builtinTiny" -}}
{{- $_ := set $cfg "model" (include "m3serve.modelDir" .) -}}
{{- else -}}
{{- $_ := set $cfg "model" nil -}}
{{- end -}}
{{- end -}}
{{- $_ := set $cfg "http" (dict "host" "0.0.0.0" "port" (int .Values.service.targetPort)) -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* The Ray Serve config file (ServeDeploySchema) that KubeRay submits to the cluster. */}}
{{- define "m3serve.serveConfigV2" -}}
{{- $app := dict "name" .Values.serveApp.name "route_prefix" .Values.serveApp.routePrefix "import_path" "deploy.app:build_app" -}}
{{- $_ := set $app "args" (dict "config" (include "m3serve.serveConfig" . | fromJson)) -}}
{{- $_ := set $app "deployments" (include "m3serve.deploymentOptions" . | fromYamlArray) -}}
{{- $http := dict "host" "0.0.0.0" "port" (int .Values.service.targetPort) -}}
{{- if .Values.serveApp.requestTimeoutSeconds -}}
{{- $_ := set $http "request_timeout_s" .Values.serveApp.requestTimeoutSeconds -}}
{{- end -}}
{{- $doc := dict "proxy_location" .Values.serveApp.proxyLocation "http_options" $http "applications" (list $app) -}}
{{- /* JSON, not toYaml: Helm holds numbers as float64 and toYaml writes 67108864 as 6.7108864e+07, which the
       strict loader would reject as a float for an int field. JSON is valid YAML for KubeRay. */ -}}
{{- toPrettyJson $doc -}}
{{- end -}}

{{/*
Per-deployment Serve options: every deployment deploy.app:build_app creates (Ingress, Router, MetricsHub, one
EngineServer-<role>-<i> per engine replica) drains for gracefulShutdown.serveTimeoutSeconds when Serve stops it
(upgrades, config changes); `serveApp.deployments` entries are merged on top by name.
*/}}
{{- define "m3serve.deploymentOptions" -}}
{{- $gs := .Values.gracefulShutdown -}}
{{- $drain := dict "graceful_shutdown_timeout_s" $gs.serveTimeoutSeconds "graceful_shutdown_wait_loop_s" $gs.serveWaitLoopSeconds -}}
{{- $byName := dict -}}
{{- $names := list "Ingress" "Router" "MetricsHub" -}}
{{- range $role := splitList " " (include "m3serve.roles" .) -}}
{{- range $i := until (int (index $.Values.serve $role).replicas) -}}
{{- $names = append $names (printf "EngineServer-%s-%d" $role $i) -}}
{{- end -}}
{{- end -}}
{{- range $names -}}
{{- $_ := set $byName . (merge (dict "name" .) $drain) -}}
{{- end -}}
{{- range .Values.serveApp.deployments -}}
{{- $_ := set $byName .name (mergeOverwrite (default dict (get $byName .name)) (deepCopy .)) -}}
{{- end -}}
{{- $out := list -}}
{{- range $name := keys $byName | sortAlpha -}}
{{- $out = append $out (get $byName $name) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Env shared by every Ray container. */}}
{{- define "m3serve.env" -}}
{{- $secret := include "m3serve.apiKeySecretName" . -}}
{{- if $secret }}
- name: M3SERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: M3SERVE_POD_IP  # the drain hook names its pod (deploy/drain_hook.py)
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The model volume (nothing for source image/builtinTiny). */}}
{{- define "m3serve.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: {{ $m.pvc.readOnly }}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "objectStorage" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.objectStorage.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "m3serve.modelMount" -}}
{{- if has .Values.model.source (list "pvc" "hostPath" "objectStorage") }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Copies the checkpoint from object storage into the pod's model emptyDir before Ray starts. The head gets the small
files only (config, tokenizer; MODEL_FILES=metadata): Serve builds the application there, which reads them.
Called with (dict "root" $ "metadataOnly" bool).
*/}}
{{- define "m3serve.modelInitContainer" -}}
{{- $m := .root.Values.model -}}
{{- $metadataOnly := .metadataOnly -}}
{{- with .root -}}
{{- if eq $m.source "objectStorage" }}
- name: fetch-model
  image: {{ $m.objectStorage.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if $m.objectStorage.command }}
  command:
    {{- toYaml $m.objectStorage.command | nindent 4 }}
  {{- else }}
  command:
    - /bin/sh
    - -c
    - |
      set -euf  # no globbing: the --exclude patterns below are for aws, not the shell
      if [ -f "$MODEL_DIR/config.json" ]; then echo "model already in $MODEL_DIR"; exit 0; fi
      mkdir -p "$MODEL_DIR"
      skip=""
      if [ "$MODEL_FILES" = metadata ]; then skip="--exclude *.safetensors --exclude *.bin --exclude *.pt"; fi
      aws s3 sync ${S3_ENDPOINT_URL:+--endpoint-url "$S3_ENDPOINT_URL"} --only-show-errors $skip "$MODEL_URI" "$MODEL_DIR"
  {{- end }}
  env:
    - name: MODEL_URI
      value: {{ $m.objectStorage.uri | quote }}
    - name: MODEL_DIR
      value: {{ include "m3serve.modelDir" . | quote }}
    - name: MODEL_FILES
      value: {{ ternary "metadata" "all" $metadataOnly }}
    {{- with $m.objectStorage.endpointUrl }}
    - name: S3_ENDPOINT_URL
      value: {{ . | quote }}
    {{- end }}
  {{- with $m.objectStorage.credentialsSecret }}
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  resources:
    {{- toYaml $m.objectStorage.resources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Graceful shutdown: `ray stop` lets the raylet drain before the pod goes away. */}}
{{/*
preStop. Worker pods (`drain`: true) first drain their own ingress replica(s) through POST /admin/drain, on each
replica's direct-ingress port behind HAProxy, else on the pod's Serve proxy (deploy/drain_hook.py; readiness goes
503, new requests get 503 + Retry-After, requests in flight get serve.drain_grace_s, the rest end with an error
event), then stop Ray. The hook always exits 0.
*/}}
{{- define "m3serve.lifecycle" -}}
{{- $g := .root.Values.gracefulShutdown -}}
{{- $stop := printf "ray stop --grace-period %v" $g.rayStopGraceSeconds -}}
preStop:
  exec:
    {{- if and .drain $g.drainIngress }}
    command: ["/bin/sh", "-c", "python -m deploy.drain_hook --port {{ int .root.Values.service.targetPort }} --prefix {{ .root.Values.serveApp.routePrefix }} --grace {{ include "m3serve.drainGrace" .root }} --calls {{ max 2 (mul 2 (int .root.Values.serve.ingress_replicas)) }}; {{ $stop }}"]
    {{- else }}
    command: ["/bin/sh", "-c", "{{ $stop }}"]
    {{- end }}
{{- end -}}

{{/* Seconds the ingress drain gives requests in flight: ServeConfig.drain_grace_s (default 30). */}}
{{- define "m3serve.drainGrace" -}}
{{- if kindIs "invalid" .Values.serve.drain_grace_s }}30{{ else }}{{ .Values.serve.drain_grace_s }}{{ end -}}
{{- end -}}
