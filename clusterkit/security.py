"""Protocols and security: the only module that knows schemes, certificates and UCX settings."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Security

    from clusterkit.schema import ProfileCommon

SCHEMES = {"tcp": "tcp", "tls": "tls", "ucx": "ucx"}

#: Silences "UCX WARN unused environment variable" noise.
UCX_QUIET = {"UCX_WARN_UNUSED_ENV_VARS": "n"}
#: Works on a host with neither InfiniBand nor NVLink.
UCX_TLS_TCP_ONLY = "tcp"
UCX_TLS_GPU = "tcp,cuda_copy,cuda_ipc"

CERT_VALIDITY = dt.timedelta(days=30)


@dataclass
class ClusterSecurity:
    """What a cluster's processes and its clients need to talk to each other."""

    protocol: str = "tcp"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return SCHEMES[self.protocol]

    @property
    def tls(self) -> bool:
        return self.protocol == "tls"

    def distributed(self) -> Security | None:
        """A ``distributed.Security`` requiring encryption, or None for plain protocols."""
        if not self.tls:
            return None
        from distributed import Security

        return Security(
            tls_ca_file=self.ca_file,
            tls_client_cert=self.cert_file,
            tls_client_key=self.key_file,
            tls_scheduler_cert=self.cert_file,
            tls_scheduler_key=self.key_file,
            tls_worker_cert=self.cert_file,
            tls_worker_key=self.key_file,
            require_encryption=True,
        )

    def apply_env(self) -> None:
        """Put the protocol's environment into this process (UCX reads it at init)."""
        for key, value in self.env.items():
            os.environ.setdefault(key, value)

    def files(self) -> list[str]:
        return [f for f in (self.ca_file, self.cert_file, self.key_file) if f]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ClusterSecurity:
        return cls(**data) if data else cls()

    @classmethod
    def from_files(cls, ca_file: str, cert_file: str, key_file: str) -> ClusterSecurity:
        return cls(protocol="tls", ca_file=ca_file, cert_file=cert_file, key_file=key_file)


def tls_config_env(ca_file: str, cert_file: str, key_file: str) -> dict[str, str]:
    """Dask config variables that make every process of a cluster (and its clients) use TLS."""
    env = {"DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}
    env["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"] = ca_file
    for role in ("SCHEDULER", "WORKER", "CLIENT"):
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__CERT"] = cert_file
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__KEY"] = key_file
    return env


def ucx_env(profile: ProfileCommon) -> dict[str, str]:
    """UCX environment for a profile: quiet, and transports that work on this kind of host."""
    env = dict(UCX_QUIET)
    ucx = getattr(profile, "ucx", None)
    gpus = getattr(getattr(profile, "worker", None), "gpus", 0)
    if ucx is not None and ucx.tls:
        env["UCX_TLS"] = ",".join(ucx.tls)
    elif not gpus:
        env["UCX_TLS"] = UCX_TLS_TCP_ONLY
    # With GPUs, dask-cuda derives UCX_TLS from the profile's nvlink/infiniband switches.
    return env


def prepare(
    profile: ProfileCommon, directory: Path | None, hostnames: Iterable[str] = ()
) -> ClusterSecurity:
    """The security of a new cluster; for TLS, a fresh CA and certificate in ``directory``."""
    if profile.protocol == "tls":
        if getattr(profile, "tls", None) is not None:  # an address profile brings its own files
            files = profile.tls  # type: ignore[attr-defined]
            return ClusterSecurity.from_files(files.ca_file, files.cert_file, files.key_file)
        if directory is None:
            raise ValueError("TLS needs a directory for the cluster's certificates")
        return generate_tls(directory, hostnames)
    if profile.protocol == "ucx":
        return ClusterSecurity(protocol="ucx", env=ucx_env(profile))
    return ClusterSecurity(protocol="tcp")


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def _subject_names(hostnames: Iterable[str]) -> list[Any]:
    """localhost, 127.0.0.1 and every host the cluster is reached by, as SAN entries."""
    from cryptography import x509

    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    for host in dict.fromkeys(["127.0.0.1", *hostnames]):
        if host == "localhost":
            continue
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _certificate(subject: Any, issuer: Any, public_key: Any, signer: Any, *extensions: Any) -> Any:
    """A certificate valid from five minutes ago for CERT_VALIDITY, with critical extensions."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + CERT_VALIDITY)
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signer, hashes.SHA256())


def generate_tls(directory: Path, hostnames: Iterable[str] = ()) -> ClusterSecurity:
    """A per-cluster CA and one certificate (server and client use) signed by it, files 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "clusterkit cluster CA")])
    signing_only = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    ca_cert = _certificate(
        ca_name,
        ca_name,
        ca_key.public_key(),
        ca_key,
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (signing_only, True),
    )
    key = ec.generate_private_key(ec.SECP256R1())
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = _certificate(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "clusterkit")]),
        ca_name,
        key.public_key(),
        ca_key,
        (x509.SubjectAlternativeName(_subject_names(hostnames)), False),
        (x509.ExtendedKeyUsage(usage), False),
    )
    pem = serialization.Encoding.PEM
    ca_file, cert_file, key_file = (directory / n for n in ("ca.pem", "cert.pem", "key.pem"))
    _write_private(ca_file, ca_cert.public_bytes(pem))
    _write_private(cert_file, cert.public_bytes(pem))
    _write_private(
        key_file,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return ClusterSecurity.from_files(str(ca_file), str(cert_file), str(key_file))
