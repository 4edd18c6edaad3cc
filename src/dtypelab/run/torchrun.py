"""The torchrun launcher: a piece of work on N ranks (per node), started by torchrun itself (``python -m
torch.distributed.run``), never by a home-made launcher; each rank runs ``dtypelab.run.worker``, connects to the
channel, and is sent the same work.

One node: ``--standalone``. Several: ``--nnodes``, ``--rdzv-endpoint`` (``--rdzv-backend c10d`` unless the extra
arguments name one) and any ``extra`` arguments (``--node-rank``, ``--rdzv-id``, …) go to torchrun unchanged. Run the
same command on every node; the node that hosts global rank 0 gets rank 0's value.

A rank that fails sends its one-line error; torchrun then stops the other ranks, whose errors are consequences, so
the root cause is the rank torchrun's own failure summary names (its error, or the signal that killed it: a C++
abort sends nothing), else the first error to arrive. A hang ends at the time limit: torchrun is told to stop
(SIGTERM, which it passes on), then killed, and every rank still alive is killed by the pid it reported.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from dtypelab.run.channel import Channel
from dtypelab.run.launchers import OnStep, Watch, log_path, start
from dtypelab.run.outcome import Outcome, last_line


@dataclass(frozen=True)
class Torchrun:
    """How torchrun is asked to start the ranks."""

    nproc: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)  # e.g. --node-rank 1 --rdzv-id job7, unchanged

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and not self.rdzv_endpoint

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc}", "--max-restarts=0"]
        if self.standalone:
            cmd.append("--standalone")
        else:
            cmd.append(f"--nnodes={self.nnodes}")
            if self.rdzv_endpoint:
                if not any(a.startswith(("--rdzv-backend", "--rdzv_backend")) for a in self.extra):
                    cmd.append("--rdzv-backend=c10d")
                cmd.append(f"--rdzv-endpoint={self.rdzv_endpoint}")
        return [*cmd, *self.extra, "-m", "dtypelab.run.worker"]

    def describe(self) -> str:
        return shlex.join(["torchrun", *self.command()[3:]])


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# A rank's error that is the consequence of another rank's death: its collective lost the peer.
CONSEQUENCE = re.compile(r"connection (closed|reset)|broken pipe|closed by peer|socket timeout", re.I)


def root_cause(errors: list[tuple[str, str, int]], log: str) -> tuple[str, str]:
    """(status, reason) of the failure: the error of the rank torchrun's "Root Cause" names, unless that rank only lost
    its peer (it can exit first) and another rank sent an error of its own; for a rank killed by a signal (it sent no
    error), that signal and what the log says of it; else the first error that arrived."""
    text = _read(log)
    by_rank = {rank: (status, reason) for status, reason, rank in reversed(errors)}  # each rank's first error
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*?(\((SIG\w+)\))?\s*$", text,
                     re.S | re.M)
    if root and int(root.group(1)) in by_rank:
        named = by_rank[int(root.group(1))]
        own = [v for _, v in sorted(by_rank.items()) if not CONSEQUENCE.search(v[1])]
        return own[0] if CONSEQUENCE.search(named[1]) and own else named
    if root and root.group(4):
        what = re.findall(r"what\(\):\s*(.+)", text)
        return "failed", f"rank {root.group(1)} killed by {root.group(4)}" + (
            f": {what[0].strip()[:300]}" if what else "")
    return errors[0][:2] if errors else ("failed", "")


def summary(log: str) -> str:
    """What torchrun's failure summary says of the first failed rank (exit code, signal), else the log's last line."""
    found = [f"{k}: {v.strip()}" for k, v in re.findall(r"^\s*(rank|exitcode|traceback)\s*:\s*(.+)$", _read(log),
                                                         re.M)]
    if found:
        return "torchrun: " + "; ".join(dict.fromkeys(found))[:300]
    tail = last_line(log)
    return f"last output: {tail}" if tail else "no output"


class TorchrunLauncher:
    """Each piece of work under torchrun with ``torchrun.nproc`` ranks per node."""

    name = "torchrun"

    def __init__(self, torchrun: Torchrun, logs: str | None = None) -> None:
        self.torchrun, self.logs = torchrun, logs

    def run(self, work: Any, timeout_s: float, on_step: OnStep) -> Outcome:
        import tempfile

        logs = self.logs or getattr(work, "workdir", None) or tempfile.gettempdir()
        with Channel(work) as channel:
            log = log_path(logs, f"torchrun-{work.name}")
            proc = start(self.torchrun.command(), channel, log)
            out = Watch(proc, channel, log, timeout_s, on_step).follow(lambda errors: root_cause(errors, log))
        if out.ok and proc.returncode != 0:  # a rank died in teardown: the measurement stands, the fact is kept
            return replace(out, reason=f"a rank exited abnormally after the result ({summary(log)})")
        if out.status == "failed" and not out.reason:
            return replace(out, reason=f"torchrun exited with code {proc.returncode} before a result ({summary(log)})")
        return out
