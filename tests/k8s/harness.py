"""The emulated cluster process: API emulator + kubelet shim + the real operator.

Run as ``python -m k8s.harness DIR`` (with tests/ on PYTHONPATH). It writes DIR/kubeconfig once
everything is up and stops every process it started on SIGUSR1 (quick: the operator is
cancelled), on SIGTERM (kopf's graceful stop, which waits 5 s for the emulator's open watch
streams), or when the process that started it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import kmock

from .emulator import Emulator, kubeconfig
from .kubelet import Kubelet
from .operator import patch_cluster_dns, run_operator


async def stop_when_orphaned(stop: asyncio.Event) -> None:
    """A test run killed without its teardown must not leave the harness and its pods running."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    logging.getLogger("harness").warning("the test run that started the harness is gone")
    stop.set()


async def main(directory: Path) -> None:
    emulator = Emulator()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        loop.add_signal_handler(signum, stop.set)
    orphan_watch = asyncio.create_task(stop_when_orphaned(stop))
    async with emulator, kmock.Server(emulator) as server:
        config = directory / "kubeconfig"
        tmp = directory / "kubeconfig.tmp"
        tmp.write_text(kubeconfig(server.port))
        os.environ["KUBECONFIG"] = str(config)
        tmp.rename(config)
        kubelet = Kubelet(directory / "pods", emulator.log_files)
        kubelet_task = asyncio.create_task(kubelet.run())
        ready = asyncio.Event()
        operator_task = asyncio.create_task(run_operator(stop, ready))
        await asyncio.wait(
            [asyncio.create_task(ready.wait()), operator_task], return_when=asyncio.FIRST_COMPLETED
        )
        (directory / "ready").write_text(str(server.port))
        # kopf installs its own SIGTERM handler: its task ending means stop as well
        await asyncio.wait(
            [asyncio.create_task(stop.wait()), operator_task], return_when=asyncio.FIRST_COMPLETED
        )
        stop.set()
        orphan_watch.cancel()
        kubelet_task.cancel()
        await kubelet.stop()
        # cancelled, kopf stops its tasks at once; its graceful stop (stop flag, SIGTERM)
        # first waits 5 s for "hung" tasks: the emulator's watch streams, which never end
        operator_task.cancel()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(operator_task, 10)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    logging.basicConfig(
        filename=target / "harness.log",
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    # one line per API request (the kubelet polls every 0.3 s): CPU and disk for nothing
    for chatty in ("aiohttp.access", "httpx"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    patch_cluster_dns()
    try:
        asyncio.run(main(target))
    except BaseExceptionGroup as group:
        logging.getLogger("harness").warning("emulator errors: %s", group)
