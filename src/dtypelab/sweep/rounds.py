"""Interleaved timing: every policy times a block of steps, round-robin, for several rounds, all in one process,
so that a disturbance (another process, thermal drift) hits the policies of a round alike. Each policy's
speedup is estimated from *paired* rounds (its block against fp32's in the same round) with a confidence
interval, and rounds in which other processes took the CPU are left out when enough quiet ones remain.

The learning runs (loss curve, metric, peak memory) stay one isolated process per policy; this is the speed
measurement only, on the same initial weights and batches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtypelab.core.disturbance import CpuMeter
from dtypelab.core.errors import describe_exception
from dtypelab.core.loop import build_model, forward, threads, to_device, train_step
from dtypelab.core.measure import StepTimer, device_sync
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.results import RoundBlock, SpeedupInterval
from dtypelab.core.stats import MIN_QUIET, ratio_interval
from dtypelab.core.task import load_task


@dataclass(frozen=True)
class RoundsJob:
    """Timing rounds for several policies in one process (picklable: the task travels as its spec)."""

    task_spec: str
    plans: tuple[Plan, ...]
    mode: str  # "train" or "infer"
    rounds: int
    block: int  # timed steps per policy per round
    batch_size: int
    seed: int
    device: str
    weights: str | None  # the initial (train) or reference (infer) weights the sweep saved; None: the task's own
    threads: int | None = None
    warmup: int = 2  # untimed steps per policy before the first round (caches, compiled graphs)
    workdir: str = "."  # where a child process's log goes (the sweep's temporary folder)

    @property
    def name(self) -> str:  # for a launcher's messages about it
        return "rounds"

    def __call__(self, report: Callable[[int, int], None]) -> RoundsResult:
        return run_rounds(self, report)


@dataclass(frozen=True)
class RoundsResult:
    status: str  # "ok", or why there are no rounds ("failed", "timeout", ...)
    reason: str = ""
    blocks: dict[str, tuple[RoundBlock, ...]] | None = None
    wall_s: float = 0.0
    info: Any = None  # (launchers fill it for policies; unused here)


def run_rounds(job: RoundsJob, progress: Callable[[int, int], None] | None = None) -> RoundsResult:
    """Build every policy's model, warm each up, then time ``block`` steps of each, round after round (the order
    reversed every other round, so no policy always follows the same one)."""
    start = time.perf_counter()
    progress = progress or (lambda done, total: None)
    try:
        with threads(job.threads):
            blocks = _rounds(job, progress)
    except Exception as exc:
        return RoundsResult("failed", describe_exception(exc), wall_s=time.perf_counter() - start)
    return RoundsResult("ok", blocks=blocks, wall_s=time.perf_counter() - start)


def _rounds(job: RoundsJob, progress: Callable[[int, int], None]) -> dict[str, tuple[RoundBlock, ...]]:
    task = load_task(job.task_spec)
    device = torch.device(job.device)
    sync = device_sync(device)
    train = job.mode == "train"
    runs = []
    for plan in job.plans:
        precision = Precision(plan, job.device)
        model = precision.convert_module(build_model(task, job.seed, job.weights).to(device))
        model.train(train)
        optimizer = task.make_optimizer(model.parameters()) if train else None
        runs.append((plan.name, precision, model, optimizer))
    inputs = None if train else to_device(task.inference_inputs(job.batch_size), device)

    def step(precision: Precision, model: Any, optimizer: Any, index: int, timer: StepTimer | None) -> None:
        if train:
            x, y = to_device(task.batch(index % task.steps, job.batch_size), device)
            if timer:
                timer.start()
            train_step(task, model, precision, optimizer, x, y)
        else:
            if timer:
                timer.start()
            with torch.no_grad():
                forward(model, precision, inputs)
        if timer:
            timer.stop()

    torch.manual_seed(job.seed)
    for _, precision, model, optimizer in runs:
        with precision.session():
            for i in range(job.warmup):
                step(precision, model, optimizer, i, None)
    out: dict[str, list[RoundBlock]] = {name: [] for name, *_ in runs}
    total, done = job.rounds * len(runs), 0
    for r in range(job.rounds):
        for name, precision, model, optimizer in (runs if r % 2 == 0 else runs[::-1]):
            timer, cpu = StepTimer(sync=sync), CpuMeter()
            with precision.session():
                cpu.start()
                for k in range(job.block):  # the same batches for every policy of a round: paired blocks
                    step(precision, model, optimizer, r * job.block + k, timer)
                d = cpu.stop()
            other = d.other_cores if d else 0.0
            out[name].append(RoundBlock(round=r, median_s=statistics.median(timer.samples), n=len(timer.samples),
                                        other_cores=other, pressure_s=d.pressure_s if d else None,
                                        disturbed=bool(d and d.disturbed)))
            done += 1
            progress(done, total)
    return {k: tuple(v) for k, v in out.items()}


# --- statistics ------------------------------------------------------------------------------------------
def paired_speedup(base: tuple[RoundBlock, ...], blocks: tuple[RoundBlock, ...]) -> SpeedupInterval | None:
    """fp32's block median over this policy's, round by round; their geometric mean and a Student-t interval
    on the log ratios. Rounds where either block was disturbed are left out while MIN_QUIET quiet ones remain."""
    pairs = [(b, p) for b, p in zip(base, blocks, strict=False) if b.median_s > 0 and p.median_s > 0]
    quiet = [(b, p) for b, p in pairs if not (b.disturbed or p.disturbed)]
    used = quiet if len(quiet) >= MIN_QUIET else pairs
    ci = ratio_interval([(b.median_s, p.median_s) for b, p in used])
    if ci is None:
        return None
    return SpeedupInterval(point=ci.point, low=ci.low, high=ci.high, rounds=ci.n, dropped=len(pairs) - len(used),
                           disturbed=len(pairs) - len(quiet))


__all__ = ["RoundsJob", "RoundsResult", "paired_speedup", "run_rounds"]
