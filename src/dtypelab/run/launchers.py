"""Launchers: how a piece of work runs. Every launcher takes the same call, ``run(work, timeout_s, on_step)``, and
returns an ``Outcome``; none is known to the capabilities beyond its name.

- ``inline``: in this process (debugging, fast tests): no crash, memory or time-limit isolation;
- ``process``: a fresh ``python -m dtypelab.run.worker`` (not multiprocessing's spawn, which re-imports the
  parent's ``__main__``: that breaks under ``python -`` and re-runs unguarded user scripts);
- ``torchrun`` (``dtypelab.run.torchrun``): the same worker on every rank torchrun starts;
- ``script`` (``dtypelab.run.script``): a user's own training script, its session the worker.

A piece of work (``Work``) is a picklable object whose call runs it here and returns a picklable result; it travels
over the channel to the process that runs it, which imports its class from its capability by name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dtypelab.run.channel import Channel, Reporter
from dtypelab.run.messages import Done, Failed, Message, Note, Started, Step
from dtypelab.run.outcome import Outcome, death_reason, failure
from dtypelab.run.zygote import Zygote

# CPU children fork from a zygote (about 2 s saved each) unless this is 0. Forked and fresh workers time alike: fp32
# digits' median step over 12 alternating runs each, 5.0-8.8 ms forked and 4.9-8.9 ms fresh (means 6.2 and 6.6 ms,
# EPYC Zen 4), once the zygote freezes its objects before forking (without gc.freeze the forked ones were slower).
ENV_FORK = "DTYPELAB_FORK"

OnStep = Callable[[int, int], None]  # (steps done, total)
POLL_S = 0.05
STOP_GRACE_S = 10.0


class Work(Protocol):
    """A piece of work: ``name`` for messages about it, and its call, which runs it here."""

    @property
    def name(self) -> str: ...

    def __call__(self, report: Reporter) -> Any: ...


class Launcher(Protocol):
    """How work runs. ``run`` returns its outcome: the work's value, or why there is none."""

    name: str

    def run(self, work: Any, timeout_s: float, on_step: OnStep) -> Outcome: ...


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """End a process started in a session of its own, with everything it started: SIGTERM (torchrun passes it on
    to its ranks), then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def kill_pids(pids: list[int], marker: bytes = b"dtypelab.run") -> list[int]:
    """Kill the workers among ``pids`` still alive (checked by their command line, so a reused pid is spared)."""
    killed = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker not in f.read():
                    continue
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (OSError, ProcessLookupError):
            continue
    return killed


# When stop_in_flight() was last called: every Watch started before then stops its tree and returns what its
# workers reported (a caller that follows runs from threads stops them on Ctrl-C, which reaches the main thread only)
_STOPPED_AT: list[float] = []


def stop_in_flight() -> None:
    """Stop every run this process is following now (from other threads): each returns an "interrupted" outcome with
    the messages its workers sent before; runs started later are not affected."""
    _STOPPED_AT.append(time.monotonic())


@dataclass
class Watch:
    """A started process tree and the channel its workers talk over, followed to its end."""

    proc: Any  # a subprocess.Popen, or a worker forked from the zygote (the same pid/poll/wait/returncode)
    channel: Channel
    log: str
    timeout_s: float
    on_step: OnStep
    on_message: Callable[[Note], None] | None = None  # a capability's own messages, as they arrive
    pids: list[int] = field(default_factory=list)
    messages: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    errors: list[tuple[str, str, int]] = field(default_factory=list)  # (status, reason, rank) as they came
    done: dict[int, Any] = field(default_factory=dict)  # rank -> the value its work returned

    def _take(self, msg: Message) -> None:
        if isinstance(msg, Started):
            self.pids.append(msg.pid)
        elif isinstance(msg, Step):
            self.on_step(msg.done, msg.total)
        elif isinstance(msg, Done):
            self.done[msg.rank] = msg.value
        elif isinstance(msg, Failed):
            self.errors.append((msg.status, msg.reason, msg.rank))
        elif isinstance(msg, Note):
            self.messages[msg.kind] = msg.payload
            if self.on_message is not None:
                self.on_message(msg)

    def follow(self, first_error: Callable[[list[tuple[str, str, int]]], tuple[str, str]] | None = None) -> Outcome:
        """Until the process exits or its time is up; a timeout, Ctrl-C or any exit stops the whole tree. With
        several workers, ``first_error`` picks the root cause among their errors (default: the first to arrive)."""
        start = time.monotonic()
        status, reason = "", ""
        try:
            while self.proc.poll() is None:
                if time.monotonic() - start > self.timeout_s:
                    status, reason = "timeout", f"stopped after the {self.timeout_s:g} s time limit"
                    break
                if _STOPPED_AT and _STOPPED_AT[-1] >= start:
                    status, reason = "interrupted", "interrupted before it finished"
                    break
                msg = self.channel.get(POLL_S)
                if msg is not None:
                    self._take(msg)
        finally:
            stop_group(self.proc, grace_s=STOP_GRACE_S if status == "timeout" else 2.0)
            for msg in self.channel.drain(timeout=0.5 if status else 2.0):
                self._take(msg)
            killed = kill_pids(self.pids)
        wall = time.monotonic() - start
        if status == "timeout" and killed:
            reason += f"; killed {len(killed)} worker process(es) still alive"
        if not status and self.errors:  # the first error: the others are usually its consequences
            status, reason = first_error(self.errors) if first_error else self.errors[0][:2]
        if not status and not self.done:
            status, reason = death_reason(self.proc.returncode, self.log)
        return Outcome(status or "ok", reason, self.done.get(0), dict(self.messages), bool(self.pids), wall,
                       tuple(sorted(self.done)))


def start(cmd: list[str], channel: Channel, log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process in a session of its own (so that it and everything it starts can be stopped together), its
    output to ``log``, the channel in its environment."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {}), **channel.env, "PYTHONUNBUFFERED": "1"},
                                cwd=os.getcwd(), start_new_session=True)


def launch(cmd: list[str], channel: Channel, log: str, *, env: dict[str, str] | None = None,
           zygote: Zygote | None = None, preload: tuple[str, ...] = (), argv: list[str] | None = None) -> Any:
    """A worker: forked from ``zygote`` where one is given and answers, else ``cmd`` started fresh (the same work,
    slower). Either way with ``env`` and the channel in its environment."""
    if zygote is not None:
        with contextlib.suppress(OSError):
            return zygote.fork({**os.environ, **(env or {}), **channel.env, "PYTHONUNBUFFERED": "1"}, log,
                               preload=preload, argv=argv)
    return start(cmd, channel, log, env=env)


def keep_warm(zygote: Zygote | None, out: Outcome) -> None:
    """The heavy libraries the worker said it imported: ``zygote`` loads them before it forks the next one."""
    if zygote is not None and out.messages.get("modules"):
        zygote.warm.update(out.messages["modules"][0])


def log_path(directory: str, name: str) -> str:
    import re

    return os.path.join(directory, re.sub(r"[^A-Za-z0-9_.+-]", "_", name) + ".log")


class InlineLauncher:
    """The work in this process: no crash, memory or time-limit isolation."""

    name = "inline"

    def run(self, work: Any, timeout_s: float, on_step: OnStep) -> Outcome:
        start = time.perf_counter()
        try:
            value = work(Reporter(on_step=on_step))
        except Exception as exc:  # Ctrl-C is the caller's: it propagates
            status, reason = failure(exc)
            return Outcome(status, reason, wall_s=time.perf_counter() - start)
        return Outcome("ok", value=value, started=True, wall_s=time.perf_counter() - start, ranks=(0,))


class ProcessLauncher:
    """The work in a child process of its own; a crash, hang or OOM becomes an outcome with its reason. On Linux a
    CPU job's process may instead be forked from a zygote that has imported torch already (``dtypelab.run.zygote``;
    about 2 s saved per policy on 2 cores; ``DTYPELAB_FORK=0`` starts a fresh interpreter instead, see ``ENV_FORK``)."""

    name = "process"

    def __init__(self, logs: str | None = None) -> None:
        self.logs = logs  # where each run's output log goes (default: the system's temporary folder)
        self._zygote: Zygote | None = None

    @staticmethod
    def forks(work: Any) -> bool:
        """Whether ``work`` runs in a worker forked from the zygote: a CPU job on Linux, unless switched off."""
        device = str(getattr(work, "device", "cpu") or "cpu")
        return sys.platform == "linux" and device.startswith("cpu") and os.environ.get(ENV_FORK, "1") != "0"

    def zygote(self) -> Zygote:
        if self._zygote is None:
            self._zygote = Zygote()
            atexit.register(self._zygote.close)
        return self._zygote

    def prestart(self, preload: tuple[str, ...]) -> None:
        """Start the zygote now, importing ``preload`` (dtypelab's job modules and libraries, never a user's) while
        the caller does its own work: the first CPU worker then forks from it ready. A zygote that cannot start now
        is started again by ``run``, which says why if it fails there too."""
        if self.forks(None):
            with contextlib.suppress(OSError):
                self.zygote().begin(preload)

    def run(self, work: Any, timeout_s: float, on_step: OnStep) -> Outcome:
        import tempfile

        logs = self.logs or getattr(work, "workdir", None) or tempfile.gettempdir()
        with Channel(work) as channel:
            log = log_path(logs, f"{work.name}-{os.getpid()}")
            zygote, module = None, type(work).__module__  # a capability's job module; never a user's module
            if self.forks(work):
                zygote = self.zygote()
            proc = launch([sys.executable, "-m", "dtypelab.run.worker"], channel, log, zygote=zygote,
                          preload=(module,) if module.startswith("dtypelab.") else ())
            out = Watch(proc, channel, log, timeout_s, on_step).follow()
        keep_warm(zygote, out)
        return out


LAUNCHERS: dict[str, Launcher] = {"inline": InlineLauncher(), "process": ProcessLauncher()}
