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
{{- /* A digest pins the image itself; the chart's digest only goes with the chart's repository. */}}
{{- $digest := $image.digest | default (ternary .root.Values.image.digest "" (empty $image.repository)) }}
{{- if $digest }}
{{- printf "%s@%s" $repository $digest }}
{{- else }}
{{- printf "%s:%s" $repository (toString $tag) }}
{{- end }}
{{- end }}

{{/* The resource name of a worker pool (its workload and its headless Service). */}}
{{- define "furnace-gateway.poolFullname" -}}
{{- printf "%s-worker-%s" (include "furnace-gateway.fullname" .root) .name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Whether a pool is deployed: "true" or "". A pool without `enabled` is. */}}
{{- define "furnace-gateway.poolEnabled" -}}
{{- if or (not (hasKey .pool "enabled")) .pool.enabled }}true{{ end }}
{{- end }}

{{/* What a pool runs: `furnace` (our worker: args from values) or `vllm-grpc` (stock
vLLM's gRPC server, `python3 -m vllm.entrypoints.grpc_server`). Argument: the pool. */}}
{{- define "furnace-gateway.poolEngine" -}}
{{- .engine | default "furnace" }}
{{- end }}

{{/* A pool's role in prefill/decode disaggregation, `vllm.kvRole` (`kv_producer`: it
prefills, `kv_consumer`: it decodes, `kv_both`), checked; empty without one. Argument:
(dict "name" $poolName "pool" $pool). */}}
{{- define "furnace-gateway.poolKvRole" -}}
{{- with ($.pool.vllm | default dict).kvRole }}
{{- if ne (include "furnace-gateway.poolEngine" $.pool) "vllm-grpc" }}
{{- fail (printf "workerPools.%s.vllm.kvRole: only for engine vllm-grpc (vLLM's NixlConnector)" $.name) }}
{{- end }}
{{- if not (has . (list "kv_producer" "kv_consumer" "kv_both")) }}
{{- fail (printf "workerPools.%s.vllm.kvRole: %v is none of kv_producer, kv_consumer, kv_both" $.name .) }}
{{- end }}
{{- . }}
{{- end }}
{{- end }}

{{/* How many data-parallel engines each server of a vLLM pool runs: its args'
`--data-parallel-size N` (or `-dp N`, `--data-parallel-size=N`), else 1. Argument: (dict
"name" "pool"). */}}
{{- define "furnace-gateway.poolDataParallelSize" -}}
{{- $size := "1" }}
{{- $next := false }}
{{- range $word := .pool.args | default list }}
{{- $word = toString $word }}
{{- if $next }}
{{- $size = $word }}
{{- $next = false }}
{{- else if has $word (list "--data-parallel-size" "-dp") }}
{{- $next = true }}
{{- else if hasPrefix "--data-parallel-size=" $word }}
{{- $size = trimPrefix "--data-parallel-size=" $word }}
{{- else if hasPrefix "-dp=" $word }}
{{- $size = trimPrefix "-dp=" $word }}
{{- end }}
{{- end }}
{{- if not (regexMatch "^[1-9][0-9]*$" $size) }}
{{- fail (printf "workerPools.%s.args: --data-parallel-size %s is not a count of engines" .name $size) }}
{{- end }}
{{- $size }}
{{- end }}

{{/* The port of a pool's NIXL side channel (`vllm.nixlSideChannelPort`, default vLLM's
5600), empty for a pool without `vllm.kvRole`. Argument: (dict "name" "pool"). */}}
{{- define "furnace-gateway.nixlSideChannelPort" -}}
{{- $vllm := .pool.vllm | default dict }}
{{- if include "furnace-gateway.poolKvRole" . }}
{{- $port := int ($vllm.nixlSideChannelPort | default 5600) }}
{{- if eq $port (int (.pool.port | default 50051)) }}
{{- fail (printf "workerPools.%s.vllm.nixlSideChannelPort: %d is the pool's gRPC port" .name $port) }}
{{- end }}
{{- $port }}
{{- else if hasKey $vllm "nixlSideChannelPort" }}
{{- fail (printf "workerPools.%s.vllm.nixlSideChannelPort: needs vllm.kvRole" .name) }}
{{- end }}
{{- end }}

{{/* Where the gateway's pod mounts a model's tokenizer files; argument: the model's name. */}}
{{- define "furnace-gateway.tokenizerDir" -}}
{{- printf "/etc/furnace-tokenizers/%s" . }}
{{- end }}

{{/* The gateway's volumes (with `volumes`) or mounts (without) of models' tokenizers. */}}
{{- define "furnace-gateway.tokenizerVolumes" -}}
{{- $volumes := .volumes }}
{{- range $i, $model := .root.Values.models }}
{{- with $model.tokenizer }}
{{- if $volumes }}
- name: tokenizer-{{ $i }}
  {{- if .configMap }}
  configMap:
    name: {{ .configMap }}
  {{- else }}
  {{- toYaml .volume | nindent 2 }}
  {{- end }}
{{- else }}
- name: tokenizer-{{ $i }}
  mountPath: {{ include "furnace-gateway.tokenizerDir" $model.name }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The environment variable holding a model's upstream API key (`models[].apiKey`);
argument: the model's index. Not FURNACE_*: those override the config's fields. */}}
{{- define "furnace-gateway.apiKeyEnv" -}}
{{- printf "UPSTREAM_API_KEY_%d" (int .) }}
{{- end }}

{{/* Where the gateway's pod mounts a model's upstream CA bundle (`models[].ca`);
argument: the model's index. */}}
{{- define "furnace-gateway.upstreamCADir" -}}
{{- printf "/etc/furnace-upstream-ca/%d" (int .) }}
{{- end }}

{{/* The gateway's environment variables of models' upstream API keys, from their Secrets. */}}
{{- define "furnace-gateway.apiKeyEnvs" -}}
{{- range $i, $model := .Values.models }}
{{- with $model.apiKey }}
- name: {{ include "furnace-gateway.apiKeyEnv" $i }}
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .key | default "api-key" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The gateway's volumes (with `volumes`) or mounts (without) of models' upstream CA
bundles, each as `ca.crt` in a directory of its own. */}}
{{- define "furnace-gateway.upstreamCAVolumes" -}}
{{- $volumes := .volumes }}
{{- range $i, $model := .root.Values.models }}
{{- with $model.ca }}
- name: upstream-ca-{{ $i }}
{{- if $volumes }}
  {{- $items := list (dict "key" (.key | default "ca.crt") "path" "ca.crt") }}
  {{- if .configMap }}
  configMap:
    name: {{ .configMap }}
    items: {{ toYaml $items | nindent 6 }}
  {{- else }}
  secret:
    secretName: {{ .existingSecret }}
    items: {{ toYaml $items | nindent 6 }}
  {{- end }}
{{- else }}
  mountPath: {{ include "furnace-gateway.upstreamCADir" $i }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}
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
{{- if $model.adapterOf }}
{{- /* A LoRA adapter: its base's workers and worker settings; only its own fields. */}}
{{- range $name := list "pools" "prefillPools" "prefillWorkers" "workers" "upstream" "kind" "balance" "weights" "maxModelLen" "tokenizer" "routing" "prefillRouting" "apiKey" "ca" "toolCallParser" "reasoningParser" "plainTextContents" "scoring" "dataParallelSize" }}
{{- if hasKey $model $name }}
{{- fail (printf "models[%d].%s: an adapter (adapterOf) takes its base model's" $i $name) }}
{{- end }}
{{- end }}
{{- $entry := dict "name" $model.name "adapter_of" $model.adapterOf }}
{{- with $model.adapterPath }}
{{- $_ := set $entry "adapter_path" . }}
{{- end }}
{{- if $model.maxTokensLimit }}
{{- $_ := set $entry "max_tokens_limit" (int $model.maxTokensLimit) }}
{{- end }}
{{- with $model.fallbacks }}
{{- $_ := set $entry "fallbacks" . }}
{{- end }}
{{- with $model.prices }}
{{- $_ := set $entry "prices" . }}
{{- end }}
{{- if hasKey $model "queue" }}
{{- $_ := set $entry "queue" $model.queue }}
{{- end }}
{{- $models = append $models $entry }}
{{- else }}
{{- $workers := list }}
{{- $engines := list }}
{{- range $name := $model.pools | default list }}
{{- if not (hasKey $root.Values.workerPools $name) }}
{{- fail (printf "models[%d].pools: %q is not a key of workerPools" $i $name) }}
{{- end }}
{{- $pool := index $root.Values.workerPools $name }}
{{- if not (include "furnace-gateway.poolEnabled" (dict "pool" $pool)) }}
{{- fail (printf "models[%d].pools: the worker pool %q is disabled" $i $name) }}
{{- end }}
{{- $workers = append $workers (include "furnace-gateway.poolAddress" (dict "root" $root "name" $name "pool" $pool)) }}
{{- $engines = append $engines (include "furnace-gateway.poolEngine" $pool) | uniq }}
{{- end }}
{{- if gt (len $engines) 1 }}
{{- fail (printf "models[%d] (%s): its pools run different engines (%s)" $i $model.name (join ", " $engines)) }}
{{- end }}
{{- /* A pool of stock vLLM gRPC servers is reached with upstream vllm-grpc. */}}
{{- $poolUpstream := ternary "vllm-grpc" "grpc" (has "vllm-grpc" $engines) }}
{{- /* Tensor models are reached over the KServe v2 gRPC protocol (Triton, KServe, ours). */}}
{{- if eq ($model.kind | default "llm") "tensor" }}
{{- $poolUpstream = "kserve-grpc" }}
{{- end }}
{{- $upstream := $model.upstream | default $poolUpstream }}
{{- if and $engines (ne $upstream $poolUpstream) (ne $upstream "openai") }}
{{- fail (printf "models[%d] (%s): upstream %s, but its pools run %s" $i $model.name $upstream (first $engines)) }}
{{- end }}
{{- /* `routing: {}` is every default (kv_aware); `routing: null` is none. */}}
{{- $routing := or (kindIs "map" $model.routing) (kindIs "map" $model.prefillRouting) }}
{{- with $model.tokenizer }}
{{- if and (ne $upstream "vllm-grpc") (not $routing) }}
{{- fail (printf "models[%d] (%s): tokenizer is for upstream vllm-grpc (the gateway tokenizes) or routing (it hashes token ids)" $i $model.name) }}
{{- end }}
{{- if eq (len (compact (list .configMap .volume))) 1 | not }}
{{- fail (printf "models[%d].tokenizer: name exactly one of configMap and volume" $i) }}
{{- end }}
{{- end }}
{{- if and (eq $upstream "vllm-grpc") (not $model.tokenizer) }}
{{- fail (printf "models[%d] (%s): upstream vllm-grpc needs tokenizer (a configMap or a volume with the model's tokenizer files: the gateway tokenizes)" $i $model.name) }}
{{- end }}
{{- if and (eq $upstream "openai") $workers }}
{{- fail (printf "models[%d] (%s): an openai upstream takes base URLs in workers, not pools" $i $model.name) }}
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
{{- /* Prefill/decode disaggregation: `prefillPools` prefill (kv_producer or kv_both), the
model's `pools` then decode (kv_consumer or kv_both); `prefillWorkers` are any servers. */}}
{{- $prefillWorkers := list }}
{{- with $model.prefillPools }}
{{- if ne $upstream "vllm-grpc" }}
{{- fail (printf "models[%d].prefillPools: only for upstream vllm-grpc (pools of vLLM gRPC servers), not %s" $i $upstream) }}
{{- end }}
{{- range $name := . }}
{{- if not (hasKey $root.Values.workerPools $name) }}
{{- fail (printf "models[%d].prefillPools: %q is not a key of workerPools" $i $name) }}
{{- end }}
{{- $pool := index $root.Values.workerPools $name }}
{{- if not (include "furnace-gateway.poolEnabled" (dict "pool" $pool)) }}
{{- fail (printf "models[%d].prefillPools: the worker pool %q is disabled" $i $name) }}
{{- end }}
{{- if ne (include "furnace-gateway.poolEngine" $pool) "vllm-grpc" }}
{{- fail (printf "models[%d].prefillPools: the worker pool %q runs %s, not vllm-grpc" $i $name (include "furnace-gateway.poolEngine" $pool)) }}
{{- end }}
{{- $role := include "furnace-gateway.poolKvRole" (dict "name" $name "pool" $pool) }}
{{- if not (has $role (list "kv_producer" "kv_both")) }}
{{- fail (printf "models[%d].prefillPools: the worker pool %q prefills: it needs vllm.kvRole kv_producer or kv_both, not %s" $i $name ($role | default "none")) }}
{{- end }}
{{- $prefillWorkers = append $prefillWorkers (include "furnace-gateway.poolAddress" (dict "root" $root "name" $name "pool" $pool)) }}
{{- end }}
{{- range $name := $model.pools | default list }}
{{- $role := include "furnace-gateway.poolKvRole" (dict "name" $name "pool" (index $root.Values.workerPools $name)) }}
{{- if not (has $role (list "kv_consumer" "kv_both")) }}
{{- fail (printf "models[%d].pools: the worker pool %q decodes what prefillPools prefill: it needs vllm.kvRole kv_consumer or kv_both, not %s" $i $name ($role | default "none")) }}
{{- end }}
{{- end }}
{{- end }}
{{- with $model.prefillWorkers }}
{{- if not (has $upstream (list "openai" "vllm-grpc")) }}
{{- fail (printf "models[%d].prefillWorkers: only for upstream openai or vllm-grpc (vLLM's servers)" $i) }}
{{- end }}
{{- $prefillWorkers = concat $prefillWorkers . }}
{{- end }}
{{- with $prefillWorkers }}
{{- $_ := set $entry "prefill_workers" . }}
{{- end }}
{{- if $model.maxModelLen }}
{{- $_ := set $entry "max_model_len" (int $model.maxModelLen) }}
{{- end }}
{{- with $model.balance }}
{{- $_ := set $entry "balance" . }}
{{- end }}
{{- if ne $upstream "grpc" }}
{{- $_ := set $entry "upstream" $upstream }}
{{- end }}
{{- if $model.tokenizer }}
{{- $_ := set $entry "tokenizer" (include "furnace-gateway.tokenizerDir" $model.name) }}
{{- end }}
{{- if $model.maxTokensLimit }}
{{- $_ := set $entry "max_tokens_limit" (int $model.maxTokensLimit) }}
{{- end }}
{{- with $model.scoring }}
{{- if and (eq . "cross-encoder") (ne $upstream "openai") }}
{{- fail (printf "models[%d].scoring: cross-encoder only for upstream openai (the workers' /rerank)" $i) }}
{{- end }}
{{- $_ := set $entry "scoring" . }}
{{- end }}
{{- with $model.weights }}
{{- range $worker, $weight := . }}
{{- if not (has $worker $workers) }}
{{- fail (printf "models[%d].weights: %q is not one of the model's workers" $i $worker) }}
{{- end }}
{{- end }}
{{- $_ := set $entry "weights" . }}
{{- end }}
{{- with $model.fallbacks }}
{{- $_ := set $entry "fallbacks" . }}
{{- end }}
{{- with $model.prices }}
{{- $_ := set $entry "prices" . }}
{{- end }}
{{- /* The engines of its vLLM pools' servers (their `--data-parallel-size`), one size
for every pool of both tiers: each engine a worker of its own (`data_parallel_size`). */}}
{{- $engines := 0 }}
{{- $first := "" }}
{{- range $name := concat ($model.pools | default list) ($model.prefillPools | default list) }}
{{- $pool := index $root.Values.workerPools $name }}
{{- if eq (include "furnace-gateway.poolEngine" $pool) "vllm-grpc" }}
{{- $size := include "furnace-gateway.poolDataParallelSize" (dict "name" $name "pool" $pool) | atoi }}
{{- if not $first }}
{{- $engines = $size }}
{{- $first = $name }}
{{- else if ne $size $engines }}
{{- fail (printf "models[%d]: workerPools %q and %q run %d and %d data-parallel engines (--data-parallel-size): one model's servers run one number" $i $first $name $engines $size) }}
{{- end }}
{{- end }}
{{- end }}
{{- with $model.dataParallelSize }}
{{- if not (has $upstream (list "openai" "vllm-grpc")) }}
{{- fail (printf "models[%d].dataParallelSize: only for upstream openai or vllm-grpc (vLLM's servers)" $i) }}
{{- end }}
{{- if and $first (ne (int .) $engines) }}
{{- fail (printf "models[%d].dataParallelSize: %d, but workerPools %q runs %d data-parallel engines (--data-parallel-size); leave it out to take the pools'" $i (int .) $first $engines) }}
{{- end }}
{{- $_ := set $entry "data_parallel_size" (int .) }}
{{- else }}
{{- if gt $engines 1 }}
{{- $_ := set $entry "data_parallel_size" $engines }}
{{- end }}
{{- end }}
{{- range $name, $key := dict "toolCallParser" "tool_call_parser" "reasoningParser" "reasoning_parser" "plainTextContents" "plain_text_contents" }}
{{- if hasKey $model $name }}
{{- if ne $upstream "vllm-grpc" }}
{{- fail (printf "models[%d].%s: only for upstream vllm-grpc" $i $name) }}
{{- end }}
{{- $_ := set $entry $key (index $model $name) }}
{{- end }}
{{- end }}
{{- if hasKey $model "queue" }}
{{- if not (or (hasKey ($model.queue | default dict) "max_wait") $root.Values.gateway.config.queue) }}
{{- fail (printf "models[%d].queue: needs max_wait, as gateway.config has no queue" $i) }}
{{- end }}
{{- $_ := set $entry "queue" $model.queue }}
{{- end }}
{{- /* Each tier's routing and the entries its kv_events may name: `prefillRouting` the
prefill workers' (then `routing` the workers'), else `routing` both tiers'. */}}
{{- $own := kindIs "map" $model.prefillRouting }}
{{- if and $own (not $prefillWorkers) }}
{{- fail (printf "models[%d].prefillRouting: only with prefillPools or prefillWorkers" $i) }}
{{- end }}
{{- $tiers := dict "routing" (ternary $workers (concat $workers $prefillWorkers) $own) "prefillRouting" $prefillWorkers }}
{{- $said := dict "routing" (ternary "workers" "workers or prefillWorkers" $own) "prefillRouting" "prefillWorkers" }}
{{- range $field, $named := $tiers }}
{{- $tier := index $model $field }}
{{- if kindIs "map" $tier }}
{{- range $worker, $endpoint := $tier.kv_events }}
{{- if not (has $worker $named) }}
{{- fail (printf "models[%d].%s.kv_events: %q is not one of the model's %s" $i $field $worker (index $said $field)) }}
{{- end }}
{{- if not $model.tokenizer }}
{{- fail (printf "models[%d] (%s): %s.kv_events needs tokenizer (the events name blocks by token ids)" $i $model.name $field) }}
{{- end }}
{{- end }}
{{- range $worker, $endpoint := $tier.kv_replay }}
{{- if not (hasKey ($tier.kv_events | default dict) $worker) }}
{{- fail (printf "models[%d].%s.kv_replay: %q is not one of %s.kv_events' workers" $i $field $worker $field) }}
{{- end }}
{{- end }}
{{- $_ := set $entry (ternary "prefill_routing" "routing" (eq $field "prefillRouting")) $tier }}
{{- end }}
{{- end }}
{{- if or $model.apiKey $model.ca }}
{{- if ne $upstream "openai" }}
{{- fail (printf "models[%d] (%s): apiKey and ca are for upstream openai" $i $model.name) }}
{{- end }}
{{- end }}
{{- if $model.apiKey }}
{{- $_ := set $entry "api_key_env" (include "furnace-gateway.apiKeyEnv" $i) }}
{{- end }}
{{- if $model.ca }}
{{- $_ := set $entry "ca_file" (printf "%s/ca.crt" (include "furnace-gateway.upstreamCADir" $i)) }}
{{- end }}
{{- $models = append $models $entry }}
{{- end }}
{{- end }}
{{- $config := deepCopy .Values.gateway.config }}
{{- $_ := set $config "host" "0.0.0.0" }}
{{- $_ := set $config "port" (int .Values.gateway.port) }}
{{- $_ := set $config "admin_port" (int .Values.gateway.adminPort) }}
{{- $_ := set $config "drain_timeout" (int .Values.gateway.drainTimeout) }}
{{- $_ := set $config "models" $models }}
{{- $names := list }}
{{- range $models }}
{{- $names = append $names .name }}
{{- end }}
{{- with .Values.gateway.teams }}
{{- range $team, $settings := . }}
{{- range $j, $model := ($settings | default dict).models | default list }}
{{- if not (has $model $names) }}
{{- fail (printf "gateway.teams.%s.models[%d]: %q is not a model of models" $team $j $model) }}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := set $config "teams" . }}
{{- end }}
{{- if .Values.gateway.keys.existingSecret }}
{{- $_ := set $config "keys_file" (printf "%s/keys.yaml" (include "furnace-gateway.keysDir" .)) }}
{{- end }}
{{- with .Values.gateway.workerTLS }}
{{- if .existingSecret }}
{{- $dir := include "furnace-gateway.workerTLSDir" $root }}
{{- $tls := dict "ca_file" (printf "%s/ca.crt" $dir) "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) }}
{{- with .serverName }}
{{- $_ := set $tls "server_name" . }}
{{- end }}
{{- $_ := set $config "worker_tls" $tls }}
{{- end }}
{{- end }}
{{- include "furnace-gateway.failClosed" . }}
{{- include "furnace-gateway.sharedLimits" . }}
{{- toYaml $config }}
{{- end }}

{{/* Fail-closed: a public route, a Service reachable from outside the cluster (NodePort,
LoadBalancer) or product teams with no API keys is refused, unless
`gateway.allowUnauthenticated` says so out loud. */}}
{{- define "furnace-gateway.failClosed" -}}
{{- if and (not .Values.gateway.keys.existingSecret) (not .Values.gateway.allowUnauthenticated) }}
{{- if or .Values.ingress.enabled .Values.httpRoute.enabled }}
{{- fail "ingress.enabled or httpRoute.enabled exposes the gateway with no API keys: set gateway.keys.existingSecret (a Secret with the keys file), or gateway.allowUnauthenticated=true to serve anyone who reaches it" }}
{{- end }}
{{- if ne .Values.service.type "ClusterIP" }}
{{- fail (printf "service.type=%s exposes the gateway with no API keys: set gateway.keys.existingSecret (a Secret with the keys file), or gateway.allowUnauthenticated=true to serve anyone who reaches it" .Values.service.type) }}
{{- end }}
{{- if .Values.gateway.teams }}
{{- fail "gateway.teams is set with no API keys to name the teams: set gateway.keys.existingSecret (a Secret with the keys file), or gateway.allowUnauthenticated=true" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Teams' limits and budgets without Redis live in each gateway's memory: with more than
one gateway pod (replicaCount > 1, or the autoscaler) each enforces every limit in full, and
a restart (any `helm upgrade`) forgets what budgets have counted. Refused, unless
`gateway.allowLocalLimits` says so out loud. */}}
{{- define "furnace-gateway.sharedLimits" -}}
{{- $redis := .Values.gateway.redis }}
{{- $pods := or .Values.autoscaling.enabled (gt (int .Values.gateway.replicaCount) 1) }}
{{- if and $pods (not (or $redis.url $redis.existingSecret)) (not .Values.gateway.allowLocalLimits) }}
{{- range $name, $team := .Values.gateway.teams }}
{{- $team = $team | default dict }}
{{- range $field := list "max_concurrent_requests" "requests_per_minute" "tokens_per_minute" "budgets" }}
{{- if index $team $field }}
{{- fail (printf "gateway.teams.%s.%s without Redis on more than one gateway pod (replicaCount > 1 or autoscaling): each pod would enforce it in full, and a restart forgets budgets; set gateway.redis.existingSecret (or url) to share limits and budgets, or gateway.allowLocalLimits=true to keep them per pod" $name $field) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The path prefixes the Ingress and the HTTPRoute route to the gateway. */}}
{{- define "furnace-gateway.exposedPathPrefixes" -}}
{{- $prefixes := .Values.exposedPathPrefixes | default list }}
{{- if not $prefixes }}
{{- fail "exposedPathPrefixes is empty: an Ingress or HTTPRoute would route nothing" }}
{{- end }}
{{- toYaml $prefixes }}
{{- end }}

{{/* The emptyDir of /tmp, with its size limit; argument: the limit. */}}
{{- define "furnace-gateway.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ . }}
{{- end }}

{{/* Where the gateway finds the Secrets it mounts: the API keys and the worker TLS files
(outside /etc/furnace, the read-only ConfigMap, which cannot hold mount points). */}}
{{- define "furnace-gateway.keysDir" -}}/etc/furnace-keys{{- end }}
{{- define "furnace-gateway.workerTLSDir" -}}/etc/furnace-worker-tls{{- end }}
{{- define "furnace-gateway.poolTLSDir" -}}/etc/furnace-tls{{- end }}

{{/* The Secret the chart creates for `gateway.redis.url`. */}}
{{- define "furnace-gateway.redisSecretName" -}}
{{- printf "%s-redis" (include "furnace-gateway.fullname" .) }}
{{- end }}

{{/* The Secret and key that hold the Redis URL, as (dict "name" "key"); empty when Redis
is off. */}}
{{- define "furnace-gateway.redisSecretRef" -}}
{{- $redis := .Values.gateway.redis }}
{{- if and $redis.url $redis.existingSecret }}
{{- fail "gateway.redis: set url or existingSecret, not both" }}
{{- end }}
{{- if $redis.url }}
{{- toYaml (dict "name" (include "furnace-gateway.redisSecretName" .) "key" "redis-url") }}
{{- else if $redis.existingSecret }}
{{- toYaml (dict "name" $redis.existingSecret "key" $redis.key) }}
{{- end }}
{{- end }}
