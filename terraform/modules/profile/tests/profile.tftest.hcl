# Offline tests of the provider-free logic: `terraform test` (command = plan, no providers).

variables {
  name = "gpu-lab"
}

run "defaults_are_a_cpu_cluster_with_generated_tls" {
  command = plan

  assert {
    condition     = output.scheduler_address == "tls://gpu-lab-scheduler.dask.svc.cluster.local:8786"
    error_message = "unexpected scheduler address: ${output.scheduler_address}"
  }
  assert {
    condition     = output.dask_workers == 2 && output.total_gpus == 0
    error_message = "two CPU workers expected"
  }
  assert {
    condition     = output.helm_values.image.repository == "ghcr.io/dask/dask" && output.helm_values.image.tag == "2026.7.1-py3.11"
    error_message = "image not split into repository and tag"
  }
  assert {
    condition     = output.helm_values.protocol == "tls" && output.helm_values.tls.secretName == "" && output.tls_generated
    error_message = "by default the chart runs TLS with the certificates it generates"
  }
  assert {
    condition     = output.client_tls_secret == "gpu-lab-client-tls" && output.tls_secret_name == ""
    error_message = "the profile's certificate comes from the chart's generated client Secret"
  }
  assert {
    condition     = output.profile.tls.cert_file == "~/.config/clusterkit/tls/gpu-lab/tls.crt" && output.profile.tls.ca_file == "~/.config/clusterkit/tls/gpu-lab/ca.crt"
    error_message = "the default profile names the client certificate files"
  }
  assert {
    condition     = strcontains(output.client_tls_fetch, "kubectl -n dask get secret gpu-lab-client-tls -o jsonpath='{.data.tls\\.key}' | base64 -d > ~/.config/clusterkit/tls/gpu-lab/tls.key") && strcontains(output.client_tls_fetch, "umask 077")
    error_message = "client_tls_fetch must copy the client Secret into owner-only files: ${output.client_tls_fetch}"
  }
  assert {
    condition     = yamldecode(output.profile_yaml).address == output.scheduler_address
    error_message = "profile_yaml does not carry the scheduler address"
  }
}

run "explicit_tcp_has_no_tls" {
  command = plan

  variables {
    protocol = "tcp"
  }

  assert {
    condition     = output.scheduler_address == "tcp://gpu-lab-scheduler.dask.svc.cluster.local:8786"
    error_message = "tcp address expected"
  }
  assert {
    condition     = output.profile.backend == "address" && !contains(keys(output.profile), "tls")
    error_message = "a tcp profile has no tls block"
  }
  assert {
    condition     = output.client_tls_secret == "" && output.client_tls_fetch == "" && !output.tls_generated
    error_message = "no client Secret without tls"
  }
}

run "gpu_tls_sizing" {
  command = plan

  variables {
    namespace       = "research"
    workers         = 4
    gpus_per_worker = 2
    protocol        = "tls"
    image           = "registry.local:5000/team/dask-cuda@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
  }

  assert {
    condition     = output.dask_workers == 8 && output.total_gpus == 8
    error_message = "4 pods x 2 GPUs should give 8 dask-cuda workers"
  }
  assert {
    condition     = output.scheduler_address == "tls://gpu-lab-scheduler.research.svc.cluster.local:8786"
    error_message = "tls address expected"
  }
  assert {
    condition     = output.client_tls_secret == "gpu-lab-client-tls" && output.helm_values.tls.secretName == ""
    error_message = "without tls_secret_name the chart generates the certificates"
  }
  assert {
    condition     = output.profile.tls.key_file == "~/.config/clusterkit/tls/gpu-lab/tls.key"
    error_message = "profile must name the client key"
  }
  assert {
    condition     = output.helm_values.image.repository == "registry.local:5000/team/dask-cuda" && output.helm_values.image.digest == "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    error_message = "digest reference not split"
  }
  assert {
    condition     = output.helm_values.worker.gpus == 2 && output.helm_values.worker.replicas == 4
    error_message = "worker sizing not passed to the chart"
  }
}

run "rejects_negative_workers" {
  command = plan
  variables {
    workers = -1
  }
  expect_failures = [var.workers]
}

run "rejects_too_many_workers" {
  command = plan
  variables {
    workers = 1025
  }
  expect_failures = [var.workers]
}

run "rejects_fractional_gpus" {
  command = plan
  variables {
    gpus_per_worker = 1.5
  }
  expect_failures = [var.gpus_per_worker]
}

run "rejects_too_many_gpus" {
  command = plan
  variables {
    gpus_per_worker = 17
  }
  expect_failures = [var.gpus_per_worker]
}

run "rejects_unknown_protocol" {
  command = plan
  variables {
    protocol = "udp"
  }
  expect_failures = [var.protocol]
}

run "rejects_empty_image" {
  command = plan
  variables {
    image = ""
  }
  expect_failures = [var.image]
}

run "rejects_name_that_is_not_a_dns_label" {
  command = plan
  variables {
    name = "GPU_Lab"
  }
  expect_failures = [var.name]
}

run "rejects_bad_memory" {
  command = plan
  variables {
    worker_memory = "lots"
  }
  expect_failures = [var.worker_memory]
}

run "cert_manager_secret" {
  command = plan

  variables {
    tls_secret_name = "gpu-lab-cert-manager"
  }

  assert {
    condition     = output.helm_values.tls.secretName == "gpu-lab-cert-manager" && !output.tls_generated
    error_message = "a given Secret is passed to the chart instead of generating certificates"
  }
  assert {
    condition     = output.client_tls_secret == "gpu-lab-cert-manager" && strcontains(output.client_tls_fetch, "get secret gpu-lab-cert-manager ")
    error_message = "the profile's files come from the given Secret"
  }
}

run "rejects_tls_secret_without_tls" {
  command = plan
  variables {
    protocol        = "tcp"
    tls_secret_name = "my-tls"
  }
  expect_failures = [var.tls_secret_name]
}
