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
  description = "The given TLS Secret ('' when the chart generates its certificates or without tls)."
  value       = module.profile.tls_secret_name
}

output "client_tls_secret" {
  description = "Secret with the client certificate, key and CA the profile's tls files come from ('' without tls)."
  value       = module.profile.client_tls_secret
}

output "client_tls_fetch" {
  description = "Shell commands that copy the client Secret into owner-only files for the profile."
  value       = module.profile.client_tls_fetch
}

output "profile" {
  description = "The clusterkit `address` profile, as YAML: save as ~/.config/clusterkit/profiles/NAME.yaml."
  value       = module.profile.profile_yaml
}

output "release_status" {
  description = "Status of the Helm release."
  value       = helm_release.this.status
}
