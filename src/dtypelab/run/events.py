"""What a capability tells whoever shows its progress (the CLI's bars or log lines): one stream of events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    """kind is "probe", "start", "step", "state" (a fanned-out job's "pending" or "running", in ``label``), "done" (a
    policy's result), "end" (a phase's result, e.g. the interleaved timing), "skip" (not run) or "notice" (a line to
    show, in ``label``)."""

    kind: str
    policy: str
    done: int = 0
    total: int = 0
    result: Any = None
    label: str = ""


OnEvent = Callable[[Event], None]
