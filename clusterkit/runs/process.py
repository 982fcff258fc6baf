"""The processes of a detached run: a small monitor in its own session, and the driver.

``submit`` forks the monitor as :mod:`clusterkit.lifecycle.spawn` forks a supervisor: a double
fork into a new session (no controlling terminal, so the terminal's hangup, the user's logout
and the shell's death do not reach it), stdio to the run's folder, nobody's zombie. Where
forking is unsafe it starts ``python -m clusterkit.runs.process ID`` with a new session
instead. The monitor runs the driver (the run's spec, executed in a child process group,
forked again when it can be) and starts it again, up to ``max_restarts``, when it dies from a
signal without a stop request; the search resumes from its storage, training from its last
checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clusterkit import state
from clusterkit.errors import ClusterkitError
from clusterkit.runs.records import (
    LOG_NAME,
    MONITOR_LOG,
    PROGRESS_NAME,
    REQUEUE_NAME,
    STOP_NAME,
    RunRecord,
    get,
    request_stop,
    requeue_requested,
    stop_requested,
)

#: Seconds ``submit`` waits for the monitor to record itself.
READY_TIMEOUT = 30.0
#: Seconds after a driver's end that what it left in its process group may take to go.
GROUP_GRACE = 5.0


#: False while a long-lived process detaches (``runs.launch``, ``runs.resume``): a fork would
#: inherit its open sockets and SSL objects, whose fds the child closes and reuses (a finalizer
#: then writes into an unrelated connection, seen as a TLS "protocol version" alert).
_fork_allowed = [True]


@contextlib.contextmanager
def fresh_interpreter() -> Iterator[None]:
    """Detach through a fresh interpreter while inside, never by forking this process."""
    _fork_allowed.append(False)
    try:
        yield
    finally:
        _fork_allowed.pop()


def detach(record: RunRecord) -> int:
    """Start the run's monitor away from this process; its pid once it recorded itself."""
    from clusterkit.lifecycle import spawn

    folder = state.run_dir(record.id)
    read_fd, write_fd = os.pipe()
    try:
        if _fork_allowed[-1] and spawn.can_fork():
            _fork_monitor(record.id, folder, write_fd)
        else:
            with _private_log(folder / MONITOR_LOG) as log:
                command = [sys.executable, "-m", "clusterkit.runs.process", record.id]
                spawn.start_fresh(command, log, write_fd)
    finally:
        os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], READY_TIMEOUT)
        text = os.read(read_fd, 64).decode() if ready else ""
    finally:
        os.close(read_fd)
    if not text.strip().isdigit():
        tail = _tail(folder / MONITOR_LOG)
        raise ClusterkitError(f"run {record.id}: its monitor did not start ({tail or 'no log'})")
    return int(text)


def _fork_monitor(run_id: str, folder: Path, write_fd: int) -> None:
    from clusterkit.lifecycle import spawn

    def monitored() -> int:
        _to_log(folder / MONITOR_LOG, keep=write_fd)
        try:
            return monitor(run_id, write_fd)
        except BaseException as error:  # the monitor's last word goes to its log
            sys.stderr.write(f"monitor: {type(error).__name__}: {error}\n")
            return 1

    spawn.double_fork(monitored)


def _to_log(log: Path, keep: int) -> None:
    """Stdio to ``log``, every other inherited fd closed (spawn's redirect), and a fresh
    ``__main__`` and terminal consoles: nothing of the launching command's terminal is kept."""
    from clusterkit import console
    from clusterkit.lifecycle.spawn import redirect_stdio

    redirect_stdio(log, keep=keep)
    sys.modules["__main__"] = types.ModuleType("__main__")
    console._stdout = console._stderr = None


def _private_log(path: Path) -> Any:
    """``path`` opened to append, created 0600 (owner-only, as the state directory's files)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ------------------------------------------------------------------ the monitor


def monitor(run_id: str, ready_fd: int | None = None, *, batch: bool = False) -> int:
    """Run the driver to its end, restarting it after a death by signal; record each step.

    ``batch``: inside a batch job (:mod:`clusterkit.runs.allocation`), where a SIGTERM (or the
    SIGUSR1 sent before the walltime) without a stop request is the batch system ending the
    job: the driver stops gracefully and the run waits to be requeued."""
    record = get(run_id)
    record.monitor_pid = os.getpid()  # saved with the driver's pid: one write before it runs
    driver = _forward_signals(run_id, batch)
    if ready_fd is not None:
        os.write(ready_fd, str(os.getpid()).encode())
        os.close(ready_fd)
    while True:
        if stop_requested(record):
            end(record, "stopped", 130, "stopped before its driver started")
            return 0
        record.state = "running"
        wait = _start_driver(record)
        driver[:] = [record.driver_pid] if record.driver_pid else []
        record.save()
        code, signum = wait()
        driver.clear()
        _clear_group(record.driver_pid)
        if stop_requested(record):
            end(record, "stopped", code, "stopped by `clusterkit runs stop`")
            return 0
        if requeue_requested(record):
            _await_requeue(record)
            return 0
        if code == 0:
            end(record, "succeeded", 0, None)
            return 0
        if signum is not None and record.restarts < record.max_restarts:
            name = signal.Signals(signum).name
            record.restarts += 1
            record.reasons.append(f"driver pid {record.driver_pid} killed by {name}")
            record.state = "restarting"
            record.save()
            note(record, f"driver killed by {name}: restart {record.restarts}")
            continue
        if signum is not None:
            why = f"driver killed by {signal.Signals(signum).name}"
            if record.max_restarts:
                why += f", no restart left ({record.restarts}/{record.max_restarts})"
        else:
            why = f"driver exited with {code}" + _last_error(record)
        end(record, "failed", code, why)
        return 0


def _forward_signals(run_id: str, batch: bool) -> list[int]:
    """The monitor's signals: a hangup is ignored; SIGTERM (``kill MONITOR``) is a stop, not
    a death, passed to the driver whose pid the returned list holds. In a batch job a SIGTERM
    or SIGUSR1 without a stop request is the batch system ending the job: the run requeues."""
    driver: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        folder = state.runs_dir() / run_id
        if batch and not (folder / STOP_NAME).exists():  # which: the job requeues itself
            state.write_private(folder / REQUEUE_NAME, signal.Signals(signum).name)
        else:
            request_stop(run_id)
        for pid in driver:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, forward)
    if batch:
        signal.signal(signal.SIGUSR1, forward)
    return driver


def _await_requeue(record: RunRecord) -> None:
    """The batch system is ending the job: wait for it to be requeued (the profile allows
    it and restarts are left), else the run failed."""
    why = f"job {(record.batch or {}).get('job_id')} ended by its batch system"
    if not (record.batch or {}).get("requeue"):
        end(record, "failed", 1, f"{why} (walltime or preemption); the profile has no requeue")
    elif record.restarts >= record.max_restarts:
        end(record, "failed", 1, f"{why}, no restart left ({record.restarts})")
    else:
        record.state, record.monitor_pid, record.driver_pid = "queued", None, None
        record.save()
        note(record, f"{why}: waiting to be requeued")


def _last_error(record: RunRecord) -> str:
    """``: MESSAGE`` of the driver's last error: the CLI's one line (``error: ...``) or a
    traceback's last (``SomeError: ...``); "" when the log holds neither."""
    import re

    try:
        text = (state.run_dir(record.id) / LOG_NAME).read_text(errors="replace")
    except OSError:
        return ""
    pattern = re.compile(r"^(error: |[\w.]+(Error|Exception|Interrupt): )")
    found = [line for line in text.splitlines() if pattern.match(line)]
    return f": {found[-1].removeprefix('error: ')[:160]}" if found else ""


def end(record: RunRecord, final: str, code: int, reason: str | None) -> None:
    record.state, record.exit_code, record.reason = final, code, reason
    record.ended_at = time.time()
    record.save()
    note(record, f"run {final}" + (f": {reason}" if reason else ""))


def note(record: RunRecord, text: str) -> None:
    """A line in the driver's log, so that `runs logs` tells the run's whole story."""
    with _private_log(state.run_dir(record.id) / LOG_NAME) as log:
        log.write(f"[clusterkit runs] {time.strftime('%H:%M:%S')} {text}\n".encode())


def _clear_group(pid: int | None) -> None:
    """End what the driver left in its process group (an embedded cluster's workers)."""
    from clusterkit.lifecycle.spawn import group_alive, kill_group

    if pid and group_alive(pid):
        kill_group(pid, grace=GROUP_GRACE)


def _start_driver(record: RunRecord) -> Any:
    """Start the driver in its own process group; a function that waits for it and returns
    (exit code, the signal that killed it or None)."""
    from clusterkit.lifecycle.spawn import can_fork

    log = state.run_dir(record.id) / LOG_NAME
    if can_fork():
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)
                _to_log(log, keep=2)
                code = driver(record.id)
            except BaseException:  # os._exit below would swallow it: its traceback to the log
                import traceback

                traceback.print_exc()
            finally:
                import logging

                logging.shutdown()
                os._exit(code)
        record.driver_pid = pid

        def wait_fork() -> tuple[int, int | None]:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status), os.WTERMSIG(status)
            return os.waitstatus_to_exitcode(status), None

        return wait_fork
    with _private_log(log) as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "clusterkit.runs.process", record.id, "--driver"],
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=handle,
            process_group=0,
            close_fds=True,
        )
    record.driver_pid = process.pid

    def wait_popen() -> tuple[int, int | None]:
        code = process.wait()
        return (128 - code, -code) if code < 0 else (code, None)

    return wait_popen


# ------------------------------------------------------------------ the driver


def driver(run_id: str) -> int:
    """The run's spec executed in this process, in the run's directory; SIGTERM stops it
    gracefully (as Ctrl-C would: the search flushes its storage, the cluster client closes)."""
    record = get(run_id)
    os.chdir(record.cwd)

    def interrupt(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the unwinding must not be cut
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.environ.setdefault("COLUMNS", "160")  # a log file has no width; rich would guess 80
    attempt = f"restart {record.restarts}" if record.restarts else "start"
    print(
        f"[clusterkit runs] {time.strftime('%H:%M:%S')} {record.id} {attempt}: "
        f"clusterkit {record.kind} {' '.join(record.argv)}",
        flush=True,
    )
    from clusterkit.runs import reporting
    from clusterkit.runs.execution import driver_main

    if record.kind == "hpo":
        reporting.report_hpo(state.run_dir(run_id) / PROGRESS_NAME)
    elif record.kind == "train":
        reporting.report_train(state.run_dir(run_id) / PROGRESS_NAME)
    return driver_main(record)


def main(argv: list[str] | None = None) -> int:
    """``python -m clusterkit.runs.process ID [--driver | --ready-fd FD]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    run_id = args[0]
    if "--driver" in args:
        return driver(run_id)
    ready = int(args[args.index("--ready-fd") + 1]) if "--ready-fd" in args else None
    return monitor(run_id, ready)


if __name__ == "__main__":
    sys.exit(main())
