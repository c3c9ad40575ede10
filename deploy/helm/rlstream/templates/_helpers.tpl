{{/* Names, labels, the environment every rlstream process shares, and the render-time checks. */}}

{{- define "rlstream.fullname" -}}
{{- printf "%s" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlstream.labels" -}}
app.kubernetes.io/name: rlstream
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
rlstream.dev/run: {{ .Values.run | quote }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "rollout") */}}
{{- define "rlstream.selector" -}}
app.kubernetes.io/name: rlstream
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rlstream.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{- define "rlstream.kafkaCluster" -}}
{{- .Values.kafka.strimzi.clusterName | default (printf "%s-kafka" (include "rlstream.fullname" .)) -}}
{{- end -}}

{{- define "rlstream.bootstrap" -}}
{{- if eq .Values.kafka.mode "strimzi" -}}
{{- printf "%s-kafka-bootstrap:9092" (include "rlstream.kafkaCluster" .) -}}
{{- else -}}
{{- required "kafka.existing.bootstrap: the host:port of your cluster (kafka.mode existing)" .Values.kafka.existing.bootstrap -}}
{{- end -}}
{{- end -}}

{{- define "rlstream.archiveUrl" -}}
{{- if eq .Values.archive.mode "clickhouse" -}}
{{- printf "http://%s-clickhouse:8123" (include "rlstream.fullname" .) -}}
{{- else if eq .Values.archive.mode "url" -}}
{{- required "archive.url: the http(s)://HOST:PORT of your ClickHouse server (archive.mode url)" .Values.archive.url -}}
{{- else -}}
chdb:///data/archive
{{- end -}}
{{- end -}}

{{/* A K8s-safe name of one of the run's topics. */}}
{{- define "rlstream.topicResource" -}}
{{- printf "%s-%s" (.run | lower | replace "_" "-" | replace "." "-") .topic | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Partitions of one logical topic, as rlstream.kafka.topics.partition_counts computes them:
     (dict "root" $ "topic" "prompts") */}}
{{- define "rlstream.partitions" -}}
{{- $v := .root.Values -}}
{{- $spec := index $v.topology.topics .topic -}}
{{- $count := $spec.partitions -}}
{{- if and (not (kindIs "invalid" $v.topics.partitions)) (ne .topic "policy-versions") -}}
{{- $count = $v.topics.partitions -}}
{{- end -}}
{{- if hasKey $v.topics.overrides .topic -}}
{{- $count = index $v.topics.overrides .topic -}}
{{- end -}}
{{- int $count -}}
{{- end -}}

{{/* The most useful consumers of a stage's group: the most partitions among its inputs. */}}
{{- define "rlstream.stagePartitions" -}}
{{- $most := 0 -}}
{{- range (index .root.Values.topology.inputs .stage) -}}
{{- $n := int (include "rlstream.partitions" (dict "root" $.root "topic" .)) -}}
{{- if gt $n $most }}{{ $most = $n }}{{ end -}}
{{- end -}}
{{- $most -}}
{{- end -}}

{{/* Environment of every rlstream process: the run, the broker, the archive, metrics, secrets. */}}
{{- define "rlstream.env" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: RLSTREAM_RUN
  value: {{ .Values.run | quote }}
- name: RLSTREAM_POLICY
  value: {{ .Values.policy | quote }}
- name: RLSTREAM_BOOTSTRAP
  value: {{ include "rlstream.bootstrap" . | quote }}
- name: RLSTREAM_ARCHIVE
  value: {{ include "rlstream.archiveUrl" . | quote }}
{{- if eq .Values.kafka.mode "existing" }}
{{- with .Values.kafka.existing }}
{{- if .config }}
- name: RLSTREAM_KAFKA_CONFIG
  value: {{ .config | quote }}
{{- end }}
{{- if .securityProtocol }}
- name: RLSTREAM_KAFKA_SECURITY_PROTOCOL
  value: {{ .securityProtocol | quote }}
{{- end }}
{{- if .saslMechanism }}
- name: RLSTREAM_KAFKA_SASL_MECHANISM
  value: {{ .saslMechanism | quote }}
{{- end }}
{{- if .saslSecret.name }}
- name: RLSTREAM_KAFKA_SASL_USERNAME
  valueFrom: {secretKeyRef: {name: {{ .saslSecret.name }}, key: {{ .saslSecret.usernameKey }}}}
- name: RLSTREAM_KAFKA_SASL_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ .saslSecret.name }}, key: {{ .saslSecret.passwordKey }}}}
{{- end }}
{{- if .caSecret.name }}
- name: RLSTREAM_KAFKA_SSL_CA_LOCATION
  value: /etc/rlstream/kafka-ca/{{ .caSecret.key }}
{{- end }}
{{- end }}
{{- end }}
{{- if ne .Values.archive.mode "chdb" }}
- name: RLSTREAM_CLICKHOUSE_USER
  valueFrom: {secretKeyRef: {name: {{ .Values.archive.credentialsSecret.name }}, key: {{ .Values.archive.credentialsSecret.usernameKey }}}}
- name: RLSTREAM_CLICKHOUSE_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ .Values.archive.credentialsSecret.name }}, key: {{ .Values.archive.credentialsSecret.passwordKey }}}}
{{- end }}
{{- range $k, $v := .Values.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* Where a process that serves /metrics (stages, gateway, trainer) serves it: every interface, for Prometheus. */}}
{{- define "rlstream.metricsEnv" -}}
- name: RLSTREAM_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: RLSTREAM_METRICS_ADDR
  value: 0.0.0.0
{{- end -}}

{{/* Volumes and mounts every rlstream pod needs beside its own: the brokers' CA. */}}
{{- define "rlstream.commonVolumes" -}}
{{- if and (eq .Values.kafka.mode "existing") .Values.kafka.existing.caSecret.name }}
- name: kafka-ca
  secret: {secretName: {{ .Values.kafka.existing.caSecret.name }}}
{{- end }}
{{- end -}}
{{- define "rlstream.commonMounts" -}}
{{- if and (eq .Values.kafka.mode "existing") .Values.kafka.existing.caSecret.name }}
- name: kafka-ca
  mountPath: /etc/rlstream/kafka-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "rlstream.podAnnotations" -}}
{{- if .Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* Resources with the GPU request: (dict "resources" ... "gpus" N) */}}
{{- define "rlstream.resources" -}}
{{- $r := deepCopy (.resources | default dict) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := merge (dict "nvidia.com/gpu" (int .gpus)) ($r.limits | default dict) -}}
{{- $requests := merge (dict "nvidia.com/gpu" (int .gpus)) ($r.requests | default dict) -}}
{{- $_ := set $r "limits" $limits -}}
{{- $_ := set $r "requests" $requests -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* Render-time refusals: values the run could not use. Included once, by stages.yaml. */}}
{{- define "rlstream.validate" -}}
{{- $v := .Values -}}
{{- if not (has $v.kafka.mode (list "strimzi" "existing")) -}}
{{- fail (printf "kafka.mode %q: strimzi or existing" $v.kafka.mode) -}}
{{- end -}}
{{- if not (has $v.archive.mode (list "clickhouse" "url" "chdb")) -}}
{{- fail (printf "archive.mode %q: clickhouse, url or chdb" $v.archive.mode) -}}
{{- end -}}
{{- range $t, $n := $v.topics.overrides -}}
{{- if not (hasKey $v.topology.topics $t) -}}
{{- fail (printf "topics.overrides: no topic %s; topics: %s" $t (keys $v.topology.topics | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- if ne (include "rlstream.partitions" (dict "root" $ "topic" "policy-versions")) "1" -}}
{{- fail "topics.overrides.policy-versions: policy-versions has one partition: it is the ordered log of the run's versions" -}}
{{- end -}}
{{- $co := list -}}
{{- range $v.topology.coPartitioned -}}
{{- $co = append $co (include "rlstream.partitions" (dict "root" $ "topic" .)) -}}
{{- end -}}
{{- if gt (len (uniq $co)) 1 -}}
{{- fail (printf "topics: %s must have the same partition count (each episode's turns come back to the rollout worker that holds its prefix cache); got %s" (join ", " $v.topology.coPartitioned) (join ", " $co)) -}}
{{- end -}}
{{- range $stage, $inputs := $v.topology.inputs -}}
{{- $s := index $v.stages $stage -}}
{{- if $s.enabled -}}
{{- $scaling := merge (deepCopy ($s.autoscaling | default dict)) $v.stageDefaults.autoscaling -}}
{{- $bound := int (include "rlstream.stagePartitions" (dict "root" $ "stage" $stage)) -}}
{{- $most := int $s.replicas -}}
{{- if $scaling.enabled }}{{ $most = int $scaling.maxReplicas }}{{ end -}}
{{- if gt $most $bound -}}
{{- fail (printf "stages.%s: %d replicas (%s) but its inputs (%s) have %d partitions: Kafka gives each partition to one member of the group %s.%s, so the replicas beyond %d would be idle (holding their nodes and GPUs for nothing). Lower it to %d or raise topics.partitions" $stage $most (ternary "autoscaling.maxReplicas" "replicas" $scaling.enabled) (join ", " $inputs) $bound $v.run $stage $bound $bound) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $stage := list "rollout" "env" "reward" "teacher" "archive" "gateway" -}}
{{- $s := index $v.stages $stage -}}
{{- $standby := merge (deepCopy ($s.standby | default dict)) $v.stageDefaults.standby -}}
{{- $scaling := merge (deepCopy ($s.autoscaling | default dict)) $v.stageDefaults.autoscaling -}}
{{- if and $s.enabled $standby.enabled -}}
{{- if eq $stage "gateway" -}}
{{- fail "stages.gateway.standby: the gateway has no consumer group for a standby to wait on; run replicas behind its Service instead" -}}
{{- end -}}
{{- if and (eq $stage "archive") (eq $v.archive.mode "chdb") -}}
{{- fail "stages.archive.standby: an embedded chDB archive lives on one pod's volume, which a standby pod cannot open; use archive.mode clickhouse or url, or turn its standby off" -}}
{{- end -}}
{{- if $scaling.enabled -}}
{{- fail (printf "stages.%s.standby: a standby stands by for one pod of a fixed set; with autoscaling the set changes. Turn one of them off" $stage) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.vllm.enabled $v.stages.rollout.enabled -}}
{{- $rs := merge (deepCopy ($v.stages.rollout.autoscaling | default dict)) $v.stageDefaults.autoscaling -}}
{{- if or (gt (int $v.stages.rollout.replicas) 1) $rs.enabled -}}
{{- fail "stages.rollout: with vllm.enabled one rollout worker drives the whole server fleet (it pushes every version to every server); scale vllm.replicas instead of rollout (replicas 1, autoscaling off)" -}}
{{- end -}}
{{- end -}}
{{- if and $v.trainer.enabled ($v.trainer.standby | default dict).enabled (not $v.trainer.store.url) (not $v.trainer.store.existingClaim) (not (has "ReadWriteMany" $v.trainer.store.accessModes)) -}}
{{- fail "trainer.standby: the standby gang resumes from the primary's store (its optimizer state too), from pods on other nodes: give an object store URL (trainer.store.url), an existing ReadWriteMany claim, or accessModes [ReadWriteMany]" -}}
{{- end -}}
{{- if and $v.trainer.enabled (gt (int $v.trainer.nodes) 1) (not $v.trainer.store.url) (not $v.trainer.store.existingClaim) (not (has "ReadWriteMany" $v.trainer.store.accessModes)) -}}
{{- fail "trainer.store: with more than one trainer node every rank writes its optimizer shard to the store: give an object store URL (trainer.store.url), an existing ReadWriteMany claim, or accessModes [ReadWriteMany]" -}}
{{- end -}}
{{- end -}}

{{/* Each vLLM server's stable URL, comma-separated (rollout's RLSTREAM_ROLLOUT_ENGINE_URL). */}}
{{- define "rlstream.vllmUrls" -}}
{{- $name := printf "%s-vllm" (include "rlstream.fullname" .) -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.vllm.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s:%d" $name $i $name (int $.Values.vllm.port)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{- define "rlstream.vllmClaim" -}}
{{- .Values.vllm.sharedVolume.existingClaim | default (printf "%s-shared" (include "rlstream.fullname" .)) -}}
{{- end -}}
