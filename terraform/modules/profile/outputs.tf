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
  description = "Secret the chart mounts for protocol tls ('' otherwise)."
  value       = local.tls_secret_name
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
