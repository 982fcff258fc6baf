# A clusterkit Dask cluster on Kubernetes: a namespace and a Helm release of charts/clusterkit.
# All naming and sizing comes from modules/profile, which is tested offline.

module "profile" {
  source = "../profile"

  name                = var.name
  namespace           = var.namespace
  image               = var.image
  image_pull_policy   = var.image_pull_policy
  workers             = var.workers
  gpus_per_worker     = var.gpus_per_worker
  threads_per_worker  = var.threads_per_worker
  worker_memory       = var.worker_memory
  dask_resources      = var.dask_resources
  protocol            = var.protocol
  tls_secret_name     = var.tls_secret_name
  service_type        = var.service_type
  worker_resources    = var.worker_resources
  scheduler_resources = var.scheduler_resources
  node_selector       = var.node_selector
  tolerations         = var.tolerations
  env                 = var.env
  preload             = var.preload
}

resource "kubernetes_namespace" "this" {
  count = var.create_namespace ? 1 : 0

  metadata {
    name = var.namespace
    labels = {
      "app.kubernetes.io/managed-by" = "terraform"
      "app.kubernetes.io/part-of"    = "clusterkit"
    }
  }
}

# A dedicated identity for the Dask pods: no API token is mounted and no role is bound.
resource "kubernetes_service_account" "this" {
  metadata {
    name      = "${var.name}-dask"
    namespace = var.namespace
    labels = {
      "app.kubernetes.io/instance"   = var.name
      "app.kubernetes.io/managed-by" = "terraform"
      "app.kubernetes.io/part-of"    = "clusterkit"
    }
  }
  automount_service_account_token = false

  depends_on = [kubernetes_namespace.this]
}

resource "helm_release" "this" {
  name      = var.name
  namespace = var.namespace
  chart     = coalesce(var.chart, "${path.module}/../../../charts/clusterkit")
  version   = var.chart_version

  values = concat(
    [
      module.profile.helm_values_yaml,
      yamlencode({ serviceAccountName = kubernetes_service_account.this.metadata[0].name }),
    ],
    var.extra_values,
  )

  atomic          = true
  wait            = true
  timeout         = var.helm_timeout
  cleanup_on_fail = true

  depends_on = [kubernetes_namespace.this]
}
