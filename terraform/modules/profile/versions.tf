terraform {
  # cross-variable validation (tls_secret_name checks protocol) needs 1.9
  required_version = ">= 1.9.0"
}
