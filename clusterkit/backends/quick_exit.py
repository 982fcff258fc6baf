"""A preload for the worker processes clusterkit starts on this machine: a worker that closed
cleanly ends without the interpreter's final garbage collection.

A worker holds distributed's whole heap, and the collection over it at exit was most of a
cluster's close: two local workers closed in 131 ms, 40 ms with this (6 interleaved pairs).
multiprocessing's fork children skip the interpreter's finalization altogether; this is milder.
Exit hooks and reference-counted cleanup still run; only cycles left at exit are not collected
(``gc.freeze``). A worker that failed to start exits as before: its nanny reads the failure
from a queue only while the process lives, so a quick exit would lose the error's cause.
"""

from __future__ import annotations

import atexit
import gc
import signal
import threading
from typing import Any


def dask_setup(worker: Any) -> None:
    """distributed calls this as the worker starts, once every preload is imported: the hook
    runs after every exit hook registered later (the profile's preloads', the tasks')."""
    atexit.register(_freeze_after_a_clean_close, worker)
    # The terminal's Ctrl-C reaches an embedded cluster's workers too (one process group):
    # the process that owns the cluster stops and closes them, not a KeyboardInterrupt each.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _freeze_after_a_clean_close(worker: Any) -> None:
    from distributed.core import Status

    if worker.status == Status.closed:
        gc.freeze()
