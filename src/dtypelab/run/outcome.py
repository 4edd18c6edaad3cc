"""One error model for every way of running: what became of a piece of work, as a status and a one-line reason.

- the work raised: ``failure(exc)`` — "oom" for out of memory, "interrupted" for Ctrl-C, else "failed" with the
  exception and the user's line it came from;
- the process died without a word: ``death_reason`` — "oom" for SIGKILL (the kernel's OOM killer), else the signal
  or exit code, with the last line the process printed;
- it outlived its limit: "timeout".
"""

from __future__ import annotations

import os
import re
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


def exception_line(path: str) -> str:
    """What a crashed Python process raised, from its log: "TypeError: its message's first line (at train.py:12
    in step)", from the last traceback the log holds (a multi-line message's tail is not its cause), naming the
    innermost frame outside the standard library and site-packages; a ``DtypelabError`` is its message alone.
    Falls back to the log's last line where no traceback is found."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last):")]
    if not starts:
        return last_line(path)
    frame = ""
    for ln in lines[starts[-1] + 1:]:
        if ln.startswith("  File "):
            parts = ln.strip().split('"')
            if len(parts) >= 3 and not _library(parts[1]):
                where = parts[2].strip(", ").replace("line ", "")
                lineno, _, func = where.partition(", in ")
                frame = f"{os.path.basename(parts[1])}:{lineno} in {func}"
            continue
        if ln.startswith((" ", "\t")) or not ln.strip():
            continue
        kind, sep, message = _ANSI.sub("", ln).partition(":")
        kind = kind.rsplit(".", 1)[-1]  # dtypelab.core.errors.DtypelabError -> DtypelabError
        text = message.strip() if kind == "DtypelabError" else f"{kind}{sep}{message}".strip()
        return (text + (f" (at {frame})" if frame and kind != "DtypelabError" else ""))[:300]
    return last_line(path)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours some messages carry (torch.load's bold)


def _library(filename: str) -> bool:
    return (f"{os.sep}site-packages{os.sep}" in filename or f"{os.sep}lib{os.sep}python" in filename
            or filename.startswith("<") or f"{os.sep}dtypelab{os.sep}" in filename)


def death_reason(returncode: int, log: str) -> tuple[str, str]:
    """(status, reason) for a process that ended without reporting: killed by a signal, or an exit code."""
    tail = exception_line(log)
    tail = f" (last output: {tail})" if tail else ""
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        if sig == "SIGKILL":
            return "oom", f"killed by SIGKILL, most likely out of memory{tail}"
        return "failed", f"died from {sig}{tail}"
    return "failed", f"exited with code {returncode} before reporting a result{tail}"
