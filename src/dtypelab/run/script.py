"""The script launcher: a user's own training script, run as it is (``python -m dtypelab.run.boot train.py
args``: ``python train.py args`` with the RNGs seeded before its first line), with the channel in its environment.
Its ``dtypelab.session()`` (or a framework integration) is the worker: it connects, is sent ``payload`` (what the
run is to do: a policy, a diagnosis), reports its steps and ends with ``("done", what it measured)``.

The outcome says what the launcher saw: the session's final value, or why there is none — the script crashed
(its last line), exited non-zero, hung past its time, or ended without its session reporting (``started`` tells a
script that never created a session from one that never finished it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtypelab.run.boot import ENV_SEED
from dtypelab.run.channel import Channel
from dtypelab.run.launchers import OnStep, Watch, log_path, start
from dtypelab.run.outcome import Outcome, death_reason, last_line


@dataclass(frozen=True)
class ScriptRun:
    """One run of a script: its path and arguments, the seed its process starts from, and the payload its
    session is sent."""

    path: str
    args: tuple[str, ...] = ()
    seed: int = 0
    payload: Any = None
    name: str = "script"
    env: dict[str, str] = field(default_factory=dict)
    on_message: Callable[[tuple[Any, ...]], None] | None = None  # the session's own kinds, as they arrive


class ScriptLauncher:
    """Each run of a script in a process of its own."""

    name = "script"

    def __init__(self, logs: str) -> None:
        self.logs = logs

    def run(self, run: ScriptRun, timeout_s: float, on_step: OnStep) -> Outcome:
        with Channel(run.payload) as channel:
            log = log_path(self.logs, run.name)
            proc = start([sys.executable, "-m", "dtypelab.run.boot", os.path.abspath(run.path), *run.args], channel,
                         log, env={**run.env, ENV_SEED: str(run.seed)})
            out = Watch(proc, channel, log, timeout_s, on_step, run.on_message).follow()
        if out.status == "timeout":
            return out
        rc = proc.returncode
        if rc > 0:  # the script's own failure, even after its session reported: its last line says what
            tail = last_line(log)
            return replace(out, status="failed", reason=f"the script exited with code {rc}" + (f": {tail}" if tail
                                                                                              else ""))
        if rc < 0:
            status, reason = death_reason(rc, log)
            return replace(out, status=status, reason=f"the script {reason}")
        if not out.ranks:  # it ended normally without its session's last word: the capability says what is missing
            return replace(out, status="ok", reason="")
        return out
