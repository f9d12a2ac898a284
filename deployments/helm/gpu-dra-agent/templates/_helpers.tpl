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
{{- range $pod.volumes }}{{ if eq .name "driver-root" }}{{ $_ := set .hostPath "path" $v.nvidiaDriverRoot }}{{ end }}{{ end -}}
{{- $agent := index $pod.containers 0 -}}
{{- $gpus := $v.kubeletPlugin.containers.gpus -}}
{{- $_ := set $agent "image" (include "gpu-dra-agent.image" .root) -}}
{{- $_ := set $agent "imagePullPolicy" $v.image.pullPolicy -}}
{{- $_ := set $agent "resources" $gpus.resources -}}
{{- $_ := set $agent "securityContext" $gpus.securityContext -}}
{{- $env := list -}}
{{- range $agent.env -}}
{{- if eq .name "NVIDIA_HOST_DRIVER_ROOT" }}{{ $_ := set . "value" $v.nvidiaDriverRoot }}{{ end -}}
{{- $env = append $env . -}}
{{- end -}}
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
{{- $env = concat $env (include "gpu-dra-agent.apiServerEnv" .root | fromJsonArray) $gpus.env -}}
{{- $_ := set $agent "env" $env -}}
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
{{- range $arbiter.env }}{{ if eq .name "GPU_PLACEMENT" }}{{ $_ := set . "value" $v.arbiter.gpuPlacement }}{{ end }}{{ end -}}
{{- $_ := set $arbiter "env" (concat $arbiter.env (include "gpu-dra-agent.apiServerEnv" .root | fromJsonArray)) -}}
{{- end -}}
