"""Checks behind `clusterkit doctor`: versions, extras, GPUs, UCX, a real connection back."""

from __future__ import annotations

import platform
import sys
from importlib.util import find_spec
from typing import TYPE_CHECKING

from clusterkit.backends.base import Check, get_backend
from clusterkit.backends.local import gpu_inventory

if TYPE_CHECKING:
    from clusterkit.schema import ProfileCommon


def _versions() -> list[Check]:
    import dask
    import distributed

    ok = sys.version_info >= (3, 11)
    return [
        Check("python", ok, platform.python_version(), fix="use Python 3.11 or newer"),
        Check(
            "dask / distributed",
            dask.__version__ == distributed.__version__,
            f"dask {dask.__version__}, distributed {distributed.__version__}",
            fix="install matching dask and distributed releases",
        ),
    ]


#: The dependencies whose release decides most of what clusterkit relies on: `doctor` names each
#: one installed outside the range clusterkit declares (and CI tests at both ends).
WATCHED = ("dask", "distributed", "optuna", "torch")


def declared_ranges() -> dict[str, str]:
    """Package -> the version range this installed clusterkit declares for it (its metadata:
    pyproject's ranges, extras included), for the packages in ``WATCHED``."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    try:
        declared = requires("clusterkit") or []
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return {}
    ranges: dict[str, str] = {}
    for line in declared:
        requirement = Requirement(line)
        name = requirement.name.lower()
        if name in WATCHED and requirement.specifier and name not in ranges:
            ranges[name] = str(requirement.specifier)
    return ranges


def version_warnings(installed: dict[str, str] | None = None) -> list[str]:
    """One line per watched package installed outside its declared range; ``installed``
    (name -> version) stands for what importlib.metadata finds."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    lines = []
    for name, spec in declared_ranges().items():
        try:
            found = installed[name] if installed is not None else version(name)
        except (KeyError, PackageNotFoundError):
            continue  # not installed: the extra that needs it says so
        if not SpecifierSet(spec).contains(found, prereleases=True):
            lines.append(
                f"{name} {found} is outside the range clusterkit is tested with ({name}{spec});"
                f" pip install '{name}{spec}'"
            )
    return lines


def _extras(profile: ProfileCommon) -> list[Check]:
    backend = get_backend(profile.backend_name)
    needed = [(r.module, r.package, r.extra) for r in backend.REQUIRES]
    if profile.protocol == "ucx":
        needed.append(("distributed_ucxx", "distributed-ucxx", "ucx"))
    if profile.protocol == "tls":
        needed.append(("cryptography", "cryptography", "tls"))
    checks = []
    for module, package, extra in needed:
        present = find_spec(module) is not None
        checks.append(
            Check(
                f"extra [{extra}]",
                present,
                package if present else f"{package} missing",
                fix=f"pip install 'clusterkit[{extra}]'",
            )
        )
    return checks


def _gpus(profile: ProfileCommon) -> Check:
    gpus, why_not = gpu_inventory()
    wants = bool(getattr(getattr(profile, "worker", None), "gpus", 0))
    if gpus:
        detail = "; ".join(f"{g['index']}: {g['name']} {g['memory'] / 2**30:.0f} GiB" for g in gpus)
        return Check("GPUs (NVML)", True, detail)
    # Only a local GPU profile needs GPUs on *this* machine.
    local_gpu = wants and profile.backend_name in {"local", "local-cuda"}
    return Check(
        "GPUs (NVML)",
        not local_gpu,
        why_not or "no GPU",
        fix="install the NVIDIA driver, or use a CPU profile",
    )


def _ucx(profile: ProfileCommon) -> Check:
    present = find_spec("distributed_ucxx") is not None
    return Check(
        "UCX (distributed-ucxx)",
        present or profile.protocol != "ucx",
        "available" if present else "not installed",
        fix="pip install 'clusterkit[ucx]'",
    )


def _connection_back(profile: ProfileCommon) -> Check:
    """A worker process reaches the address a scheduler on the profile's host advertises."""
    import tempfile
    from pathlib import Path

    from distributed import Client, LocalCluster

    from clusterkit.backends.options import LOOPBACK, dashboard_address
    from clusterkit.security import prepare

    scheduler = profile.scheduler  # type: ignore[attr-defined]
    host = None if scheduler.interface else (scheduler.host or LOOPBACK)
    with tempfile.TemporaryDirectory(prefix="clusterkit-doctor-") as tmp:
        security = prepare(profile, Path(tmp), [scheduler.host] if scheduler.host else [])
        security.apply_env()
        try:
            with (
                LocalCluster(
                    n_workers=1,
                    threads_per_worker=1,
                    processes=True,
                    # the scheduler serves HTTP even without a dashboard: a free port, never
                    # 8787 (taken by a cluster that is up: distributed would warn)
                    dashboard_address=dashboard_address(host, 0),
                    scheduler_kwargs={"dashboard": False},
                    host=host,
                    interface=scheduler.interface,
                    protocol=f"{security.scheme}://",
                    security=security.distributed(),
                ) as cluster,
                Client(cluster, security=security.distributed()) as client,
            ):
                answer = client.submit(sum, [20, 22]).result(timeout=30)
                address = cluster.scheduler_address
        except Exception as error:
            return Check(
                "worker -> scheduler connection",
                False,
                f"{type(error).__name__}: {error}",
                fix="set scheduler.host or scheduler.interface to a reachable address",
            )
    return Check("worker -> scheduler connection", answer == 42, f"task ran via {address}")


def run_checks(profile: ProfileCommon) -> list[Check]:
    """Every check for a profile, cheapest first."""
    checks = [*_versions(), *_extras(profile), _gpus(profile), _ucx(profile)]
    backend = get_backend(profile.backend_name)
    extras_ok = all(c.ok for c in checks if c.name.startswith("extra"))
    if profile.backend_name in {"local", "local-cuda"} and extras_ok:
        checks.append(_connection_back(profile))
    if extras_ok:
        from clusterkit.security import ClusterSecurity

        checks.extend(backend.doctor(profile, ClusterSecurity(protocol=profile.protocol)))
    return checks
