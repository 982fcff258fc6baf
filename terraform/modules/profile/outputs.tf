output "name" {
  description = "Cluster name (Helm release and resource prefix)."
  value       = var.name
}

output "namespace" {
  description = "Namespace of the cluster."
  value       = var.namespace
}

output "scheduler_service" {
  description = "Name of the scheduler Service."
  value       = local.scheduler_service
}

output "scheduler_address" {
  description = "Address clients connect to, e.g. tcp://NAME-scheduler.NS.svc.cluster.local:8786."
  value       = local.scheduler_address
}

output "tls_secret_name" {
  description = "The given Secret every pod mounts for protocol tls ('' when the chart generates its certificates or without tls)."
  value       = var.tls_secret_name
}

output "tls_generated" {
  description = "Whether the chart generates its own CA and certificates (protocol tls, no tls_secret_name)."
  value       = local.tls_generated
}

output "client_tls_secret" {
  description = "Secret with the client certificate, its key and the CA: the profile's tls files come from it ('' without tls). Reading it grants running code on the cluster."
  value       = local.client_tls_secret
}

output "client_tls_fetch" {
  description = "Shell commands that copy the client Secret into the owner-only files the profile names ('' without tls)."
  value       = local.client_tls_fetch
}

output "dask_workers" {
  description = "Dask worker processes that attach (pods x max(1, GPUs per pod))."
  value       = local.dask_workers
}

output "total_gpus" {
  description = "GPUs requested by all worker pods."
  value       = local.total_gpus
}

output "helm_values" {
  description = "Values for charts/clusterkit."
  value       = local.helm_values
}

output "helm_values_yaml" {
  description = "The same values as YAML, for helm_release.values or `helm install -f`."
  value       = yamlencode(local.helm_values)
}

output "profile" {
  description = "The clusterkit `address` profile researchers attach with."
  value       = local.profile
}

output "profile_yaml" {
  description = "The profile as YAML: save as ~/.config/clusterkit/profiles/NAME.yaml."
  value       = yamlencode(local.profile)
}
