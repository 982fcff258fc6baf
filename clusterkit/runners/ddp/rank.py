"""The rank process: an interpreter (torch preloaded) that runs a rank of a DDP group.

Started by the Dask task that owns the rank (``ddp_worker``), often ahead of time as a spare;
a search's gang trials reuse it for their next trial once a rank ends cleanly (:mod:`.pool`).
It talks to that task over one socket (``multiprocessing.connection`` framing): it says
``ready`` once torch is imported, receives the rank's spec, reports the rendezvous port (rank
0), checkpoints and progress, and finally a result or an error. It exits when its parent (the
Dask worker) goes away, so nothing outlives the worker.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from clusterkit.runners.ddp import output, progress
from clusterkit.runners.ddp.progress import Progress

CHECKPOINT_DIR_ENV = "CLUSTERKIT_CHECKPOINT_DIR"  # set in ranks when checkpoint_dir is given
CHECKPOINT_FILE = "checkpoint.pt"
SCHEDULER_CHECKPOINT_LIMIT = 64 * 2**20  # bytes a checkpoint may have without checkpoint_dir


def _write_url(directory: str, data: bytes) -> None:
    """Write ``directory/checkpoint.pt`` through fsspec, whole or not at all."""
    import uuid

    from fsspec.core import url_to_fs

    fs, path = url_to_fs(directory)
    fs.makedirs(path, exist_ok=True)
    final = f"{path.rstrip('/')}/{CHECKPOINT_FILE}"
    temporary = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(temporary, "wb") as handle:
        handle.write(data)
    fs.mv(temporary, final)


def _read_url(directory: str) -> bytes | None:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(directory)
    final = f"{path.rstrip('/')}/{CHECKPOINT_FILE}"
    if not fs.exists(final):
        return None
    with fs.open(final, "rb") as handle:
        data: bytes = handle.read()
    return data


class Context:
    """What ``train_fn(ctx, ...)`` gets: its place in the group, device, checkpoints, progress."""

    def __init__(self, spec: dict[str, Any], conn: Connection, device: Any) -> None:
        self.rank: int = spec["rank"]
        self.world_size: int = spec["world_size"]
        self.local_rank: int = spec["local_rank"]
        self.local_world_size: int = spec["local_world_size"]
        self.backend: str = spec["backend"]
        self.restart_count: int = spec["attempt"]
        self.worker: str = spec["worker"]
        self.device = device
        self._conn = conn
        self._checkpoint: bytes | None = spec.get("checkpoint")
        self._checkpoint_dir: str | None = spec.get("checkpoint_dir")
        self._send_lock = threading.Lock()  # a report from another thread must not interleave
        self._saved = 0  # checkpoints this process saved
        self._progress: Progress = {}  # the last progress sent
        self._reported = False  # the function reports itself: a bare checkpoint count is noise

    @property
    def is_restart(self) -> bool:
        """True when this group replaces one that failed."""
        return self.restart_count > 0

    def save_checkpoint(self, state: Any) -> None:
        """Save ``state`` (``torch.save``-able); only rank 0's call counts.

        With ``checkpoint_dir`` it is written there (any size); otherwise the driver holds it
        (at most 64 MiB). Returns once the checkpoint is held outside the rank's machine, so a
        worker that dies right after loses nothing that was saved.
        """
        if self.rank != 0:
            return
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        if self._checkpoint_dir:
            _write_url(self._checkpoint_dir, data)
        elif len(data) > SCHEDULER_CHECKPOINT_LIMIT:
            raise ValueError(
                f"checkpoint of {len(data) / 2**20:.0f} MiB is over the 64 MiB the scheduler "
                "holds: pass checkpoint_dir=URL (--checkpoint-dir) to save it to storage"
            )
        else:
            with self._send_lock:
                self._conn.send(("checkpoint", data))
                reply = self._conn.recv()
            if reply != ("ack",):
                raise RuntimeError(f"checkpoint not stored: {reply!r}")
        self._saved += 1
        saved = progress.from_checkpoint(state, self._saved)
        if progress.COUNT in saved and self._reported:
            return
        if any(self._progress.get(name) != value for name, value in saved.items()):
            self._send_progress(saved)  # unless a report already said as much

    def report(self, epoch: float | None = None, step: float | None = None, **metrics: Any) -> None:
        """Show progress on the driver: ``ctx.report(epoch=3, loss=loss)``; only rank 0 counts.

        Metrics are numbers or strings (one-element tensors are fine). The driver shows the
        latest report (``clusterkit train``'s status line, a detached run's ``progress.json``).
        Each ``save_checkpoint`` reports too: its state's ``epoch`` / ``step``, else a count.
        """
        if self.rank != 0:
            return
        self._reported = True
        self._send_progress(progress.message(epoch, step, metrics))

    def _send_progress(self, data: Progress) -> None:
        self._progress = data
        with self._send_lock:
            self._conn.send(("progress", data))

    def relay(self, topic: str, event: dict[str, Any], reply: str | None = None) -> Any:
        """Send ``event`` to the driver's event ``topic`` through the worker; with ``reply``,
        wait for the driver's answer on that scheduler Queue (the search runner's gangs)."""
        with self._send_lock:
            self._conn.send(("relay", topic, event, reply))
            if reply is None:
                return None
            kind, value = self._conn.recv()
        if kind != "reply":
            raise RuntimeError(f"relay: unexpected answer {kind!r}")
        return value

    def load_checkpoint(self, map_location: Any = None) -> Any:
        """The last state rank 0 saved: in ``checkpoint_dir`` (this run or an earlier one),
        else in an earlier attempt of this run; None when there is none."""
        data = _read_url(self._checkpoint_dir) if self._checkpoint_dir else self._checkpoint
        if data is None:
            return None
        import torch

        location = self.device if map_location is None else map_location
        return torch.load(io.BytesIO(data), map_location=location, weights_only=False)

    def __repr__(self) -> str:
        return (
            f"Context(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={self.device}, backend={self.backend!r})"
        )


def _watch_parent(parent: int) -> None:
    """Exit as soon as the Dask worker that started us is gone (no orphaned ranks)."""
    while True:
        if os.getppid() != parent:
            os._exit(70)
        time.sleep(0.5)


def _cuda_layout(spec: dict[str, Any]) -> str | None:
    """CUDA_VISIBLE_DEVICES putting this rank's GPU at index ``local_rank``.

    torchrun scripts call ``torch.cuda.set_device(LOCAL_RANK)``; a dask-cuda worker lists its
    own GPU first, so the list is rotated to keep the script's index pointing at that GPU.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if not devices:  # counting GPUs here would initialise CUDA before the layout is set
        return None
    mine = devices[spec["slot"] % len(devices)]
    others = [d for d in devices if d != mine]
    local = spec["local_rank"]
    if local > len(others):
        return mine
    return ",".join([*others[:local], mine, *others[local:]])


def _prepare(spec: dict[str, Any], conn: Connection) -> tuple[Any, Any]:
    """Environment, threads, rendezvous store (rank 0) and device; returns (store, device)."""
    import torch

    sys.path[:] = spec["sys_path"]
    if spec.get("workdir"):  # the project: working directory and first on sys.path
        os.chdir(spec["workdir"])
        sys.path.insert(0, spec["workdir"])
    if spec.get("checkpoint_dir"):  # for torchrun-style scripts that save their own state
        os.environ[CHECKPOINT_DIR_ENV] = spec["checkpoint_dir"]
    for name, value in spec.get("default_env", {}).items():
        os.environ.setdefault(name, value)  # the worker's own setting wins
    os.environ.update(spec["env"])
    threads = spec["threads"]
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    store = None
    if spec["rank"] == 0:
        from torch.distributed import TCPStore

        # Rank 0 hosts the store on a free port of its own host; torchrun's agent does the
        # same, and TORCHELASTIC_USE_AGENT_STORE makes env:// ranks connect as clients.
        store = TCPStore(
            spec["env"]["MASTER_ADDR"],
            0,
            spec["world_size"],
            is_master=True,
            wait_for_workers=False,
        )
        os.environ["MASTER_PORT"] = str(store.port)
        conn.send(("port", store.port))
    device = torch.device("cpu")
    if spec["backend"] == "nccl":
        layout = _cuda_layout(spec)  # before any CUDA call: the runtime reads it once
        if layout is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = layout
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, but torch sees no GPU on this worker")
        # all GPUs visible: this worker's slot-th one; else the layout put ours at local_rank
        multi = layout is not None and "," in layout
        index = spec["slot"] if layout is None else (spec["local_rank"] if multi else 0)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    return store, device


def _execute(spec: dict[str, Any], conn: Connection) -> Any:
    import cloudpickle
    import torch.distributed as dist

    from clusterkit.runners.ddp import teardown
    from clusterkit.runners.workdir.once import recorded

    store, device = _prepare(spec, conn)
    ctx = Context(spec, conn, device)
    progress.set_context(ctx)
    train_fn, args, kwargs = cloudpickle.loads(spec["payload"])
    try:
        if spec["init_group"]:
            dist.init_process_group(
                spec["backend"],
                rank=ctx.rank,
                world_size=ctx.world_size,
                device_id=device if device.type == "cuda" else None,
            )
        conn.send(("started", time.time()))
        if not spec.get("warnings_topic"):  # shown as they happen, on the rank's stderr
            return train_fn(ctx, *args, **kwargs)
        with recorded() as raised:
            try:
                return train_fn(ctx, *args, **kwargs)
            finally:  # before the result: the driver shows each warning once, counted
                conn.send(("warnings", sorted(raised)))
    except BaseException as error:
        # Stamp the failure before destroy_process_group wakes the peers with errors of their
        # own: the driver reports the earliest stamp as the cause.
        error._clusterkit_failed_at = time.time()  # type: ignore[attr-defined]
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        teardown.leave_rendezvous(spec, store)
        del store


class _Baseline:
    """What a rank changes in its process (environment, working directory, import path),
    taken while idle and put back after a trial, so a warm process serves the next one clean."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        progress.set_context(None)


def _serve_one(spec: dict[str, Any], conn: Connection) -> bool:
    """Run ``spec``'s rank and send its result or error; True when it ended cleanly."""
    import cloudpickle

    try:
        value = _execute(spec, conn)
    except BaseException as error:  # report everything, including SystemExit from scripts
        _flush()  # what it printed reaches the driver before its error
        if isinstance(error, SystemExit) and error.code in (None, 0):
            conn.send(("result", cloudpickle.dumps(None)))
            return False  # a script that exits expects its process to end
        conn.send(
            (
                "error",
                {
                    "type": type(error).__name__,
                    "message": str(error),
                    "traceback": traceback.format_exc(),
                    "time": getattr(error, "_clusterkit_failed_at", time.time()),
                },
            )
        )
        return False
    _flush()
    conn.send(("result", cloudpickle.dumps(value)))
    return True


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the user's code closed or broke it
            stream.flush()


#: What a spare imports beyond torch before it says ``ready``: DistributedDataParallel's first
#: construction imports torch._dynamo (sympy, inductor), seconds that would otherwise fall
#: between the call and the first training step.
SPARE_PRELOAD = ("torch.nn.parallel", "torch._dynamo", "torch.utils.data")


def main(fd: int, preload: bool = False, imports: Sequence[str] = ()) -> None:
    """Serve ranks over the inherited socket ``fd``: one, or one after another while each
    ends cleanly and its spec asks for reuse (a search's gang trials). A spare (``preload``)
    imports :data:`SPARE_PRELOAD` and ``imports`` first."""
    import socket

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(socket.socket(fileno=fd).detach())
    import cloudpickle  # noqa: F401 - preloaded: this is what makes a spare fast
    import torch
    import torch.distributed

    from clusterkit.runners.ddp import teardown
    from clusterkit.runners.workdir.once import recorded  # noqa: F401 - preloaded too

    teardown.keep_destroyed_groups()
    if preload:
        import importlib

        for name in (*SPARE_PRELOAD, *imports):
            importlib.import_module(name)
    baseline = _Baseline()
    conn.send(("ready", torch.__version__))  # no CUDA call: the layout is set per rank later
    while True:
        try:
            spec = conn.recv()
            restore = output.redirect(conn) if spec.get("output_topic") else None
        except (EOFError, OSError):
            break
        if not (_serve_one(spec, conn) and spec.get("reuse")):
            break
        teardown.release()
        if restore is not None:
            restore()
        baseline.restore()
        try:
            conn.send(("ready", torch.__version__))
        except OSError:  # not kept: the worker closed its end
            break
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: torch/gloo threads can make it slow


if __name__ == "__main__":  # FD [--preload [MODULE ...]]
    main(int(sys.argv[1]), preload="--preload" in sys.argv[2:], imports=sys.argv[3:])
