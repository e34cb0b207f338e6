{{/* Helm's fullname convention: fullnameOverride as it is; else the release name, followed
by the chart's name (nameOverride) unless the release name already contains it, so that
`helm install dra-accel-driver` names objects dra-accel-driver-… and not
dra-accel-driver-dra-accel-driver-…, and cluster-scoped objects (ClusterRole, admission
policies) never collide with another release's. 40 characters at most, so that the
longest name (<fullname>-kubelet-plugin) stays a DNS label (63). DeviceClasses are the
exception: their names (gpu.<driverName>, ...) are what users' claims reference. */}}
{{- define "dra.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := .Values.nameOverride | default .Chart.Name -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dra.labels" -}}
app.kubernetes.io/name: dra-accel-driver
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dra.selectorLabels" -}}
app.kubernetes.io/name: dra-accel-driver
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dra.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dra.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The MPS control daemon pods' image: the DaemonSet hands it to the driver, and the
own-node-pods admission policy admits no other image in a pod the driver creates. */}}
{{- define "dra.mpsImage" -}}
{{- .Values.mps.image | default (printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion)) -}}
{{- end -}}

{{/* The newest resource.k8s.io version the cluster serves, unless set explicitly. Where
no cluster was asked (`helm template` without --validate: Helm then knows API groups but
no kinds), resource.k8s.io/v1, the version every supported cluster serves from 1.34 on;
v1beta1 is for 1.32 and 1.33 clusters, which say so. */}}
{{- define "dra.resourceApiVersion" -}}
{{- if .Values.deviceClasses.apiVersion -}}
{{- .Values.deviceClasses.apiVersion -}}
{{- else if .Capabilities.APIVersions.Has "resource.k8s.io/v1/DeviceClass" -}}
resource.k8s.io/v1
{{- else if .Capabilities.APIVersions.Has "resource.k8s.io/v1beta2/DeviceClass" -}}
resource.k8s.io/v1beta2
{{- else if .Capabilities.APIVersions.Has "resource.k8s.io/v1beta1/DeviceClass" -}}
resource.k8s.io/v1beta1
{{- else -}}
resource.k8s.io/v1
{{- end -}}
{{- end -}}

{{/* Values that would render a DaemonSet that cannot run: fail the render instead, with
what to change. */}}
{{- define "dra.validate" -}}
{{- if and .Values.nri.enabled (not .Values.privileged) }}
{{- fail "nri.enabled needs privileged: true: moving a NIC into a pod enters the pod's and the host's network namespaces (setns) and changes links over netlink" }}
{{- end }}
{{- if and .Values.metrics.port (eq (int .Values.metrics.port) (int .Values.healthz.port)) }}
{{- fail (printf "metrics.port and healthz.port are both %d: the driver serves /metrics and its probes on two ports and would stop at start (port in use); pick another port, or metrics.port=0 to disable metrics" (int .Values.healthz.port)) }}
{{- end }}
{{- if and .Values.acceleratorNodes.enabled (not .Values.mock.enabled) (not .Values.affinity) }}
{{- if not (include "dra.nodeLabels" . | fromJsonArray) }}
{{- fail "acceleratorNodes.labels and acceleratorNodes.extraLabels are both empty: the DaemonSet's node affinity would match no node. Name a node label, or set acceleratorNodes.enabled=false to run on every node (nodeSelector and affinity still apply)" }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The node labels of which any one puts a driver pod on a node (acceleratorNodes), as a
JSON list: the DaemonSet's affinity, the render's check and the install notes read the
same list. */}}
{{- define "dra.nodeLabels" -}}
{{- $labels := concat (.Values.acceleratorNodes.labels | default list) (.Values.acceleratorNodes.extraLabels | default list) }}
{{- if .Values.acceleratorNodes.sriovNics }}
{{- $labels = append $labels "feature.node.kubernetes.io/network-sriov.configured" }}
{{- end }}
{{- toJson $labels }}
{{- end -}}

{{/*
The DeviceClasses' extended resource names (KEP-5004) as a JSON map kind -> name, only
those set; two classes naming one resource fail the render, since the scheduler could
serve it from either.
*/}}
{{- define "dra.extendedResourceNames" -}}
{{- $names := dict }}
{{- $seen := dict }}
{{- range $kind, $name := (.Values.deviceClasses.extendedResourceNames | default dict) }}
{{- if $name }}
{{- if hasKey $seen $name }}
{{- fail (printf "deviceClasses.extendedResourceNames: %s is named by both the %s and the %s class; one extended resource is served by one DeviceClass" $name (get $seen $name) $kind) }}
{{- end }}
{{- $_ := set $seen $name $kind }}
{{- $_ := set $names $kind $name }}
{{- end }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/* Seamless upgrades (two pods of the driver side by side, unique socket names) need
kubelets 1.33 or newer: on an older cluster the chart replaces the pod in place instead,
whatever kubelet.seamlessUpgrade says (a 1.32 kubelet confuses the two instances: after an
upgrade, claims stopped being allocated on the node, tests/cluster/test_driver_pod.py on
1.32). The cluster's version stands for its kubelets'; set the value false where kubelets
lag the control plane below 1.33. */}}
{{- define "dra.seamlessUpgrade" -}}
{{- if and .Values.kubelet.seamlessUpgrade (semverCompare ">=1.33.0-0" .Capabilities.KubeVersion.Version) -}}
true
{{- end -}}
{{- end -}}
