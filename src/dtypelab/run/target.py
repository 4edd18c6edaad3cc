"""What a command is to run, decided once: a Task (a built-in name, ``file.py:make_task``, ``pkg.module:fn``, a Task
object) or a user's training script (a ``.py`` file without ``make_task``, decided from its syntax without running
it). Capabilities branch on ``Target.is_script`` at their entry and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dtypelab.core.errors import DtypelabError
from dtypelab.core.task import Task, is_script, load_task


@dataclass(frozen=True)
class Target:
    spec: str  # as the user gave it (a Task object: its name)
    kind: str  # "task" or "script"
    given: Task | None = None  # a Task object the caller passed

    @classmethod
    def of(cls, what: str | Task | Target) -> Target:
        if isinstance(what, Target):
            return what
        if isinstance(what, Task):
            return cls(what.name, "task", what)
        if not isinstance(what, str) or not what:
            raise DtypelabError(f"not a task or a training script: {what!r}")
        return cls(what, "script" if is_script(what) else "task")

    @property
    def is_script(self) -> bool:
        return self.kind == "script"

    @property
    def path(self) -> str:
        """A script's absolute path."""
        return os.path.abspath(self.spec)

    def task(self) -> Task:
        """The Task (loaded from its spec: a broken task file is a one-line error naming the user's line, and a
        script is refused in one line, without running it, by the commands that need a task)."""
        if self.given is not None:
            return self.given
        return load_task(self.spec)
