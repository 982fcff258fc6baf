# Same names and rules as modules/profile (which holds the logic); keep the two in step.

variable "name" {
  description = "Cluster name: the Helm release, resource prefix and clusterkit profile name."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", var.name)) && length(var.name) <= 53
    error_message = "name must be a DNS label (lowercase letters, digits, '-') of at most 53 characters."
  }
}

variable "namespace" {
  description = "Kubernetes namespace of the cluster."
  type        = string
  default     = "dask"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", var.namespace)) && length(var.namespace) <= 63
    error_message = "namespace must be a DNS label of at most 63 characters."
  }
}

variable "image" {
  description = "Container image of scheduler and workers (repository:tag or repository@sha256:digest)."
  type        = string
  default     = "ghcr.io/dask/dask:2026.7.1-py3.11"

  validation {
    condition     = length(trimspace(var.image)) > 0 && can(regex("^[^@\\s]+(@sha256:[a-f0-9]{64})?$", var.image))
    error_message = "image must be a non-empty reference like 'ghcr.io/dask/dask:2026.7.1-py3.11'."
  }
}

variable "image_pull_policy" {
  description = "Always, IfNotPresent or Never."
  type        = string
  default     = "IfNotPresent"

  validation {
    condition     = contains(["Always", "IfNotPresent", "Never"], var.image_pull_policy)
    error_message = "image_pull_policy must be Always, IfNotPresent or Never."
  }
}

variable "workers" {
  description = "Worker pods (with GPUs: one dask-cuda worker per GPU in each pod)."
  type        = number
  default     = 2

  validation {
    condition     = var.workers >= 0 && var.workers <= 1024 && floor(var.workers) == var.workers
    error_message = "workers must be a whole number from 0 to 1024."
  }
}

variable "gpus_per_worker" {
  description = "nvidia.com/gpu per worker pod; 0 runs plain CPU workers."
  type        = number
  default     = 0

  validation {
    condition     = var.gpus_per_worker >= 0 && var.gpus_per_worker <= 16 && floor(var.gpus_per_worker) == var.gpus_per_worker
    error_message = "gpus_per_worker must be a whole number from 0 to 16."
  }
}

variable "threads_per_worker" {
  description = "Threads per Dask worker process."
  type        = number
  default     = 1

  validation {
    condition     = var.threads_per_worker >= 1 && var.threads_per_worker <= 256 && floor(var.threads_per_worker) == var.threads_per_worker
    error_message = "threads_per_worker must be a whole number from 1 to 256."
  }
}

variable "worker_memory" {
  description = "Memory limit per Dask worker process: 'auto' or a size like '24GiB'."
  type        = string
  default     = "auto"

  validation {
    condition     = can(regex("^(auto|[0-9]+(\\.[0-9]+)?\\s*([kMGTP]i?B|[kMGTP]i?|B)?)$", var.worker_memory))
    error_message = "worker_memory must be 'auto' or a size like '24GiB'."
  }
}

variable "dask_resources" {
  description = "Extra Dask resources each worker advertises (GPU=1 is added per dask-cuda worker)."
  type        = map(number)
  default     = {}
}

variable "protocol" {
  description = "tls (default: mutual TLS with certificates the chart generates), tcp (no encryption or authentication: anyone who reaches the scheduler runs code as the workers) or ucx."
  type        = string
  default     = "tls"

  validation {
    condition     = contains(["tcp", "tls", "ucx"], var.protocol)
    error_message = "protocol must be tcp, tls or ucx."
  }
}

variable "tls_secret_name" {
  description = "Existing Secret with ca.crt, tls.crt and tls.key (cert-manager's layout) for protocol tls; empty: the chart generates a CA and certificates (client Secret '<name>-client-tls')."
  type        = string
  default     = ""

  validation {
    condition     = var.tls_secret_name == "" || var.protocol == "tls"
    error_message = "tls_secret_name is only used with protocol = \"tls\"."
  }
}

variable "service_type" {
  description = "Scheduler Service type: ClusterIP, NodePort or LoadBalancer."
  type        = string
  default     = "ClusterIP"

  validation {
    condition     = contains(["ClusterIP", "NodePort", "LoadBalancer"], var.service_type)
    error_message = "service_type must be ClusterIP, NodePort or LoadBalancer."
  }
}

variable "worker_resources" {
  description = "Kubernetes requests/limits of a worker container (nvidia.com/gpu is added)."
  type = object({
    requests = optional(map(string), {})
    limits   = optional(map(string), {})
  })
  default = {}
}

variable "scheduler_resources" {
  description = "Kubernetes requests/limits of the scheduler container."
  type = object({
    requests = optional(map(string), {})
    limits   = optional(map(string), {})
  })
  default = {}
}

variable "node_selector" {
  description = "Node labels worker pods must match."
  type        = map(string)
  default     = {}
}

variable "tolerations" {
  description = "Tolerations of worker pods (Kubernetes field names)."
  type        = any
  default     = []
}

variable "env" {
  description = "Environment of scheduler and workers."
  type        = map(string)
  default     = {}
}

variable "preload" {
  description = "Modules every worker preloads."
  type        = list(string)
  default     = []
}

variable "create_namespace" {
  description = "Create the namespace (false: it exists already)."
  type        = bool
  default     = true
}

variable "chart" {
  description = "Chart path or name; default: this repository's charts/clusterkit."
  type        = string
  default     = null
}

variable "chart_version" {
  description = "Chart version when chart names a repository chart."
  type        = string
  default     = null
}

variable "helm_timeout" {
  description = "Seconds helm waits for the scheduler and workers to be ready."
  type        = number
  default     = 600

  validation {
    condition     = var.helm_timeout >= 30 && var.helm_timeout <= 3600
    error_message = "helm_timeout must be between 30 and 3600 seconds."
  }
}

variable "extra_values" {
  description = "More chart values (YAML documents), merged after the generated ones."
  type        = list(string)
  default     = []
}
