"""The torchrun launcher: one policy's job on N ranks (per node), started by torchrun itself (``python -m
torch.distributed.run``), never by a home-made launcher. It plugs into the sweep like the in-process and
child-process launchers (``Launcher.run(job, timeout_s, on_step)``).

One node: ``--standalone``. Several: ``--nnodes``, ``--node-rank``, ``--rdzv-backend``, ``--rdzv-endpoint`` and
``--rdzv-id`` go to torchrun unchanged, and so do any ``extra`` arguments. Run the same command on every node;
the node that hosts global rank 0 gets the result, the others record that they ran as workers.

A rank that fails writes its one-line error; torchrun then stops the other ranks and exits, and the first error
becomes the policy's reason. A hang ends at ``timeout_s``: torchrun is told to stop (SIGTERM, which it passes on to
its workers), then killed, and any rank still alive is killed by the pid it wrote, so no process outlives the job.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dtypelab.core.errors import DtypelabError
from dtypelab.core.results import PolicyResult
from dtypelab.distributed.scaling import parse_links
from dtypelab.sweep.job import Job
from dtypelab.sweep.launch import OnStep, last_line

POLL_S = 0.1
STOP_GRACE_S = 10.0


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

    def command(self, rundir: str) -> list[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc}", "--max-restarts=0"]
        if self.standalone:
            cmd.append("--standalone")
        else:
            cmd.append(f"--nnodes={self.nnodes}")
            if self.rdzv_endpoint:
                if not any(a.startswith("--rdzv-backend") or a.startswith("--rdzv_backend") for a in self.extra):
                    cmd.append("--rdzv-backend=c10d")
                cmd.append(f"--rdzv-endpoint={self.rdzv_endpoint}")
        return [*cmd, *self.extra, "-m", "dtypelab.distributed.worker", rundir]

    def describe(self) -> str:
        return shlex.join(["torchrun", *self.command("RUNDIR")[3:]])

    def launcher(self) -> TorchrunLauncher:
        return TorchrunLauncher(self)


def _pids(rundir: str) -> list[int]:
    out = []
    for name in os.listdir(rundir):
        if name.startswith("pid-"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(rundir, name)) as f:
                out.append(int(f.read().strip()))
    return out


def _ours(pid: int, rundir: str) -> bool:
    """Whether ``pid`` is still one of this job's ranks (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return rundir.encode() in f.read()
    except OSError:
        return False


def kill_ranks(rundir: str) -> list[int]:
    """Kill every rank of the job still alive; the pids that had to be killed."""
    killed = []
    for pid in _pids(rundir):
        if _ours(pid, rundir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def first_error(rundir: str, log: str) -> str:
    """The failure's root cause, in one line: the error the first failed rank wrote (torchrun's "Root Cause"), or,
    for a rank killed by a signal (a C++ abort writes no Python error), what the log says of it; the earliest
    error file otherwise. The other ranks' errors are usually consequences ("connection reset by peer")."""
    errors = {}
    for name in os.listdir(rundir):
        m = re.fullmatch(r"error-(\d+)\.txt", name)
        if m:
            path = os.path.join(rundir, name)
            errors[int(m.group(1))] = (os.path.getmtime(path), _read(path).strip())
    text = _read(log)
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*?(\((SIG\w+)\))?\s*$", text,
                     re.S | re.M)
    if root and int(root.group(1)) in errors:
        return errors[int(root.group(1))][1]
    if root and root.group(4):
        what = re.findall(r"what\(\):\s*(.+)", text)
        return f"rank {root.group(1)} killed by {root.group(4)}" + (f": {what[0].strip()[:300]}" if what else "")
    return min(errors.values())[1] if errors else ""


def root_cause(log: str) -> str:
    """What torchrun's failure summary says of the first failed rank (its exit code, the signal), else the log's
    last line: a rank killed by a signal writes no error of its own."""
    text = _read(log)
    found = [f"{k}: {v.strip()}" for k, v in re.findall(r"^\s*(rank|exitcode|traceback)\s*:\s*(.+)$", text, re.M)]
    if found:
        return "torchrun: " + "; ".join(dict.fromkeys(found))[:300]
    tail = last_line(log)
    return f"last output: {tail}" if tail else "no output"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class TorchrunLauncher:
    """Each job under torchrun with ``torchrun.nproc`` ranks per node."""

    name = "torchrun"

    def __init__(self, torchrun: Torchrun) -> None:
        self.torchrun = torchrun

    def run(self, job: Job, timeout_s: float, on_step: OnStep) -> PolicyResult:
        rundir = os.path.join(job.workdir, "dist-" + re.sub(r"[^A-Za-z0-9_.-]", "_", job.policy))
        os.makedirs(rundir, exist_ok=True)
        with open(os.path.join(rundir, "job.pkl"), "wb") as f:
            pickle.dump((job, self.torchrun.nnodes, timeout_s), f)
        log = os.path.join(rundir, "torchrun.log")
        start = time.monotonic()
        result: PolicyResult | None = None
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(self.torchrun.command(rundir), stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            seen = ""
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    result = PolicyResult(job.policy, "timeout", f"stopped after the {timeout_s:g} s time limit "
                                          f"(ranks of {job.policy} still running)")
                    break
                time.sleep(POLL_S)
                with contextlib.suppress(OSError, ValueError), open(os.path.join(rundir, "progress")) as f:
                    text = f.read()
                    if text != seen:
                        seen = text
                        on_step(*map(int, text.split()))
        finally:
            _stop(proc)  # also on Ctrl-C in the parent
            killed = kill_ranks(rundir)
        wall = time.monotonic() - start
        if result is None:
            result = self._outcome(job, rundir, proc.returncode, log)
        if killed and result.status == "timeout":
            result = replace(result, reason=result.reason + f"; killed {len(killed)} rank(s) still alive")
        return result if result.wall_s else replace(result, wall_s=wall)

    def _outcome(self, job: Job, rundir: str, returncode: int, log: str) -> PolicyResult:
        path = os.path.join(rundir, "result.pkl")
        if os.path.exists(path):  # written once every rank had finished the measurement
            with open(path, "rb") as f:
                result = pickle.load(f)
            if returncode != 0:  # a rank died in teardown: the measurement stands, the fact is kept
                result = replace(result, reason="; ".join(filter(None, (
                    result.reason, f"a rank exited abnormally after the result ({root_cause(log)})"))))
            return result
        error = first_error(rundir, log)
        if returncode == 0:  # a node without global rank 0 in a multi-node run
            return PolicyResult(job.policy, "skipped", "this node ran worker ranks; the result is on the node with "
                                "global rank 0", skip="unsupported")
        if error:
            return PolicyResult(job.policy, "failed", error)
        return PolicyResult(job.policy, "failed", f"torchrun exited with code {returncode} before a result"
                            f" ({root_cause(log)})")


def check_options(nproc: int | None, nnodes: int, rdzv_endpoint: str | None, torchrun_args: str | Sequence[str] | None,
                  link_gbps: str | Sequence[str | float] | None, *, mode: str, per_layer: bool, profile: bool,
                  rounds: int | None, launcher: object) -> tuple[Torchrun, tuple[tuple[str, float], ...]]:
    """The torchrun settings for ``bench --nproc`` and the links of its scaling estimate, or a one-line error for
    what a distributed run cannot do."""
    if nproc is None:
        if link_gbps and nnodes == 1 and not rdzv_endpoint and not torchrun_args:
            raise DtypelabError("--link-gbps is for the scaling estimate of a distributed run: give --nproc N")
        raise DtypelabError("--nnodes, --rdzv-endpoint and --torchrun-args need --nproc N (ranks per node)")
    if nproc < 1 or nnodes < 1:
        raise DtypelabError(f"--nproc and --nnodes must be at least 1, got {nproc} and {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise DtypelabError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    refused = [flag for flag, given in (("--mode infer", mode != "train"), ("--per-layer", per_layer),
                                        ("--profile", profile), ("--rounds", bool(rounds))) if given]
    if refused:
        raise DtypelabError(f"{', '.join(refused)}: not with --nproc (distributed runs measure training, each "
                            "policy in its own torchrun job)")
    if launcher not in (None, "torchrun"):
        raise DtypelabError("--nproc runs every policy under torchrun; it takes no other launcher")
    try:
        extra = tuple(shlex.split(torchrun_args) if isinstance(torchrun_args, str) else torchrun_args or ())
    except ValueError as exc:
        raise DtypelabError(f"--torchrun-args: {exc}") from None
    return Torchrun(nproc, nnodes, rdzv_endpoint, extra), parse_links(link_gbps)
