"""Every command line clusterkit hands to another program is parsed by that program.

Golden files catch change, not wrongness. Here each command clusterkit would run (from
``clusterkit.api.render``, what ``up`` runs, and from ``helm template`` of the chart) goes to its
own program's parser without starting it: distributed's and dask-cuda's click commands (the
``dask`` CLI with its entry points for manifests), the keyword signatures of the classes that
SSH specs and local clusters instantiate (following ``**kwargs`` down the chain they are
forwarded along), dask's config for ``DASK_*`` exports, and ``sbatch --test-only`` on the real
SLURM. No GPU is needed: parsing never starts a worker.
"""

from __future__ import annotations

import importlib
import inspect
import json
import shlex
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from clusterkit.api import render

pytestmark = pytest.mark.unit

#: Set per test (autouse fixture): where TLS file stand-ins go.
TLS_STAND_INS = Path()


@pytest.fixture(autouse=True)
def tls_stand_ins(tmp_path: Path) -> None:
    global TLS_STAND_INS
    TLS_STAND_INS = tmp_path / "tls"
    TLS_STAND_INS.mkdir()


# ------------------------------------------------------------------ the programs' own parsers


def dask_cli() -> click.Group:
    """The `dask` command as installed: dask's group plus every `dask_cli` entry point."""
    import dask.cli

    group = click.Group("dask", commands=dict(dask.cli.cli.commands))
    for entry in entry_points(group="dask_cli"):
        dask.cli._register_command_ep(group, entry)
    return group


def python_module_command(module: str) -> click.Command:
    """What `python -m MODULE` runs: the click command its ``__main__`` block calls."""
    commands = {
        "distributed.cli.dask_worker": "distributed.cli.dask_worker:main",
        "distributed.cli.dask_scheduler": "distributed.cli.dask_scheduler:main",
        "distributed.cli.dask_spec": "distributed.cli.dask_spec:main",
        "dask_cuda.cli": "dask_cuda.cli:worker",  # its __main__ calls worker(), not the group
    }
    assert module in commands, f"python -m {module}: no parser known for this module"
    source = Path(importlib.import_module(module).__file__ or "").read_text()
    call = commands[module].split(":")[1]
    assert f'if __name__ == "__main__":\n    {call}()' in source, f"{module} runs {call}()?"
    path, name = commands[module].split(":")
    command: click.Command = getattr(importlib.import_module(path), name)
    return command


TLS_FLAGS = ("--tls-ca-file", "--tls-cert", "--tls-key")


def with_tls_files(args: list[str], directory: Path) -> list[str]:
    """TLS paths exist on the worker, not here: point them at empty files of the same name.

    The parsers check that these files exist (click.Path(exists=True)).
    """
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg in TLS_FLAGS:
            stand_in = directory / Path(out[i + 1]).name
            stand_in.touch()
            out[i + 1] = str(stand_in)
    return out


def parse(command: click.Command, args: list[str], name: str) -> click.Context:
    """Parse ``args`` as ``command`` would (subcommands resolved), without invoking it."""
    if isinstance(command, click.Group):
        sub = command.get_command(click.Context(command), args[0])
        assert sub is not None, f"{name}: no subcommand {args[0]!r}"
        return parse(sub, args[1:], f"{name} {args[0]}")
    try:
        return command.make_context(name, with_tls_files(args, TLS_STAND_INS))
    except click.ClickException as error:
        pytest.fail(f"{name} refuses {shlex.join(args)}: {error.format_message()}")


def parse_python(argv: list[str]) -> tuple[str, click.Context]:
    """``[env VAR=.. ...] PYTHON -m MODULE ARGS``: the module's parser on ARGS."""
    if argv[0] == "env":
        argv = argv[1:]
        while "=" in argv[0]:
            argv = argv[1:]
    assert argv[1] == "-m", argv
    module = argv[2]
    return module, parse(python_module_command(module), argv[3:], f"python -m {module}")


def accepted_keywords(*chain: type) -> set[str]:
    """Keywords a class takes, following its ``**kwargs`` down the classes it forwards them to."""
    names: set[str] = set()
    for cls in chain:
        params = inspect.signature(cls).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names
    raise AssertionError(f"{chain[-1].__name__} takes **kwargs: follow it further")


def forwarding_chain(class_path: str) -> tuple[type, ...]:
    """The classes a spec's ``cls`` passes unknown keywords along (read from their source)."""
    import dask_cuda
    import distributed
    from distributed.core import Server

    worker = (distributed.Nanny, distributed.Worker, Server)
    chains = {
        "distributed.Scheduler": (distributed.Scheduler, Server),
        "distributed.Nanny": worker,
        "distributed.Worker": (distributed.Worker, Server),
        "dask_cuda.CUDAWorker": (dask_cuda.CUDAWorker, *worker),
        "distributed.LocalCluster": (distributed.LocalCluster, *worker),
        "dask_cuda.LocalCUDACluster": (
            dask_cuda.LocalCUDACluster,
            distributed.LocalCluster,
            *worker,
        ),
    }
    return chains[class_path]


def dask_config_key(variable: str) -> tuple[str, ...] | None:
    """The dask config path a ``DASK_*`` variable sets, if that key exists in dask's config."""
    import dask.config
    import distributed  # noqa: F401 - loads distributed's config defaults

    collected = dask.config.collect_env({variable: "1"})
    path: list[str] = []
    node: Any = collected
    known: Any = dask.config.config
    while isinstance(node, dict):
        (key,) = node
        if not isinstance(known, dict) or key not in known:
            return None
        path.append(key)
        node, known = node[key], known[key]
    return tuple(path)


# ------------------------------------------------------------------ profiles to render


def rendered(tmp_path: Path, name: str, data: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return render(path)


UCX_FAST = {"protocol": "ucx", "ucx": {"nvlink": True, "infiniband": True, "rdmacm": True}}
#: Options that change a worker command; each is tried with and without GPUs.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # mutual TLS
    "tcp": {"protocol": "tcp"},
    "ucx": {"protocol": "ucx"},
    "ucx-nvlink-ib": UCX_FAST,
    "interface": {"interface": "lo"},
    "resources": {"worker": {"resources": {"MEM": 2}}, "preload": ["json"]},
    "lifetime": {"lifetime": "20m", "lifetime_stagger": "1m", "lifetime_restart": True},
    "threads": {"worker": {"threads": 1}},  # fewer than cores/processes: one fit per GPU
}
JOBQUEUE_BASE = {"cores": 2, "memory": "2GiB", "walltime": "00:30:00", "queue": "debug"}


def jobqueue_profile(backend: str, variant: str, gpus: int) -> dict[str, Any]:
    data = {"backend": backend, **JOBQUEUE_BASE, **VARIANTS[variant]}
    worker = {**data.get("worker", {}), "gpus": gpus}
    return {**data, "worker": worker}


JOBQUEUE_CASES = [
    (backend, variant, gpus)
    for backend in ("slurm", "pbs")
    for variant in VARIANTS
    for gpus in (0, 1)
]


def case_id(case: tuple[Any, ...]) -> str:
    return "-".join(str(part) for part in case)


def worker_line(script: str) -> list[str]:
    """The job's worker command; render's "<cluster-dir>" becomes a real directory, as in `up`."""
    line = script.strip().splitlines()[-1]
    return shlex.split(line.replace("<cluster-dir>", str(TLS_STAND_INS)))


# ------------------------------------------------------------------ SLURM and PBS job scripts


@pytest.mark.parametrize("case", JOBQUEUE_CASES, ids=[case_id(c) for c in JOBQUEUE_CASES])
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_job_script_worker_parses(case: tuple[str, str, int], tmp_path: Path) -> None:
    backend, variant, gpus = case
    script = rendered(tmp_path, f"{backend}-{variant}", jobqueue_profile(backend, variant, gpus))
    module, ctx = parse_python(worker_line(script))
    assert module == ("dask_cuda.cli" if gpus else "distributed.cli.dask_worker")
    params = ctx.params
    scheme = VARIANTS[variant].get("protocol", "tls")
    assert params["scheduler"] == f"{scheme}://<scheduler-address>:8786"
    assert params["protocol"] == f"{scheme}://"
    resources = params["resources"] or ""
    assert ("GPU=1" in resources) == bool(gpus)
    if variant == "resources":
        assert "MEM=2" in resources
        assert tuple(params["preload"]) == ("json", "clusterkit.webauth")  # the gate last
    if variant == "interface":
        assert params["interface"] == "lo" and params.get("host") is None
    if scheme == "tls":  # the worker's own pair, never the client's
        assert params["tls_ca_file"] and params["tls_key"].endswith("worker-key.pem")
    else:
        assert params["tls_cert"] is None
    # the parser's value: dask-jobqueue's --nthreads (cores/processes) or the profile's after it
    assert int(params["nthreads"]) == (1 if variant == "threads" else 2)
    if scheme == "ucx" and gpus:  # dask-cuda's own UCX switches
        assert params["enable_tcp_over_ucx"]
        fast = variant == "ucx-nvlink-ib"
        assert bool(params["enable_nvlink"]) is fast
        assert bool(params["enable_infiniband"]) is fast
        assert bool(params["enable_rdmacm"]) is fast
    check_lifetime(script, params, variant, gpus)


def check_lifetime(script: str, params: dict[str, Any], variant: str, gpus: int) -> None:
    """CPU workers take lifetime flags; dask-cuda's worker reads dask config from exports."""
    exports = dict(
        line.removeprefix("export ").split("=", 1)
        for line in script.splitlines()
        if line.startswith("export DASK_")
    )
    for variable in exports:
        assert dask_config_key(variable), f"{variable} names no dask config key"
    if gpus:
        assert exports["DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION"] == (
            "1200s" if variant == "lifetime" else "1620s"
        )
        if variant == "lifetime":
            assert exports["DASK_DISTRIBUTED__WORKER__LIFETIME__RESTART"] == "True"
    else:
        assert params["lifetime"] == ("1200s" if variant == "lifetime" else "1620s")
        assert bool(params["lifetime_restart"]) is (variant == "lifetime")


@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_the_old_gpu_command_is_refused() -> None:
    """What the job scripts ran before: dask-cuda takes `worker` as the scheduler address."""
    command = python_module_command("dask_cuda.cli")
    with pytest.raises(click.UsageError, match="unexpected extra argument"):
        command.make_context("python -m dask_cuda.cli", ["worker", "tcp://127.0.0.1:8786"])


# ------------------------------------------------------------------ local and local-cuda


LOCAL_CASES = [
    ("local", {}),
    ("local", {"protocol": "tls", "idle_timeout": "1h", "preload": ["json"]}),
    ("local", {"processes": False, "worker": {"resources": {"MEM": 1}}, "env": {"A": "1"}}),
    ("local", {"scheduler": {"interface": "lo"}}),
    ("local-cuda", {}),
    ("local-cuda", UCX_FAST),
    ("local-cuda", {"devices": [0, 1], "rmm_pool_size": "1GiB", "device_memory_limit": 0.5}),
    ("local-cuda", {"protocol": "tls", "rmm_async": True, "enable_cudf_spill": True}),
    (
        "local-cuda",
        {
            "rmm_async": True,  # dask-cuda: rmm_release_threshold requires rmm_async
            "cuda": {
                "rmm_maximum_pool_size": "40GB",
                "rmm_release_threshold": "30GB",
                "pre_import": ["json"],
                "log_spilling": True,
            },
        },
    ),
]


@pytest.mark.parametrize(
    "case", LOCAL_CASES, ids=[f"{b}-{i}" for i, (b, _) in enumerate(LOCAL_CASES)]
)
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_local_cluster_keywords_exist(case: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    backend, extra = case
    text = rendered(tmp_path, backend, {"backend": backend, **extra})
    class_path, call = text.split("(**", 1)
    kwargs = json.loads(call.rsplit(")", 1)[0])
    accepted = accepted_keywords(*forwarding_chain(class_path.strip()))
    unknown = sorted(set(kwargs) - accepted)
    assert not unknown, f"{class_path.strip()} does not take {unknown}"
    if kwargs.get("scheduler_kwargs"):
        scheduler = accepted_keywords(*forwarding_chain("distributed.Scheduler"))
        assert set(kwargs["scheduler_kwargs"]) <= scheduler


@pytest.mark.parametrize(
    ("backend", "extra", "preload"),
    [
        ("local", {"preload": ["json"]}, ["clusterkit.backends.quick_exit", "json"]),
        ("local-cuda", {}, ["clusterkit.backends.quick_exit"]),
        ("local", {"processes": False}, None),  # workers in the caller's own process
        ("local", {"processes": False, "preload": ["json"]}, ["json"]),
    ],
)
def test_local_worker_processes_preload_the_quick_exit_first(
    backend: str, extra: dict[str, Any], preload: list[str] | None, tmp_path: Path
) -> None:
    text = rendered(tmp_path, backend, {"backend": backend, **extra})
    kwargs = json.loads(text.split("(**", 1)[1].rsplit(")", 1)[0])
    assert kwargs.get("preload") == [*(preload or []), "clusterkit.webauth"]  # the gate last


CUDA_CASES = [c for c in LOCAL_CASES if c[0] == "local-cuda"]


@pytest.mark.parametrize(
    "case", CUDA_CASES, ids=[f"local-cuda-{i}" for i in range(len(CUDA_CASES))]
)
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_local_cuda_values_pass_dask_cudas_own_checks(
    case: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """LocalCUDACluster itself validates the values (protocol, UCX switches, RMM sizes) before
    its first GPU query; built without starting, it must get that far. (A GPU run found
    ``protocol="ucx://"`` refused by dask-cuda's own check, which a keyword check cannot see.)"""
    import asyncio
    import contextlib

    import pynvml
    from dask_cuda import LocalCUDACluster

    from clusterkit.backends.local import gpu_inventory

    backend, extra = case
    text = rendered(tmp_path, backend, {"backend": backend, **extra})
    kwargs = json.loads(text.split("(**", 1)[1].rsplit(")", 1)[0])
    kwargs.pop("security", None)  # rendered as a description; not checked at construction
    kwargs.pop("enable_cudf_spill", None)  # imports cudf, which is not installed here
    # what dask-cuda would otherwise ask NVML for; an explicit value is checked all the same
    kwargs.setdefault("CUDA_VISIBLE_DEVICES", [0])
    gpus, _ = gpu_inventory()
    if gpus:  # on a GPU machine dask-cuda queries the devices named: name only ones present
        kwargs["CUDA_VISIBLE_DEVICES"] = kwargs["CUDA_VISIBLE_DEVICES"][: len(gpus)]
    kwargs.update(device_memory_limit=2**30, memory_limit=2**30)

    async def construct() -> None:
        cluster = LocalCUDACluster(**kwargs, asynchronous=True)  # not started
        await cluster.close()

    # NVMLError: the first GPU query (the worker spec's device memory); every check before passed
    with contextlib.suppress(pynvml.NVMLError):
        asyncio.run(construct())


@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_the_old_local_cuda_keyword_is_refused() -> None:
    accepted = accepted_keywords(*forwarding_chain("dask_cuda.LocalCUDACluster"))
    assert "jit_unspill" not in accepted


# ------------------------------------------------------------------ SSH per-host commands


SSH_BASE = {"backend": "ssh", "hosts": ["10.0.0.1", "10.0.0.2"], "strict_host_keys": False}
SSH_CASES = [
    (variant, gpus)
    for variant in ("tcp", "default", "ucx", "ucx-nvlink-ib", "interface", "resources")
    for gpus in (0, 1)
]


@pytest.mark.parametrize("case", SSH_CASES, ids=[case_id(c) for c in SSH_CASES])
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_ssh_commands_parse(case: tuple[str, int], tmp_path: Path) -> None:
    variant, gpus = case
    extra = dict(VARIANTS[variant])
    extra.pop("lifetime", None)
    data = {**SSH_BASE, **extra, "worker": {**extra.get("worker", {}), "gpus": gpus}}
    text = rendered(tmp_path, f"ssh-{variant}", data)
    commands = [shlex.split(line) for line in text.splitlines() if line.startswith("  ")]
    assert len(commands) == 3  # a scheduler, and a worker on each host
    classes = set()
    for argv in commands:
        module, ctx = parse_python(argv)
        assert module == "distributed.cli.dask_spec"
        spec = json.loads(ctx.params["spec"])
        entries = [spec] if "cls" in spec else list(spec.values())
        for entry in entries:
            classes.add(entry["cls"])
            unknown = set(entry["opts"]) - accepted_keywords(*forwarding_chain(entry["cls"]))
            assert not unknown, f"{entry['cls']} does not take {sorted(unknown)}"
            if entry["cls"] == "distributed.Nanny":
                assert "GPU" not in entry["opts"].get("resources", {})
    workers = "dask_cuda.CUDAWorker" if gpus else "distributed.Nanny"
    assert classes == {"distributed.Scheduler", workers}


def ssh_cuda_worker_options(tmp_path: Path, variant: str) -> dict[str, Any]:
    """The options the remote ``dask_spec`` hands ``dask_cuda.CUDAWorker`` for one variant."""
    if variant == "cuda":  # the `dask cuda worker` options, RMM's among them
        extra: dict[str, Any] = {"cuda": CUDA_OPTIONS}
    else:
        extra = {k: v for k, v in VARIANTS[variant].items() if not k.startswith("lifetime")}
    data = {**SSH_BASE, **extra, "worker": {**extra.get("worker", {}), "gpus": 1}}
    text = rendered(tmp_path, f"ssh-{variant}", data)
    worker_line = [line for line in text.splitlines() if line.startswith("  ")][1]
    spec = json.loads(parse_python(shlex.split(worker_line))[1].params["spec"])
    (entry,) = [spec] if "cls" in spec else list(spec.values())
    assert entry["cls"] == "dask_cuda.CUDAWorker"
    unknown = set(entry["opts"]) - accepted_keywords(*forwarding_chain(entry["cls"]))
    assert not unknown, f"CUDAWorker does not take {sorted(unknown)}"
    if variant == "cuda":  # its CLI makes dask config of this one; so does the worker's env
        assert "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=spawn" in worker_line.split()
    return dict(entry["opts"])


@pytest.mark.parametrize("variant", [*VARIANTS, "cuda"])
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_ssh_cuda_worker_values_pass_dask_cudas_own_checks(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDAWorker checks and parses its values (resources as ``dask cuda worker`` takes them,
    ports, RMM) before its first GPU query; built here, it must get that far. (A GPU run found
    ``resources`` passed as a dict, which CUDAWorker cannot parse: no SSH GPU worker started.)"""
    import asyncio
    import contextlib

    import pynvml
    from dask_cuda import CUDAWorker

    from clusterkit.backends.local import gpu_inventory

    opts = ssh_cuda_worker_options(tmp_path, variant)
    expected = {"GPU": 1.0, **({"MEM": 2.0} if variant == "resources" else {})}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as the plan sets it on the remote host
    built: list[Any] = []

    async def construct() -> None:  # not started: the nannies are only built
        built.append(CUDAWorker("tcp://127.0.0.1:1", **opts))

    # NVMLError: the first GPU query (the device memory limit); every check before passed
    with contextlib.suppress(pynvml.NVMLError):
        asyncio.run(construct())
    if built:  # a GPU machine got past that query: look at what the nanny was given
        assert built[0].nannies[0].resources == expected
    elif gpu_inventory()[0]:
        pytest.fail("CUDAWorker was not built on a machine with a GPU")
    resources = dict(pair.split("=") for pair in opts["resources"].split())
    assert {name: float(amount) for name, amount in resources.items()} == expected


# ------------------------------------------------------------------ Kubernetes manifests and chart


def containers(documents: list[Any]) -> Iterator[dict[str, Any]]:
    """Every container of every pod template in the documents."""
    stack = list(documents)
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    yield from value
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def parse_container(container: dict[str, Any]) -> tuple[str, click.Context] | None:
    """Parse a container's dask command; None for a container that runs something else. The
    gate the Secret carries is read where the kubelet would mount it: here, the module itself
    (Dask's parser imports a preload to check its arguments)."""
    import clusterkit.webauth
    from clusterkit.backends.kubernetes.manifest import GATE_FILE, TLS_MOUNT

    argv = [*container.get("command", []), *container.get("args", [])]
    if not argv or argv[0] != "dask":
        return None
    gates = {f"{TLS_MOUNT}/{GATE_FILE}", "/etc/clusterkit/web/clusterkit_webauth.py"}  # + chart
    argv = [clusterkit.webauth.__file__ if arg in gates else arg for arg in argv]
    ctx = parse(dask_cli(), argv[1:], "dask")
    return " ".join(argv[: 3 if argv[1] == "cuda" else 2]), ctx


K8S_CASES = [(protocol, gpus) for protocol in ("tcp", "tls") for gpus in (0, 1)]  # no ucx


@pytest.mark.parametrize("case", K8S_CASES, ids=[case_id(c) for c in K8S_CASES])
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_kubernetes_manifest_commands_parse(case: tuple[str, int], tmp_path: Path) -> None:
    protocol, gpus = case
    data = {
        "backend": "kubernetes",
        "protocol": protocol,
        "worker": {"gpus": gpus, "resources": {"MEM": 1}},
        "worker_groups": [{"name": "cpu", "workers": 1}],
    }
    documents = list(yaml.safe_load_all(rendered(tmp_path, f"k8s-{protocol}", data)))
    for container in containers(documents):  # each Dask process puts the gate in front
        assert "/etc/clusterkit/tls/clusterkit_webauth.py" in container["args"], container
    parsed = [p for p in map(parse_container, containers(documents)) if p]
    programs = sorted(program for program, _ in parsed)
    worker = "dask cuda worker" if gpus else "dask worker"
    assert programs == sorted(["dask scheduler", worker, "dask worker"][: len(programs)])
    assert {"dask scheduler", worker} <= set(programs)
    for program, ctx in parsed:
        if program != "dask scheduler" and protocol == "tls":
            assert ctx.params["tls_ca_file"] and ctx.params["tls_key"]


CUDA_OPTIONS = {
    "rmm_maximum_pool_size": "40GB",
    "rmm_async": True,  # dask-cuda: rmm_release_threshold requires rmm_async
    "rmm_release_threshold": "30GB",
    "pre_import": ["json", "math"],
    "rmm_track_allocations": True,
    "enable_cudf_spill": False,
    "multiprocessing_method": "spawn",
}


@pytest.mark.parametrize("backend", ["slurm", "pbs", "kubernetes"])
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_cuda_options_reach_dask_cudas_own_parser(backend: str, tmp_path: Path) -> None:
    data: dict[str, Any] = {"backend": backend, "worker": {"gpus": 1}, "cuda": CUDA_OPTIONS}
    if backend != "kubernetes":
        data.update(JOBQUEUE_BASE)
    text = rendered(tmp_path, f"{backend}-cuda", data)
    if backend == "kubernetes":
        parsed = [p for p in map(parse_container, containers(yaml.safe_load_all(text))) if p]
        (params,) = [ctx.params for program, ctx in parsed if program == "dask cuda worker"]
    else:
        module, ctx = parse_python(worker_line(text))
        assert module == "dask_cuda.cli"
        params = ctx.params
    assert params["rmm_maximum_pool_size"] == "40GB"
    assert params["rmm_release_threshold"] == "30GB"
    assert params["pre_import"] == "json,math"
    assert params["rmm_track_allocations"] is True
    assert params["enable_cudf_spill"] is False
    assert params["multiprocessing_method"] == "spawn"


CHART_CASES = [
    (protocol, gpus, operator)
    for protocol in ("tcp", "tls", "ucx")
    for gpus in (0, 2)
    for operator in (False, True)
]


@pytest.mark.chart
@pytest.mark.parametrize("case", CHART_CASES, ids=[case_id(c) for c in CHART_CASES])
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_chart_commands_parse(case: tuple[str, int, bool], tmp_path: Path) -> None:
    from tests.ops import documents, template, write_values

    protocol, gpus, operator = case
    values: dict[str, Any] = {
        "protocol": protocol,
        "worker": {"gpus": gpus},
        "operator": {"enabled": operator},
    }
    if protocol == "tls":
        values["tls"] = {"secretName": "demo-tls"}
    rendered_chart = template(write_values(tmp_path, values)).stdout
    parsed = [p for p in map(parse_container, containers(documents(rendered_chart))) if p]
    programs = {program for program, _ in parsed}
    assert programs == {"dask scheduler", "dask cuda worker" if gpus else "dask worker"}
    for program, ctx in parsed:
        if program != "dask scheduler":
            resources = ctx.params["resources"] or ""  # dask cuda worker: one worker per GPU
            assert ("GPU=1" in resources) == bool(gpus), resources


# ------------------------------------------------------------------ sbatch --test-only


# `slurm`: the session's SLURM (tests/conftest.py), whose node has 4 GRES GPUs (tests/slurm.py):
# files standing in for device nodes, which slurmctld schedules and sbatch checks requests
# against; nothing ever runs on them.


SBATCH_CASES = [
    (variant, gpus, directive)
    for variant in ("tcp", "default", "ucx-nvlink-ib", "interface", "resources", "lifetime")
    for gpus, directive in ((0, "gres"), (1, "gres"), (1, "gpus-per-task"))
]


@pytest.mark.slurm
@pytest.mark.parametrize("case", SBATCH_CASES, ids=[case_id(c) for c in SBATCH_CASES])
def test_sbatch_accepts_the_job_script(case: tuple[str, int, str], slurm: Any, tmp_path: Path):
    """`sbatch --test-only` parses every directive and checks it against the real controller."""
    from tests import slurm as S

    variant, gpus, directive = case
    data = {**jobqueue_profile("slurm", variant, gpus), "queue": S.PARTITION, "processes": 2}
    data.update(gpu_directive=directive, log_directory=str(tmp_path / "logs"))
    script = tmp_path / "job.sh"
    script.write_text(rendered(tmp_path, f"sb-{variant}", data))
    if gpus:
        wanted = "--gres=gpu:2" if directive == "gres" else "--gpus-per-task=2"
        assert f"#SBATCH {wanted}" in script.read_text()
    done = slurm.run("sbatch", "--test-only", str(script))
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr
    assert not slurm.queue()


@pytest.mark.slurm
def test_sbatch_refuses_more_gpus_than_the_node_has(slurm: Any, tmp_path: Path) -> None:
    """The check above can fail: a job asking for 8 GPUs of this 4-GPU node is refused."""
    from tests import slurm as S

    data = {**jobqueue_profile("slurm", "tcp", 1), "queue": S.PARTITION}
    data.update(processes=8, cores=8, memory="4GiB")
    script = tmp_path / "job.sh"
    script.write_text(rendered(tmp_path, "sb-too-many", data))
    done = slurm.run("sbatch", "--test-only", str(script))
    assert done.returncode != 0 and "configuration is not available" in done.stderr, done.stderr


# ------------------------------------------------------------------ whole runs in one job (--batch)


def batch_plan(backend: str, variant: str, gpus: int, tmp_path: Path, **extra: Any) -> Any:
    """A ``--batch`` run's record with its plan, for a profile of ``jobqueue_profile``."""
    from clusterkit.profiles import load_profile
    from clusterkit.runs import batch
    from clusterkit.runs.records import RunRecord

    path = tmp_path / f"{backend}-{variant}.yaml"
    path.write_text(yaml.safe_dump({**jobqueue_profile(backend, variant, gpus), **extra}))
    profile = load_profile(path)
    record = RunRecord("hpo-1125-abc123", "hpo", [], str(tmp_path), "p", None, None)
    record.batch = batch.plan(profile, record)  # type: ignore[arg-type]
    return profile, record


BATCH_CASES = [
    (variant, gpus) for variant in ("default", "ucx-nvlink-ib", "resources") for gpus in (0, 1)
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=[case_id(c) for c in BATCH_CASES])
@pytest.mark.cuda_extra  # dask-cuda's parsers: the compat tier has no cuda extra
def test_batch_worker_command_parses(
    case: tuple[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker each task of a batch run's job starts: Dask's or dask-cuda's own parser."""
    variant, gpus = case
    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(tmp_path / "state"))
    _, record = batch_plan("slurm", variant, gpus, tmp_path)
    plan = record.batch
    module, ctx = parse_python([plan["python"], "-m", plan["worker_module"], *plan["worker"]])
    assert module == ("dask_cuda.cli" if gpus else "distributed.cli.dask_worker")
    params = ctx.params
    assert params["scheduler_file"].endswith(f"runs/{record.id}/scheduler.json")
    assert params.get("lifetime") is None  # the job ends its workers, not a lifetime
    assert ("GPU=1" in (params["resources"] or "")) == bool(gpus)
    if variant == "ucx-nvlink-ib" and gpus:
        assert params["enable_nvlink"] and params["enable_infiniband"]


@pytest.mark.slurm
@pytest.mark.parametrize("gpus", [0, 1])
@pytest.mark.parametrize("requeue", [False, True])
def test_sbatch_accepts_the_batch_job_script(
    gpus: int, requeue: bool, slurm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch run's one job: a task per worker (a GPU each), requeue and the walltime signal."""
    from clusterkit.runs import batch
    from tests import slurm as S

    monkeypatch.setenv("CLUSTERKIT_STATE_DIR", str(tmp_path / "state"))
    extra = {"queue": S.PARTITION, "workers": 3, "requeue": requeue}  # 6 of its 8 CPUs
    profile, record = batch_plan("slurm", "default", gpus, tmp_path, **extra)
    script = tmp_path / "job.sh"
    script.write_text(batch.job_script(profile, record))
    text = script.read_text()
    assert "#SBATCH --ntasks=3" in text and ("#SBATCH --gpus-per-task=1" in text) == bool(gpus)
    assert ("#SBATCH --signal=B:USR1@" in text) is requeue
    done = slurm.run("sbatch", "--test-only", str(script))
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr
    assert not slurm.queue()
