{{/* Names, labels, the image, and the gateway's config file. */}}

{{- define "furnace-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name; 40 characters leave room for "-worker-<pool>". */}}
{{- define "furnace-gateway.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "furnace-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "furnace-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "furnace-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "furnace-gateway.labels" -}}
helm.sh/chart: {{ include "furnace-gateway.chart" . }}
{{ include "furnace-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "furnace-gateway.gatewaySelectorLabels" -}}
{{ include "furnace-gateway.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{/* Selector labels of a worker pool; argument: (dict "root" $ "name" $poolName). */}}
{{- define "furnace-gateway.poolSelectorLabels" -}}
{{ include "furnace-gateway.selectorLabels" .root }}
app.kubernetes.io/component: worker
furnace-gateway/pool: {{ .name }}
{{- end }}

{{- define "furnace-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "furnace-gateway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference; argument: (dict "root" $ "image" $imageValues), where empty fields
fall back to the chart's image. */}}
{{- define "furnace-gateway.image" -}}
{{- $image := .image | default dict }}
{{- $repository := $image.repository | default .root.Values.image.repository }}
{{- $tag := $image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- printf "%s:%s" $repository (toString $tag) }}
{{- end }}

{{/* The resource name of a worker pool (its workload and its headless Service). */}}
{{- define "furnace-gateway.poolFullname" -}}
{{- printf "%s-worker-%s" (include "furnace-gateway.fullname" .root) .name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Whether a pool is deployed: "true" or "". A pool without `enabled` is. */}}
{{- define "furnace-gateway.poolEnabled" -}}
{{- if or (not (hasKey .pool "enabled")) .pool.enabled }}true{{ end }}
{{- end }}

{{/* The address the gateway resolves to reach every ready pod of a pool. */}}
{{- define "furnace-gateway.poolAddress" -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "furnace-gateway.poolFullname" .) .root.Release.Namespace .root.Values.clusterDomain (int (.pool.port | default 50051)) }}
{{- end }}

{{/* The gateway's config file: only fields the gateway's loader knows (gateway/config.py). */}}
{{- define "furnace-gateway.config" -}}
{{- $root := . }}
{{- $models := list }}
{{- range $i, $model := .Values.models }}
{{- $workers := list }}
{{- range $name := $model.pools | default list }}
{{- if not (hasKey $root.Values.workerPools $name) }}
{{- fail (printf "models[%d].pools: %q is not a key of workerPools" $i $name) }}
{{- end }}
{{- $pool := index $root.Values.workerPools $name }}
{{- if not (include "furnace-gateway.poolEnabled" (dict "pool" $pool)) }}
{{- fail (printf "models[%d].pools: the worker pool %q is disabled" $i $name) }}
{{- end }}
{{- $workers = append $workers (include "furnace-gateway.poolAddress" (dict "root" $root "name" $name "pool" $pool)) }}
{{- end }}
{{- $workers = concat $workers ($model.workers | default list) }}
{{- $kind := $model.kind | default "llm" }}
{{- if and (eq $kind "llm") (not $workers) }}
{{- fail (printf "models[%d] (%s): an llm model needs a worker pool or a worker address" $i $model.name) }}
{{- end }}
{{- $entry := dict "name" $model.name "kind" $kind }}
{{- if $workers }}
{{- $_ := set $entry "workers" $workers }}
{{- end }}
{{- if $model.maxModelLen }}
{{- $_ := set $entry "max_model_len" (int $model.maxModelLen) }}
{{- end }}
{{- with $model.balance }}
{{- $_ := set $entry "balance" . }}
{{- end }}
{{- $models = append $models $entry }}
{{- end }}
{{- $config := deepCopy .Values.gateway.config }}
{{- $_ := set $config "host" "0.0.0.0" }}
{{- $_ := set $config "port" (int .Values.gateway.port) }}
{{- $_ := set $config "drain_timeout" (int .Values.gateway.drainTimeout) }}
{{- $_ := set $config "models" $models }}
{{- toYaml $config }}
{{- end }}
