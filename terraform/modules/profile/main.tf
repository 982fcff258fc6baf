# Provider-free logic of a clusterkit Dask cluster: names, sizing, the chart's values and the
# clusterkit `address` profile. Mirrors charts/clusterkit and clusterkit/exporters.py.

locals {
  image_pattern = "^(?P<repository>[^@\\s]+?)(?::(?P<tag>[^:/@\\s]+))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
  image_parts   = regex(local.image_pattern, var.image)
  image_tag     = coalesce(local.image_parts.tag, "latest")
  image_digest  = coalesce(local.image_parts.digest, "none") == "none" ? "" : local.image_parts.digest

  scheduler_service = "${var.name}-scheduler"
  scheduler_host    = "${local.scheduler_service}.${var.namespace}.svc.cluster.local"
  scheduler_address = "${var.protocol}://${local.scheduler_host}:8786"
  tls_secret_name   = var.protocol == "tls" ? coalesce(var.tls_secret_name, "${var.name}-tls") : ""
  tls_directory     = "~/.config/clusterkit/tls/${var.name}"

  # dask-cuda runs one worker process per GPU in a pod
  processes_per_pod = max(1, var.gpus_per_worker)
  dask_workers      = var.workers * local.processes_per_pod
  total_gpus        = var.workers * var.gpus_per_worker

  helm_values = {
    fullnameOverride = var.name
    image = {
      repository = local.image_parts.repository
      tag        = local.image_tag
      digest     = local.image_digest
      pullPolicy = var.image_pull_policy
    }
    protocol = var.protocol
    tls      = { secretName = local.tls_secret_name }
    env      = var.env
    scheduler = {
      service   = { type = var.service_type }
      resources = var.scheduler_resources
    }
    worker = {
      replicas      = var.workers
      threads       = var.threads_per_worker
      memoryLimit   = var.worker_memory
      gpus          = var.gpus_per_worker
      daskResources = var.dask_resources
      preload       = var.preload
      resources     = var.worker_resources
      nodeSelector  = var.node_selector
      tolerations   = var.tolerations
    }
  }

  profile = merge(
    {
      backend     = "address"
      description = "Dask cluster ${var.name} in namespace ${var.namespace} (helm chart clusterkit)"
      protocol    = var.protocol
      address     = local.scheduler_address
      workers     = local.dask_workers
    },
    var.protocol == "tls" ? {
      tls = {
        ca_file   = "${local.tls_directory}/ca.crt"
        cert_file = "${local.tls_directory}/tls.crt"
        key_file  = "${local.tls_directory}/tls.key"
      }
    } : {}
  )
}
