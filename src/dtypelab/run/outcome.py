"""One error model for every way of running: what became of a piece of work, as a status and a one-line reason.

- the work raised: ``failure(exc)`` — "oom" for out of memory, "interrupted" for Ctrl-C, else "failed" with the
  exception and the user's line it came from;
- the process died without a word: ``death_reason`` — "oom" for SIGKILL (the kernel's OOM killer), else the signal
  or exit code, with the last line the process printed;
- it outlived its limit: "timeout".
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from dtypelab.core.errors import describe_exception

STATUSES = ("ok", "failed", "timeout", "oom", "interrupted")


@dataclass(frozen=True)
class Outcome:
    """What a launcher returns: ``value`` is what the work returned (status "ok"); otherwise ``reason`` says why
    there is none. ``messages`` keeps the last message of each kind a worker sent beyond steps (a script session's
    "result", "skip", "record"); ``started`` says whether any worker connected at all. On a node of a multi-node
    torchrun job without global rank 0, every rank finishes and ``value`` is None: ``ranks`` says which finished."""

    status: str
    reason: str = ""
    value: Any = None
    messages: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    started: bool = False
    wall_s: float = 0.0
    ranks: tuple[int, ...] = ()  # the workers (ranks) whose work finished; ``value`` is rank 0's
    where: str = ""  # a fan-out launcher's job: host, job id and GPU (empty: this machine, as the launcher ran it)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def failure(exc: BaseException) -> tuple[str, str]:
    """(status, one-line reason) for an exception raised by the work."""
    name = type(exc).__name__
    if name == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, without importing torch for it
        return "oom", f"CUDA out of memory: {str(exc).splitlines()[0] if str(exc) else ''}"
    if isinstance(exc, MemoryError):
        return "oom", "out of host memory (MemoryError)"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "interrupted before it finished"
    return "failed", describe_exception(exc)


def last_line(path: str) -> str:
    """The last non-empty line of a log (what a crashed process said last), at most 300 characters."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return lines[-1][:300] if lines else ""
    except OSError:
        return ""


def death_reason(returncode: int, log: str) -> tuple[str, str]:
    """(status, reason) for a process that ended without reporting: killed by a signal, or an exit code."""
    tail = last_line(log)
    tail = f" (last output: {tail})" if tail else ""
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        if sig == "SIGKILL":
            return "oom", f"killed by SIGKILL, most likely out of memory{tail}"
        return "failed", f"died from {sig}{tail}"
    return "failed", f"exited with code {returncode} before reporting a result{tail}"
