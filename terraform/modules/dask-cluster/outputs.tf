output "scheduler_address" {
  description = "Address clients connect to from inside the cluster."
  value       = module.profile.scheduler_address
}

output "dashboard_service" {
  description = "Service to port-forward for the dashboard (port 8787)."
  value       = "${var.namespace}/${module.profile.scheduler_service}"
}

output "dask_workers" {
  description = "Dask worker processes that attach."
  value       = module.profile.dask_workers
}

output "tls_secret_name" {
  description = "Secret the release mounts for TLS (create it before apply)."
  value       = module.profile.tls_secret_name
}

output "profile" {
  description = "The clusterkit `address` profile, as YAML: save as ~/.config/clusterkit/profiles/NAME.yaml."
  value       = module.profile.profile_yaml
}

output "release_status" {
  description = "Status of the Helm release."
  value       = helm_release.this.status
}
