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
  tls               = var.protocol == "tls"
  # the chart generates NAME-{ca,scheduler,worker,client}-tls unless given a Secret
  tls_generated     = local.tls && var.tls_secret_name == ""
  client_tls_secret = local.tls_generated ? "${var.name}-client-tls" : (local.tls ? var.tls_secret_name : "")
  tls_directory     = "~/.config/clusterkit/tls/${var.name}"
  tls_files         = ["ca.crt", "tls.crt", "tls.key"]
  # owner-only copies of the client Secret's files, where the profile's tls block points
  client_tls_fetch = local.tls ? join("\n", concat(
    ["(umask 077 && mkdir -p ${local.tls_directory})"],
    [for file in local.tls_files :
      "(umask 077 && kubectl -n ${var.namespace} get secret ${local.client_tls_secret} -o jsonpath='{.data.${replace(file, ".", "\\.")}}' | base64 -d > ${local.tls_directory}/${file})"
    ],
  )) : ""

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
    tls      = { secretName = var.tls_secret_name }
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
    local.tls ? {
      tls = {
        ca_file   = "${local.tls_directory}/ca.crt"
        cert_file = "${local.tls_directory}/tls.crt"
        key_file  = "${local.tls_directory}/tls.key"
      }
    } : {}
  )
}
