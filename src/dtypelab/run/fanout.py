"""Fan-out launchers: several pieces of work at once, through submitit (https://github.com/facebookincubator/submitit),
which submits Python callables to Slurm as a job array and runs them as local processes where there is no Slurm.

- ``local-gpus``: one job per GPU of this machine at a time, each pinned with ``CUDA_VISIBLE_DEVICES`` (submitit's
  local executor); with no GPU (tests, a CPU box) the slots are CPU processes;
- ``slurm``: every piece of work one task of a submitit job array (``--partition``, ``--time``, ``--gpus-per-job``,
  ``--slurm-args``); the cluster needs a filesystem that this machine and the nodes share for submitit's folder.

Both are a ``Launcher`` (``run`` one piece of work: the sweep's timing rounds, on *one* device) and add ``run_many``,
which the capabilities call for the independent, long part (the learning runs). A job that fails, times out, is
pre-empted or dies becomes that work's ``Outcome`` with its log's last line; the others still count. Ctrl-C cancels
every job not yet finished. Progress comes through a small file per job in the shared folder: the jobs cannot reach
this process's socket from another node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.run.channel import Reporter
from dtypelab.run.messages import Done, Failed
from dtypelab.run.outcome import Outcome, failure, last_line

POLL_S = 0.5
MARGIN_MIN = 5  # Slurm's own time limit is the work's limit plus this: dtypelab's timeout speaks first
# Slurm states (and submitit's local ones) that end a job without a result, as dtypelab statuses
_ENDED = {"TIMEOUT": "timeout", "PREEMPTED": "interrupted", "CANCELLED": "interrupted", "NODE_FAIL": "failed",
          "OUT_OF_MEMORY": "oom", "INTERRUPTED": "failed", "FAILED": "failed", "BOOT_FAIL": "failed",
          "DEADLINE": "timeout"}

OnState = Callable[[str, str, int, int], None]  # (work's name, state, steps done, total)


def where() -> str:
    """This process's place, for the record: host, job, and the GPU it was given."""
    parts = [socket.gethostname()]
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array else \
        os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID")
    if job:
        parts.append(f"job {job}")
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus:
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not visible to torch"
        parts.append(f"GPU {gpus} ({name})")
    return ", ".join(parts)


@dataclass(frozen=True)
class _Progress:
    """A Reporter's step callback that writes "done total" to a file (the shared folder) for the poller."""

    path: str

    def __call__(self, done: int, total: int) -> None:
        with contextlib.suppress(OSError):
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{done} {total}")
            os.replace(tmp, self.path)


def execute(work: Any, progress_path: str) -> Done | Failed:
    """What a job runs: the work, its exception caught into the one error model (so a job that raised and one that
    returned come back alike), and where it ran."""
    here = where()
    try:
        value = work(Reporter(on_step=_Progress(progress_path)))
    except BaseException as exc:
        status, reason = failure(exc)
        return Failed(status, reason, where=here)
    return Done(value, where=here)


@dataclass
class _Running:
    work: Any
    job: Any
    slot: int | None
    progress: str
    started: float | None = None  # when it was first seen running (a Slurm job's queueing is not its time)
    state: str = "pending"


@dataclass
class FanOutLauncher:
    """Work fanned out by submitit: ``kind`` "local-gpus" (slots: this machine's GPUs, or CPU processes when
    ``gpus`` is empty) or "slurm". ``folder`` holds submitit's pickles and logs (shared with the nodes for Slurm)."""

    kind: str
    folder: str
    gpus: tuple[int, ...] = ()
    cpu_slots: int = 1  # local-gpus without GPUs: processes at once
    gpus_per_job: int = 1
    partition: str | None = None
    time_min: int | None = None
    slurm_args: dict[str, str] = field(default_factory=dict)
    poll_s: float = POLL_S
    parallel: bool = True

    @property
    def name(self) -> str:
        return self.kind

    @property
    def slots(self) -> int:
        return len(self.gpus) if self.kind == "local-gpus" and self.gpus else self.cpu_slots

    def _executor(self, gpu: int | None, timeout_s: float, count: int) -> Any:
        import submitit

        limit = self.time_min or max(1, int(timeout_s // 60) + MARGIN_MIN)
        if self.kind == "slurm":
            if shutil.which("srun") is None or shutil.which("sbatch") is None:
                raise DtypelabError("--launcher slurm: no Slurm here (sbatch and srun not found); run from a node "
                                    "that submits to the cluster, such as its login node")
            ex = submitit.AutoExecutor(folder=self.folder, cluster="slurm")
            params: dict[str, Any] = {"timeout_min": limit, "gpus_per_node": self.gpus_per_job, "nodes": 1,
                                      "tasks_per_node": 1, "slurm_array_parallelism": max(1, count),
                                      "name": "dtypelab"}
            if self.partition:
                params["slurm_partition"] = self.partition
            if self.slurm_args:
                params["slurm_additional_parameters"] = dict(self.slurm_args)
            ex.update_parameters(**params)
            return ex
        ex = submitit.LocalExecutor(folder=self.folder)
        ex.update_parameters(timeout_min=limit, gpus_per_node=0 if gpu is None else 1,
                             visible_gpus=() if gpu is None else (gpu,))
        return ex

    def _submit(self, works: Sequence[Any], timeout_s: float, slot: int | None) -> list[_Running]:
        os.makedirs(self.folder, exist_ok=True)
        gpu = self.gpus[slot] if slot is not None and self.gpus else None
        ex = self._executor(gpu, timeout_s, len(works))
        progress = [os.path.join(self.folder, f"progress-{os.getpid()}-{time.monotonic_ns()}-{i}")
                    for i in range(len(works))]
        if self.kind == "slurm":
            with ex.batch():  # one job array
                jobs = [ex.submit(execute, w, p) for w, p in zip(works, progress, strict=True)]
        else:
            with _quiet_children(os.path.join(self.folder, "controllers.log")):
                jobs = [ex.submit(execute, w, p) for w, p in zip(works, progress, strict=True)]
        return [_Running(w, j, slot, p) for w, j, p in zip(works, jobs, progress, strict=True)]

    def run(self, work: Any, timeout_s: float, on_step: Callable[[int, int], None]) -> Outcome:
        """One piece of work, on one slot (the first GPU locally; one Slurm job)."""
        return self.run_many([work], timeout_s, lambda name, state, done, total: on_step(done, total))[work.name]

    def run_many(self, works: Sequence[Any], timeout_s: float, on_state: OnState | None = None,
                 on_outcome: Callable[[Any, Outcome], None] | None = None) -> dict[str, Outcome]:
        """Every piece of work, as many at once as there are slots (all at once on Slurm); ``on_state`` hears each
        job's state and steps as they change, ``on_outcome`` each outcome as it comes. Ctrl-C cancels every job
        not yet finished and propagates."""
        on_state = on_state or (lambda *a: None)
        pending, running, outcomes = list(works), [], {}
        free = list(range(self.slots))
        seen: dict[str, tuple[str, int, int]] = {}
        try:
            if self.kind == "slurm":
                running = self._submit(pending, timeout_s, None)
                pending = []
            while pending or running:
                while pending and free and self.kind != "slurm":
                    running += self._submit([pending.pop(0)], timeout_s, free.pop(0))
                for run in list(running):
                    out = self._poll(run, timeout_s)
                    if out is None:
                        done, total = _read_progress(run.progress)
                        now = (run.state, done, total)
                        if seen.get(run.work.name) != now:
                            seen[run.work.name] = now
                            on_state(run.work.name, run.state, done, total)
                        continue
                    running.remove(run)
                    if run.slot is not None:
                        free.append(run.slot)
                        free.sort()
                    outcomes[run.work.name] = out
                    on_state(run.work.name, "done" if out.ok else out.status, 0, 0)
                    if on_outcome is not None:
                        on_outcome(run.work, out)
                    with contextlib.suppress(OSError):
                        os.remove(run.progress)
                if pending or running:
                    time.sleep(self.poll_s)
        except BaseException:
            for run in running:
                with contextlib.suppress(Exception):
                    run.job.cancel(check=False)
            raise
        return outcomes

    def _poll(self, run: _Running, timeout_s: float) -> Outcome | None:
        """The job's outcome once it has ended (or outlived ``timeout_s`` of running: then it is cancelled)."""
        state = _state(run.job)
        if state == "RUNNING" and run.started is None:
            run.started = time.monotonic()
        run.state = "running" if state in ("RUNNING", "COMPLETING") else "pending" if run.started is None else \
            run.state
        if not run.job.done():
            if run.started is not None and time.monotonic() - run.started > timeout_s:
                with contextlib.suppress(Exception):
                    run.job.cancel(check=False)
                return Outcome("timeout", f"stopped after the {timeout_s:g} s time limit (job {run.job.job_id})",
                               started=True, wall_s=time.monotonic() - run.started)
            return None
        wall = time.monotonic() - run.started if run.started is not None else 0.0
        try:
            result = run.job.result()
        except Exception:  # ended without a result: killed, timed out, pre-empted, out of memory
            state = (_state(run.job) or "FAILED").split()[0]  # one query: on Slurm each is an sacct call
            status = _ENDED.get(state, "failed")
            tail = _tail(run.job)
            return Outcome(status, f"job {run.job.job_id} ended without a result ({state.lower()})"
                                   f"{': ' + tail if tail else ''}; its log: {_log(run.job)}",
                           started=run.started is not None, wall_s=wall)
        if isinstance(result, Done):
            return Outcome("ok", value=result.value, started=True, wall_s=wall, ranks=(0,), where=result.where)
        return Outcome(result.status, result.reason, started=True, wall_s=wall, where=result.where)


@contextlib.contextmanager
def _quiet_children(log: str) -> Any:
    """submitit's local controller inherits this process's stdout and stderr: a cancelled job (or Ctrl-C, which
    reaches it too) would print its traceback over the progress. Its output goes to ``log`` instead (the jobs'
    own output has its own files)."""
    import sys

    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    # submitit cancels a local job with SIGINT. A process started in the background by a non-interactive shell (or
    # under nohup-like wrappers) ignores SIGINT, and an ignored signal stays ignored across exec: the controllers
    # would never stop. A handler does not survive exec, so with one installed while they start, they get the default.
    ignored = False
    with contextlib.suppress(ValueError):  # not the main thread: leave it
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)


def _state(job: Any) -> str:
    try:
        return str(job.state or "").upper()
    except Exception:
        return "UNKNOWN"


def _log(job: Any) -> str:
    with contextlib.suppress(Exception):
        return str(job.paths.stderr)
    return "?"


def _tail(job: Any) -> str:
    """The job's last words: its stderr's last line, else its stdout's (submitit's own lines left out)."""
    for path in (getattr(job.paths, "stderr", None), getattr(job.paths, "stdout", None)):
        if path is None:
            continue
        line = last_line(str(path))
        if line and "submitit" not in line:
            return line
    return ""


def _read_progress(path: str) -> tuple[int, int]:
    try:
        with open(path) as f:
            done, total = f.read().split()
        return int(done), int(total)
    except (OSError, ValueError):
        return 0, 0


__all__ = ["FanOutLauncher", "execute", "where"]
