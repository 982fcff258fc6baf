"""Protocols and security: the only module that knows schemes, certificates and UCX settings."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.webauth import TOKEN_FILE as WEB_TOKEN_NAME

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

#: Certificate and key file of each party, in a cluster's certificate directory. The client's
#: pair keeps the names ``$CLUSTERKIT_SECURITY`` has always meant (ca.pem, cert.pem, key.pem).
CA_NAME = "ca.pem"
ROLE_FILES = {
    "client": ("cert.pem", "key.pem"),
    "scheduler": ("scheduler-cert.pem", "scheduler-key.pem"),
    "worker": ("worker-cert.pem", "worker-key.pem"),
}
#: What the cluster's own processes need (never the client's key): uploaded to SSH hosts,
#: put in a Kubernetes Secret.
SERVER_NAMES = (CA_NAME, *ROLE_FILES["scheduler"], *ROLE_FILES["worker"], WEB_TOKEN_NAME)


@dataclass
class ClusterSecurity:
    """What a cluster's processes and its clients need to talk to each other."""

    protocol: str = "tcp"
    ca_file: str | None = None
    #: the client's certificate and key (what ``get_client(NAME)`` presents)
    cert_file: str | None = None
    key_file: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: scheduler's and workers' own [certificate, key]; absent: they use the client's pair
    roles: dict[str, list[str]] = field(default_factory=dict)
    #: the owner's secret for the cluster's web pages (``clusterkit.webauth``); None: no gate
    web_token_file: str | None = None

    @property
    def scheme(self) -> str:
        return SCHEMES[self.protocol]

    @property
    def tls(self) -> bool:
        return self.protocol == "tls"

    def pair(self, role: str) -> tuple[str | None, str | None]:
        """The certificate and key that ``role`` (client, scheduler, worker) presents."""
        cert, key = self.roles.get(role) or (self.cert_file, self.key_file)
        return cert, key

    def distributed(self) -> Security | None:
        """A ``distributed.Security`` requiring encryption, or None for plain protocols."""
        if not self.tls:
            return None
        from distributed import Security

        files = {}
        for role in ROLE_FILES:
            files[f"tls_{role}_cert"], files[f"tls_{role}_key"] = self.pair(role)
        return Security(tls_ca_file=self.ca_file, require_encryption=True, **files)

    def client_only(self) -> ClusterSecurity:
        """The same security as a client sees it: no scheduler or worker keys."""
        return ClusterSecurity(
            self.protocol,
            self.ca_file,
            self.cert_file,
            self.key_file,
            self.env,
            web_token_file=self.web_token_file,
        )

    def server_files(self) -> list[tuple[str, str]]:
        """(name, local path) of what the cluster's own processes need: CA, scheduler, worker."""
        named: list[tuple[str, str | None]] = []
        if self.tls:
            named.append((CA_NAME, self.ca_file))
            for role in ("scheduler", "worker"):
                named += zip(ROLE_FILES[role], self.pair(role), strict=True)
        named.append((WEB_TOKEN_NAME, self.web_token_file))
        return [(name, path) for name, path in named if path]

    def apply_env(self) -> None:
        """Put the protocol's environment into this process (UCX reads it at init)."""
        for key, value in self.env.items():
            os.environ.setdefault(key, value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ClusterSecurity:
        return cls(**data) if data else cls()

    @classmethod
    def from_files(cls, ca_file: str, cert_file: str, key_file: str) -> ClusterSecurity:
        return cls(protocol="tls", ca_file=ca_file, cert_file=cert_file, key_file=key_file)

    @classmethod
    def in_directory(cls, directory: str) -> ClusterSecurity:
        """TLS with every party's files at their names in ``directory`` (may be a placeholder)."""
        cert, key = (f"{directory}/{n}" for n in ROLE_FILES["client"])
        roles = {r: [f"{directory}/{n}" for n in ROLE_FILES[r]] for r in ("scheduler", "worker")}
        token = f"{directory}/{WEB_TOKEN_NAME}"
        return cls("tls", f"{directory}/{CA_NAME}", cert, key, roles=roles, web_token_file=token)


def server_tls_env(directory: str) -> dict[str, str]:
    """Dask config variables that make a cluster's own processes use TLS with the files in
    ``directory`` (their names as in SERVER_NAMES): the scheduler its pair, a worker its pair,
    also for the clients its tasks open (``get_client()`` inside a task)."""
    env = {"DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}
    env["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"] = f"{directory}/{CA_NAME}"
    for role, files in (("SCHEDULER", "scheduler"), ("WORKER", "worker"), ("CLIENT", "worker")):
        cert, key = ROLE_FILES[files]
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__CERT"] = f"{directory}/{cert}"
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__KEY"] = f"{directory}/{key}"
    return env


def is_loopback(address: str) -> bool:
    """Whether a scheduler address (``tcp://host:port``, ``host``) is on this machine only."""
    host = address.partition("://")[2] or address
    host = host.rsplit(":", 1)[0].strip("[]") if ":" in host else host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure(protocol: str, address: str | None = None) -> str | None:
    """One line saying who can run code on a cluster of a plain protocol; None under TLS."""
    if protocol == "tls":
        return None
    where = address or "the scheduler's address"
    if address and is_loopback(address):
        who = f"every user of this machine can reach {where} and"
    else:
        who = f"anyone who can reach {where} can"
    flaw = (
        "Dask can neither encrypt nor authenticate UCX"
        if protocol == "ucx"
        else ("it has no authentication")
    )
    return f"protocol {protocol}: {flaw}, so {who} run code as you; omit `protocol` for mutual TLS"


#: The scheduler's HTTP routes when an operator outside the cluster's CA must reach it (the
#: dask-kubernetes operator asks for the adaptive target and retires workers before scaling
#: down; under TLS its Dask RPC has no certificate). Dask's defaults plus the small API:
#: retire_workers, get_workers, adaptive_target, check_idle. None of them runs code.
OPERATOR_HTTP_ROUTES = [
    "distributed.http.scheduler.prometheus",
    "distributed.http.scheduler.info",
    "distributed.http.scheduler.json",
    "distributed.http.health",
    "distributed.http.proxy",
    "distributed.http.statics",
    "distributed.http.scheduler.api",
]


def operator_http_env(security: ClusterSecurity) -> dict[str, str]:
    """Environment of a scheduler that an operator manages: under TLS, the HTTP API the
    operator falls back to (its RPC cannot present a certificate)."""
    if not security.tls:
        return {}
    return {"DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES": json.dumps(OPERATOR_HTTP_ROUTES)}


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
    """The security of a new cluster: for TLS, a fresh CA and certificates in ``directory``;
    with a ``directory``, a fresh secret for its web pages there too (any protocol)."""
    security = _protocol_security(profile, directory, hostnames)
    if directory is not None:
        from clusterkit.webauth import write_token

        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        security.web_token_file = str(write_token(directory))
    return security


def _protocol_security(
    profile: ProfileCommon, directory: Path | None, hostnames: Iterable[str]
) -> ClusterSecurity:
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

    now = dt.datetime.now(dt.UTC)
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
    """A fresh CA for one cluster and a key and certificate signed by it for each party
    (scheduler, worker, client), files 0600 in a 0700 ``directory``.

    The CA's private key never leaves this function: nothing can sign another certificate
    for the cluster once it is made.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
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
    pem = serialization.Encoding.PEM
    _write_private(directory / CA_NAME, ca_cert.public_bytes(pem))
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    usages = {"client": [ExtendedKeyUsageOID.CLIENT_AUTH], "scheduler": both, "worker": both}
    for role, usage in usages.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"clusterkit {role}")]),
            ca_name,
            key.public_key(),
            ca_key,
            (x509.SubjectAlternativeName(_subject_names(hostnames)), False),
            (x509.ExtendedKeyUsage(usage), False),
        )
        cert_name, key_name = ROLE_FILES[role]
        _write_private(directory / cert_name, cert.public_bytes(pem))
        private = serialization.PrivateFormat.PKCS8
        _write_private(
            directory / key_name, key.private_bytes(pem, private, serialization.NoEncryption())
        )
    return ClusterSecurity.in_directory(str(directory))
