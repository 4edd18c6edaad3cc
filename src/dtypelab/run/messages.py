"""What a worker says to its launcher over the channel, typed: ``Started`` first, ``Step`` as it goes, a capability's
own ``Note`` (a script session's record, the autopilot's moves, the heavy modules a zygote should keep), and at the
end ``Done`` with its value or ``Failed`` with why. Pickled, like the work itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Started:
    pid: int
    rank: int = 0


@dataclass(frozen=True)
class Step:
    done: int
    total: int


@dataclass(frozen=True)
class Note:
    """A capability's own message: ``kind`` names it ("record", "move", "rollback", "modules"), ``payload`` is it."""

    kind: str
    payload: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Done:
    value: Any
    rank: int = 0
    where: str = ""  # a fanned-out job: the host (and GPU) it ran on


@dataclass(frozen=True)
class Failed:
    status: str  # failed, timeout, oom, interrupted
    reason: str
    rank: int = 0
    where: str = ""


Message = Started | Step | Note | Done | Failed
