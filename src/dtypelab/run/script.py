"""The script launcher: a user's own training script, run as it is (``python -m dtypelab.run.boot train.py
args``: ``python train.py args`` with the RNGs seeded before its first line), with the channel in its environment.
Its ``dtypelab.session()`` (or a framework integration) is the worker: it connects, is sent ``payload`` (what the
run is to do: a policy, a diagnosis), reports its steps and ends with ``("done", what it measured)``.

The outcome says what the launcher saw: the session's final value, or why there is none — the script crashed
(its last line), exited non-zero, hung past its time, or ended without its session reporting (``started`` tells a
script that never created a session from one that never finished it).
"""

from __future__ import annotations

import ast
import atexit
import functools
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtypelab.run.channel import Channel
from dtypelab.run.launchers import OnStep, ProcessLauncher, Watch, keep_warm, launch, log_path
from dtypelab.run.messages import Note
from dtypelab.run.outcome import Outcome, death_reason, exception_line
from dtypelab.run.warm import ENV_SEED, WARM
from dtypelab.run.zygote import Zygote


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
    on_message: Callable[[Note], None] | None = None  # the session's own messages, as they arrive


@functools.cache
def _zygote() -> Zygote:
    """The scripts' own zygote (warmed with what scripts import: Lightning, transformers), one per process."""
    zygote = Zygote()
    atexit.register(zygote.close)
    return zygote


# dtypelab's integrations import these for a script that names only them
_IMPLIED = {"dtypelab.lightning": ("lightning",), "dtypelab.hf": ("transformers", "accelerate")}


def imported_modules(path: str) -> set[str]:
    """The modules a script's source imports, read, never run (``from a.b import c``: ``a.b`` and ``a.b.c``), and the
    dotted names it reaches from an imported package (``import dtypelab`` then ``dtypelab.hf.Trainer``:
    ``dtypelab.hf`` and ``dtypelab.hf.Trainer``); none for a file that cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    roots = {n.split(".")[0] for n in names}
    for node in ast.walk(tree):
        dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
        if dotted and dotted.split(".")[0] in roots:
            parts = dotted.split(".")
            names.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return names


def _dotted(node: Any) -> str | None:
    """``a.b.c`` for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def named_heavy_modules(path: str) -> tuple[str, ...]:
    """The heavy libraries (``warm.WARM``) a script's source imports, read, never run: the zygote loads them once
    before the script's first run instead of every run paying them (Lightning: about 8 s on 2 cores)."""
    names: set[str] = set()
    for name in imported_modules(path):
        names.add(name.split(".")[0])
        names.update(_IMPLIED.get(name, ()))
    return tuple(m for m in WARM if m in names)


class ScriptLauncher:
    """Each run of a script in a process of its own: on a Linux machine without CUDA, forked from a zygote that
    has imported torch and the heavy libraries the script names or an earlier run of it imported (Lightning alone
    takes about 8 s to import on 2 cores), so that each policy's run does not pay them again; otherwise, or with
    ``DTYPELAB_FORK=0``, a fresh interpreter. Either way the script runs as ``python -m dtypelab.run.boot``."""

    name = "script"

    def __init__(self, logs: str) -> None:
        self.logs = logs

    @staticmethod
    def forks(run: ScriptRun) -> bool:
        """A script decides its own device: fork only where no CUDA device exists (a zygote that imported a
        library that asked CUDA for its devices cannot hand CUDA to a forked child) and the job is a CPU one."""
        import torch

        device = run.payload.get("device") if isinstance(run.payload, dict) else None
        return (ProcessLauncher.forks(types.SimpleNamespace(device=str(device or "cpu"))) and not run.env
                and not torch.cuda.is_available())

    def run(self, run: ScriptRun, timeout_s: float, on_step: OnStep) -> Outcome:
        argv = [os.path.abspath(run.path), *run.args]
        env = {**run.env, ENV_SEED: str(run.seed)}
        zygote = _zygote() if self.forks(run) else None
        with Channel(run.payload) as channel:
            log = log_path(self.logs, run.name)
            proc = launch([sys.executable, "-m", "dtypelab.run.boot", *argv], channel, log, env=env, zygote=zygote,
                          preload=named_heavy_modules(run.path) if zygote is not None else (), argv=argv)
            out = Watch(proc, channel, log, timeout_s, on_step, run.on_message).follow()
        keep_warm(zygote, out)
        if out.status == "timeout":
            return out
        rc = proc.returncode
        if rc > 0:  # the script's own failure, even after its session reported: what it raised says what
            tail = exception_line(log)
            return replace(out, status="failed", reason=f"the script exited with code {rc}" + (f": {tail}" if tail
                                                                                              else ""))
        if rc < 0:
            status, reason = death_reason(rc, log)
            return replace(out, status=status, reason=f"the script {reason}")
        if not out.ranks:  # it ended normally without its session's last word: the capability says what is missing
            return replace(out, status="ok", reason="")
        return out
