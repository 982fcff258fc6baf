# Four GPU worker pods (two GPUs each, eight dask-cuda workers) with mutual TLS, on GPU nodes.
# The chart generates its CA and certificates; researchers fetch the client Secret:
#
#   kubectl create namespace research
#   terraform init && terraform apply
#   terraform output -raw client_tls_fetch | sh
#   terraform output -raw profile > ~/.config/clusterkit/profiles/gpu-lab.yaml

terraform {
  required_version = ">= 1.9.0"

  required_providers {
    helm = {
      source  = "hashicorp/helm"
      version = ">= 2.12, < 3.0"
    }
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = ">= 2.25"
    }
  }
}

variable "kubeconfig" {
  description = "Kubeconfig of the target cluster."
  type        = string
  default     = "~/.kube/config"
}

provider "kubernetes" {
  config_path = var.kubeconfig
}

provider "helm" {
  kubernetes {
    config_path = var.kubeconfig
  }
}

module "dask" {
  source = "../../modules/dask-cluster"

  name             = "gpu-lab"
  namespace        = "research"
  create_namespace = false # managed with the team's other namespaces
  image            = "nvcr.io/nvidia/rapidsai/base:25.10-cuda12.9-py3.12"

  workers            = 4
  gpus_per_worker    = 2
  threads_per_worker = 1
  worker_memory      = "auto"
  protocol           = "tls"

  worker_resources = {
    requests = { cpu = "8", memory = "48Gi" }
    limits   = { cpu = "16", memory = "96Gi" }
  }
  node_selector = { "nvidia.com/gpu.present" = "true" }
  tolerations = [
    { key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },
  ]
  env = { NCCL_DEBUG = "WARN" }
}

output "scheduler_address" {
  value = module.dask.scheduler_address
}

output "client_tls_fetch" {
  description = "terraform output -raw client_tls_fetch | sh: the client certificate into owner-only files"
  value       = module.dask.client_tls_fetch
}

output "profile" {
  description = "terraform output -raw profile > ~/.config/clusterkit/profiles/gpu-lab.yaml"
  value       = module.dask.profile
}
