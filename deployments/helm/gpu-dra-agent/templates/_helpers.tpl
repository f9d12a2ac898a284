{{/* The namespace everything goes into. */}}
{{- define "gpu-dra-agent.namespace" -}}
{{- .Values.namespaceOverride | default .Release.Namespace -}}
{{- end -}}

{{- define "gpu-dra-agent.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* KUBERNETES_SERVICE_HOST/PORT for in-cluster clients, where apiServer says where the API server is. */}}
{{- define "gpu-dra-agent.apiServerEnv" -}}
{{- $env := list -}}
{{- with .Values.apiServer.host }}{{ $env = append $env (dict "name" "KUBERNETES_SERVICE_HOST" "value" (toString .)) }}{{ end -}}
{{- with .Values.apiServer.port }}{{ $env = append $env (dict "name" "KUBERNETES_SERVICE_PORT" "value" (toString .)) }}{{ end -}}
{{- toJson $env -}}
{{- end -}}

{{/* `.env` with `.extra` after it, an entry of `.extra` replacing the one of `.env` of the same name (a
container's env is merged by name: two of one name would be refused by server-side apply). */}}
{{- define "gpu-dra-agent.mergeEnv" -}}
{{- $names := list -}}
{{- range .extra }}{{ $names = append $names .name }}{{ end -}}
{{- $env := list -}}
{{- range .env }}{{ if not (has .name $names) }}{{ $env = append $env . }}{{ end }}{{ end -}}
{{- toJson (concat $env .extra) -}}
{{- end -}}

{{/* The DaemonSet's host paths, each mounted at the same path in the pod, as the values say. */}}
{{- define "gpu-dra-agent.nodePaths" -}}
{{- $k := .kubeletPlugin -}}
{{- toJson (dict "plugins" (printf "%s/plugins" (trimSuffix "/" $k.kubeletRoot)) "plugins-registry" (printf "%s/plugins_registry" (trimSuffix "/" $k.kubeletRoot)) "cdi" $k.cdiRoot "state" $k.stateDir) -}}
{{- end -}}

{{/* The node agent's DaemonSet (base/daemonset.yaml) as the values say; `.obj` is changed in place. */}}
{{- define "gpu-dra-agent.daemonset" -}}
{{- $v := .root.Values -}}
{{- $_ := set .obj.spec "updateStrategy" $v.kubeletPlugin.updateStrategy -}}
{{- $meta := .obj.spec.template.metadata -}}
{{- with $v.kubeletPlugin.podAnnotations }}{{ $_ := set $meta "annotations" . }}{{ end -}}
{{- $pod := .obj.spec.template.spec -}}
{{- $_ := set $pod "priorityClassName" $v.kubeletPlugin.priorityClassName -}}
{{- $_ := set $pod "nodeSelector" $v.kubeletPlugin.nodeSelector -}}
{{- $_ := set $pod "tolerations" $v.kubeletPlugin.tolerations -}}
{{- with $v.imagePullSecrets }}{{ $_ := set $pod "imagePullSecrets" . }}{{ end -}}
{{- if $v.kubeletPlugin.hostNetwork }}{{ $_ := set $pod "hostNetwork" true }}{{ end -}}
{{- if not $v.resources.gpus.enabled -}}
{{- /* overlays/compute-domains-only: no MIG configs to mount */ -}}
{{- $volumes := list -}}
{{- range $pod.volumes }}{{ if ne .name "mig-parted-config" }}{{ $volumes = append $volumes . }}{{ end }}{{ end -}}
{{- $_ := set $pod "volumes" $volumes -}}
{{- $mounts := list -}}
{{- range (index $pod.containers 0).volumeMounts }}{{ if ne .name "mig-parted-config" }}{{ $mounts = append $mounts . }}{{ end }}{{ end -}}
{{- $_ := set (index $pod.containers 0) "volumeMounts" $mounts -}}
{{- end -}}
{{- $paths := include "gpu-dra-agent.nodePaths" $v | fromJson -}}
{{- range $pod.volumes }}{{ if eq .name "driver-root" }}{{ $_ := set .hostPath "path" $v.nvidiaDriverRoot }}{{ end }}{{ end -}}
{{- range $pod.volumes }}{{ if hasKey $paths .name }}{{ $_ := set .hostPath "path" (get $paths .name) }}{{ end }}{{ end -}}
{{- $agent := index $pod.containers 0 -}}
{{- range $agent.volumeMounts }}{{ if hasKey $paths .name }}{{ $_ := set . "mountPath" (get $paths .name) }}{{ end }}{{ end -}}
{{- $metricsPort := int $v.kubeletPlugin.metricsPort -}}
{{- $healthPort := int $v.kubeletPlugin.healthcheckPort -}}
{{- range $agent.ports -}}
{{- if eq .name "metrics" }}{{ $_ := set . "containerPort" $metricsPort }}{{ end -}}
{{- if eq .name "healthz" }}{{ $_ := set . "containerPort" $healthPort }}{{ end -}}
{{- end -}}
{{- $_ := set $agent.livenessProbe.grpc "port" $healthPort -}}
{{- $gpus := $v.kubeletPlugin.containers.gpus -}}
{{- $_ := set $agent "image" (include "gpu-dra-agent.image" .root) -}}
{{- $_ := set $agent "imagePullPolicy" $v.image.pullPolicy -}}
{{- $_ := set $agent "resources" $gpus.resources -}}
{{- $_ := set $agent "securityContext" $gpus.securityContext -}}
{{- $env := list -}}
{{- range $agent.env -}}
{{- if eq .name "NVIDIA_HOST_DRIVER_ROOT" }}{{ $_ := set . "value" $v.nvidiaDriverRoot }}{{ end -}}
{{- if eq .name "KUBELET_ROOT" }}{{ $_ := set . "value" $v.kubeletPlugin.kubeletRoot }}{{ end -}}
{{- if eq .name "CDI_ROOT" }}{{ $_ := set . "value" $v.kubeletPlugin.cdiRoot }}{{ end -}}
{{- if eq .name "STATE_DIR" }}{{ $_ := set . "value" $v.kubeletPlugin.stateDir }}{{ end -}}
{{- if eq .name "METRICS_ADDR" }}{{ $_ := set . "value" (printf "0.0.0.0:%d" $metricsPort) }}{{ end -}}
{{- if eq .name "HEALTHCHECK_ADDR" }}{{ $_ := set . "value" (printf "0.0.0.0:%d" $healthPort) }}{{ end -}}
{{- if or $v.resources.gpus.enabled (ne .name "MIG_CONFIG_FILE") }}{{ $env = append $env . }}{{ end -}}
{{- end -}}
{{- if not $v.resources.gpus.enabled }}{{ $env = append $env (dict "name" "GPUS" "value" "false") }}{{ end -}}
{{- if ne $v.kubeletPlugin.devRoot "/" }}{{ $env = append $env (dict "name" "NVIDIA_DEV_ROOT" "value" $v.kubeletPlugin.devRoot) }}{{ end -}}
{{- with $v.nvidiaCDIHookPath }}{{ $env = append $env (dict "name" "NVIDIA_CDI_HOOK_PATH" "value" .) }}{{ end -}}
{{- with $v.consumableShares }}{{ $env = append $env (dict "name" "CONSUMABLE_SHARES" "value" .) }}{{ end -}}
{{- if $v.partitionableDevices }}{{ $env = append $env (dict "name" "PARTITIONABLE_DEVICES" "value" "true") }}{{ end -}}
{{- if $v.arbiter.enabled -}}
{{- /* overlays/arbiter: the reservation API the arbiter calls, on the node's IP */ -}}
{{- $env = append $env (dict "name" "RESERVATION_ADDR" "value" "0.0.0.0:7070") -}}
{{- $env = append $env (dict "name" "NODE_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.hostIP"))) -}}
{{- $_ := set $agent "ports" (append $agent.ports (dict "name" "reservation" "containerPort" 7070 "protocol" "TCP")) -}}
{{- $ns := include "gpu-dra-agent.namespace" .root -}}
{{- if ne $ns "gpu-dra-agent" -}}{{- /* the agent's default names the arbiter's account in gpu-dra-agent */ -}}
{{- $env = append $env (dict "name" "ARBITER_USER" "value" (printf "system:serviceaccount:%s:gpu-dra-agent-arbiter" $ns)) -}}
{{- end -}}
{{- end -}}
{{- if $v.resources.computeDomains.enabled -}}
{{- /* overlays/compute-domains: the second driver; its IMEX daemons listen on the pod's IP */ -}}
{{- $env = append $env (dict "name" "COMPUTE_DOMAINS" "value" "true") -}}
{{- $env = append $env (dict "name" "POD_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP"))) -}}
{{- end -}}
{{- $extra := concat (include "gpu-dra-agent.apiServerEnv" .root | fromJsonArray) $gpus.env -}}
{{- $_ := set $agent "env" (include "gpu-dra-agent.mergeEnv" (dict "env" $env "extra" $extra) | fromJsonArray) -}}
{{- end -}}

{{/* The arbiter's Deployment (overlays/arbiter/arbiter.yaml) as the values say; `.obj` is changed in place. */}}
{{- define "gpu-dra-agent.arbiter" -}}
{{- $v := .root.Values -}}
{{- $_ := set .obj.spec "replicas" $v.arbiter.replicas -}}
{{- $pod := .obj.spec.template.spec -}}
{{- with $v.imagePullSecrets }}{{ $_ := set $pod "imagePullSecrets" . }}{{ end -}}
{{- $arbiter := index $pod.containers 0 -}}
{{- $_ := set $arbiter "image" (include "gpu-dra-agent.image" .root) -}}
{{- $_ := set $arbiter "imagePullPolicy" $v.image.pullPolicy -}}
{{- $_ := set $arbiter "resources" $v.arbiter.resources -}}
{{- if $v.arbiter.hostNetwork }}{{ $_ := set $pod "hostNetwork" true }}{{ end -}}
{{- $port := int $v.arbiter.metricsPort -}}
{{- if $port }}
{{- range $arbiter.ports }}{{ if eq .name "metrics" }}{{ $_ := set . "containerPort" $port }}{{ end }}{{ end -}}
{{- else }}{{ $_ := unset $arbiter "ports" }}{{ end -}}
{{- $env := list -}}
{{- range $arbiter.env -}}
{{- if eq .name "GPU_PLACEMENT" }}{{ $_ := set . "value" $v.arbiter.gpuPlacement }}{{ end -}}
{{- if eq .name "METRICS_ADDR" }}{{ $_ := set . "value" (printf ":%d" $port) }}{{ end -}}
{{- /* port 0: no endpoint, said as an empty flag (an empty variable means the default, :9401) */ -}}
{{- if or $port (ne .name "METRICS_ADDR") }}{{ $env = append $env . }}{{ end -}}
{{- end -}}
{{- if not $port }}{{ $_ := set $arbiter "command" (append $arbiter.command "--metrics-addr=") }}{{ end -}}
{{- $extra := concat (include "gpu-dra-agent.apiServerEnv" .root | fromJsonArray) $v.arbiter.env -}}
{{- $_ := set $arbiter "env" (include "gpu-dra-agent.mergeEnv" (dict "env" $env "extra" $extra) | fromJsonArray) -}}
{{- end -}}

{{/* The ComputeDomain controller's Deployment (overlays/compute-domains/controller.yaml) as the values say; `.obj`
is changed in place. Values left empty keep the manifest's. */}}
{{- define "gpu-dra-agent.computeDomainController" -}}
{{- $v := .root.Values -}}
{{- $c := $v.controller -}}
{{- with $c.replicas }}{{ $_ := set $.obj.spec "replicas" . }}{{ end -}}
{{- $pod := .obj.spec.template.spec -}}
{{- with $v.imagePullSecrets }}{{ $_ := set $pod "imagePullSecrets" . }}{{ end -}}
{{- with $c.priorityClassName }}{{ $_ := set $pod "priorityClassName" . }}{{ end -}}
{{- with $c.nodeSelector }}{{ $_ := set $pod "nodeSelector" . }}{{ end -}}
{{- with $c.tolerations }}{{ $_ := set $pod "tolerations" . }}{{ end -}}
{{- with $c.affinity }}{{ $_ := set $pod "affinity" . }}{{ end -}}
{{- if $c.hostNetwork }}{{ $_ := set $pod "hostNetwork" true }}{{ end -}}
{{- $controller := index $pod.containers 0 -}}
{{- $_ := set $controller "image" (include "gpu-dra-agent.image" .root) -}}
{{- $_ := set $controller "imagePullPolicy" $v.image.pullPolicy -}}
{{- $own := $c.containers.computeDomain -}}
{{- with $own.resources }}{{ $_ := set $controller "resources" . }}{{ end -}}
{{- $extra := concat (include "gpu-dra-agent.apiServerEnv" .root | fromJsonArray) $own.env -}}
{{- $_ := set $controller "env" (include "gpu-dra-agent.mergeEnv" (dict "env" $controller.env "extra" $extra) | fromJsonArray) -}}
{{- end -}}
