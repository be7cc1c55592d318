{{/*
Names. The fullname is the release name when it contains the chart name ("gpumeter"), else "<release>-gpumeter",
so the release "gpumeter" names its objects as deploy/kubernetes does (gpumeter-collector, gpumeter-billing, ...).
*/}}
{{- define "gpumeter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpumeter.fullname" -}}
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

{{/* "<fullname>-<component>": the name of a role's objects. Call with (list $ "billing"). */}}
{{- define "gpumeter.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "gpumeter.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* A collector pool's DaemonSet and ConfigMap name: the "default" pool keeps the plain name. (list $ $pool) */}}
{{- define "gpumeter.collectorPoolName" -}}
{{- $root := index . 0 -}}
{{- $pool := index . 1 -}}
{{- if eq $pool.name "default" }}
{{- include "gpumeter.componentName" (list $root "collector") }}
{{- else }}
{{- printf "%s-%s" (include "gpumeter.componentName" (list $root "collector")) $pool.name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Labels. Selector labels: name, instance, component (immutable once a workload exists). Object labels add part-of,
version and Helm's own (helm.sh/chart, managed-by). Call with (list $ "component"); an empty component for objects
shared by every role (the Kafka ConfigMap).
*/}}
{{- define "gpumeter.selectorLabels" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
app.kubernetes.io/name: {{ include "gpumeter.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- if $component }}
app.kubernetes.io/component: {{ $component }}
{{- end }}
{{- end }}

{{- define "gpumeter.labels" -}}
{{- $root := index . 0 -}}
{{ include "gpumeter.selectorLabels" . }}
app.kubernetes.io/part-of: gpumeter
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpumeter.image" -}}
{{- $image := .Values.image -}}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag | toString) }}
{{- end }}
{{- end }}

{{/* Secret names: the value, else "<fullname>-<suffix>". (list $ .Values.kafka.sasl.passwordSecret.name "kafka") */}}
{{- define "gpumeter.secretName" -}}
{{- $root := index . 0 -}}
{{- default (include "gpumeter.componentName" (list $root (index . 2))) (index . 1) }}
{{- end }}

{{- define "gpumeter.kafkaSecurityProtocol" -}}
{{- $kafka := .Values.kafka -}}
{{- if and $kafka.sasl.enabled $kafka.tls.enabled }}SASL_SSL
{{- else if $kafka.sasl.enabled }}SASL_PLAINTEXT
{{- else if $kafka.tls.enabled }}SSL
{{- else }}PLAINTEXT
{{- end }}
{{- end }}

{{- define "gpumeter.kafkaTlsMountPath" -}}/etc/gpumeter/kafka-tls{{- end }}

{{/* Every gpumeter container: the Kafka ConfigMap, then its own variables. */}}
{{- define "gpumeter.kafkaEnvFrom" -}}
- configMapRef:
    name: {{ include "gpumeter.componentName" (list . "kafka") }}
{{- end }}

{{/* The SASL password from its Secret: optional while SASL is off, so one Secret-less install works unchanged. */}}
{{- define "gpumeter.kafkaPasswordEnv" -}}
- name: GPUMETER_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "gpumeter.secretName" (list . .Values.kafka.sasl.passwordSecret.name "kafka") }}
      key: {{ .Values.kafka.sasl.passwordSecret.key }}
      {{- if not .Values.kafka.sasl.enabled }}
      optional: true
      {{- end }}
{{- end }}

{{/* Mounts and volumes of the Kafka TLS files (CA, client certificate), when configured. */}}
{{- define "gpumeter.kafkaTlsMounts" -}}
{{- $tls := .Values.kafka.tls -}}
{{- if and $tls.enabled $tls.caSecret.name }}
- name: kafka-ca
  mountPath: {{ include "gpumeter.kafkaTlsMountPath" . }}/ca
  readOnly: true
{{- end }}
{{- if and $tls.enabled $tls.clientCertSecret }}
- name: kafka-client-cert
  mountPath: {{ include "gpumeter.kafkaTlsMountPath" . }}/client
  readOnly: true
{{- end }}
{{- end }}

{{- define "gpumeter.kafkaTlsVolumes" -}}
{{- $tls := .Values.kafka.tls -}}
{{- if and $tls.enabled $tls.caSecret.name }}
- name: kafka-ca
  secret:
    secretName: {{ $tls.caSecret.name }}
    items:
      - key: {{ $tls.caSecret.key }}
        path: ca.crt
{{- end }}
{{- if and $tls.enabled $tls.clientCertSecret }}
- name: kafka-client-cert
  secret:
    secretName: {{ $tls.clientCertSecret }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end }}

{{/* The pod security context of every role but the collector: the "restricted" Pod Security Standard. */}}
{{- define "gpumeter.restrictedPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "gpumeter.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Probes of a long-running role: started and ready once /metrics answers; alive while its loop goes round
(/healthz, gpumeter.health). (list $startupFailureThreshold) */}}
{{- define "gpumeter.probes" -}}
startupProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 5
  failureThreshold: {{ index . 0 }}
readinessProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 10
  timeoutSeconds: 5
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 3
{{- end }}

{{/* Scheduling keys of a Deployment's pod spec, each only when set. (a role's values) */}}
{{- define "gpumeter.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}

{{- define "gpumeter.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* The metrics Service of a role. (list $ "component" port headless) */}}
{{- define "gpumeter.metricsService" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $port := index . 2 -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "gpumeter.componentName" (list $root $component) }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "gpumeter.labels" (list $root $component) | nindent 4 }}
  {{- if $root.Values.metrics.serviceAnnotations }}
  annotations:
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $port | quote }}
    prometheus.io/path: /metrics
  {{- end }}
spec:
  {{- if index . 3 }}
  clusterIP: None
  {{- end }}
  selector:
    {{- include "gpumeter.selectorLabels" (list $root $component) | nindent 4 }}
  ports:
    - name: metrics
      port: {{ $port }}
      targetPort: metrics
      protocol: TCP
{{- end }}

{{/* Settings the chart does not pass yet fail the render rather than being ignored; pool names are unique (the
schema in values.schema.json checks the rest, a nodeSelector on every pool included). */}}
{{- define "gpumeter.checkValues" -}}
{{- if .Values.metrics.address }}
{{- fail "metrics.address: the services do not read GPUMETER_METRICS_ADDRESS yet; leave it unset (0.0.0.0)" }}
{{- end }}
{{- $names := list }}
{{- range .Values.collector.nodePools }}
{{- if has .name $names }}
{{- fail (printf "collector.nodePools: the pool name %q is used twice" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- end }}
{{- end }}
