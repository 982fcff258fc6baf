{{/* Worker pod spec, shared by the Deployment and the DaskCluster. */}}
{{- define "clusterkit.workerPod" -}}
automountServiceAccountToken: false
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.worker.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.worker.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.worker.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: worker
    image: {{ include "clusterkit.image" . | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args:
      {{- include "clusterkit.workerArgs" . | trim | nindent 6 }}
    ports:
      - name: http-dashboard
        containerPort: {{ .Values.worker.dashboardPort }}
        protocol: TCP
    env:
      {{- include "clusterkit.env" . | nindent 6 }}
    {{- include "clusterkit.probes" (dict "port" "http-dashboard") | nindent 4 }}
    resources:
      {{- include "clusterkit.workerResources" . | nindent 6 }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      {{- include "clusterkit.volumeMounts" (dict "root" . "component" "worker") | nindent 6 }}
volumes:
  {{- include "clusterkit.volumes" (dict "root" . "component" "worker") | nindent 2 }}
{{- end -}}
