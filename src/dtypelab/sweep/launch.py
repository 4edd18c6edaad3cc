"""Launchers: how a job runs — in this process, or in a child process (a torchrun launcher is the next
one to plug in here). The sweep only ever calls ``Launcher.run``.

The child is a fresh ``python -m dtypelab.sweep.child`` (not multiprocessing's spawn, which re-imports
the parent's ``__main__``: that breaks under ``python -`` and re-runs unguarded user scripts). Messages
travel over a dedicated pipe, so whatever the user's model prints cannot corrupt them; the child's
own stdout/stderr go to a log whose last line explains a hard crash.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Protocol

from dtypelab.core.results import PolicyResult
from dtypelab.sweep.job import Job, run_job

PROGRESS_EVERY_S = 0.1


@dataclass(frozen=True)
class Event:
    """Progress of a sweep, for progress bars: kind is "probe", "start", "step", "done" (a policy's result),
    "end" (the interleaved timing's), "skip" (not run) or "notice" (a line to show, in ``label``)."""

    kind: str
    policy: str
    done: int = 0
    total: int = 0
    result: PolicyResult | None = None
    label: str = ""


OnEvent = Callable[[Event], None]
OnStep = Callable[[int, int], None]  # (steps done, total)


def watch_parent() -> None:
    """Exit this process when its parent dies (nobody would read its result, and it must not be orphaned)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return lines[-1][:300] if lines else ""
    except OSError:
        return ""


def death_reason(returncode: int, log: str) -> tuple[str, str]:
    tail = last_line(log)
    tail = f" (last output: {tail})" if tail else ""
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        if sig == "SIGKILL":
            return "oom", f"child killed by SIGKILL, most likely out of memory{tail}"
        return "failed", f"child died from {sig}{tail}"
    return "failed", f"child exited with code {returncode} before reporting a result{tail}"


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Launcher(Protocol):
    """How a job runs. ``run`` returns the job's result, or a result that says why there is none."""

    name: str

    def run(self, job: Job, timeout_s: float, on_step: OnStep) -> PolicyResult: ...


class InlineLauncher:
    """The job in this process (debugging, fast tests): no crash, memory or time-limit isolation."""

    name = "inline"

    def run(self, job: Job, timeout_s: float, on_step: OnStep) -> PolicyResult:
        return execute(job, on_step)


class ProcessLauncher:
    """The job in a fresh child process; a crash, hang or OOM becomes a result with its reason."""

    name = "process"

    def run(self, job: Job, timeout_s: float, on_step: OnStep) -> PolicyResult:
        return run_isolated(job, timeout_s, on_step)


LAUNCHERS: dict[str, Launcher] = {"inline": InlineLauncher(), "process": ProcessLauncher()}


def execute(job: Any, on_step: OnStep | None = None) -> Any:
    """Run a job here: one policy's measurement (``Job``), or the interleaved timing rounds (``RoundsJob``)."""
    from dtypelab.sweep.rounds import RoundsJob, run_rounds

    return run_rounds(job, on_step) if isinstance(job, RoundsJob) else run_job(job, on_step)


def run_isolated(job: Job, timeout_s: float, on_step: OnStep) -> PolicyResult:
    """Run a job in a fresh process; a crash, hang or OOM becomes a result with its reason."""
    read_fd, write_fd = os.pipe()
    log = os.path.join(job.workdir, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', job.policy)}-{job.mode}.log")
    start = time.monotonic()
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dtypelab.sweep.child", str(write_fd)], stdin=subprocess.PIPE,
            stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
        )
    os.close(write_fd)  # only the child holds the write end: its exit means EOF here
    conn = Connection(read_fd, writable=False)
    result: PolicyResult | None = None
    try:
        proc.stdin.write(pickle.dumps(job))
        proc.stdin.close()
        while result is None:
            if time.monotonic() - start > timeout_s:
                result = PolicyResult(job.policy, "timeout", f"stopped after the {timeout_s:g} s time limit")
            elif conn.poll(0.05):
                try:
                    msg = conn.recv()
                except EOFError:
                    proc.wait()
                    result = PolicyResult(job.policy, *death_reason(proc.returncode, log))
                    break
                if msg[0] == "step":
                    on_step(msg[1], msg[2])
                else:
                    result = msg[1]
    finally:
        conn.close()
        if result is not None and result.status != "timeout":  # let it exit on its own first
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        stop_process(proc)  # also on Ctrl-C in the parent: never leave a child running
    return result if result.wall_s else replace(result, wall_s=time.monotonic() - start)
