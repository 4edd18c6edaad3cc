"""Interleaved timing: every policy times a block of steps, round-robin, for several rounds, all in one process,
so that a disturbance (another process, thermal drift) hits the policies of a round alike. Each policy's
speedup is estimated from *paired* rounds (its block against fp32's in the same round) with a confidence
interval, and rounds in which other processes took the CPU are left out when enough quiet ones remain.

The learning runs (loss curve, metric, peak memory) stay one isolated process per policy; this is the speed
measurement only, on the same initial weights and batches.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dtypelab.core.calibration import calibrating, task_feed
from dtypelab.core.disturbance import CpuMeter, was_disturbed
from dtypelab.core.energy import Meter, measuring
from dtypelab.core.errors import describe_exception
from dtypelab.core.loop import build_model, build_trainable, forward, threads, to_device, train_step
from dtypelab.core.measure import ROUND_BLOCK_S, StepTimer, device_sync, tokens_of
from dtypelab.core.pairing import paired_speedup
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.results import COMPILED_BASELINE, EnergySource, Report, RoundBlock
from dtypelab.core.stats import CLEARLY_SLOWER, MIN_GAIN
from dtypelab.core.task import Task, load_task

WINDOW_MARGIN = 1.25  # blocks sized for the energy counter span this much more than its shortest window


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
    # Sequential: after ``rounds``, a policy more rounds could still decide (``_undecided``: measured above the
    # no-gain band, its interval reaching below it) is timed in more rounds, up to ``max_rounds``, while those
    # extra rounds have taken less than the first ones did; one already decided is not timed again. 0: exactly
    # ``rounds``.
    max_rounds: int = 0
    baseline: str = "fp32"
    given: Task | None = field(default=None, repr=False, compare=False)  # a Task object (inline runs only)

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
    # each policy's first warm-up call: for a compiled one, its compilation from inductor's cache, which the
    # learning run has just filled (what a re-run of the sweep pays)
    first_call_s: dict[str, float] | None = None
    info: Any = None  # (launchers fill it for policies; unused here)
    energy: EnergySource | None = None  # what measured the blocks' joules, or why nothing did
    block: int = 0  # the steps each block timed (more than asked where the energy counter needs longer windows)
    tokens_per_step: int | None = None  # a step's tokens, where its inputs are token ids


def run_rounds(job: RoundsJob, progress: Callable[[int, int], None] | None = None) -> RoundsResult:
    """Build every policy's model, warm each up, then time ``block`` steps of each, round after round (the order
    reversed every other round, so no policy always follows the same one)."""
    start = time.perf_counter()
    progress = progress or (lambda done, total: None)
    try:
        with threads(job.threads):
            stepper = _Stepper(job)
            blocks, first = _rounds(stepper, progress)
    except Exception as exc:
        return RoundsResult("failed", describe_exception(exc), wall_s=time.perf_counter() - start)
    return RoundsResult("ok", blocks=blocks, wall_s=time.perf_counter() - start, first_call_s=first,
                        energy=stepper.energy, block=stepper.block_steps, tokens_per_step=stepper.tokens)


class _Stepper:
    """One job's policies, built, and a step (or inference pass) of any of them, timed or not."""

    def __init__(self, job: RoundsJob) -> None:
        self.job, self.task = job, job.given or load_task(job.task_spec)
        self.device = torch.device(job.device)
        self.sync = device_sync(self.device)
        self.train = job.mode == "train"
        self.runs: list[tuple[str, Precision, Any, Any]] = []
        self.inputs = None if self.train else to_device(self.task.inference_inputs(job.batch_size), self.device)
        # what a calibrated or exported format reads as it converts (GPTQ, an ExecuTorch program): as its own run did
        with calibrating(None if self.inputs is None else task_feed(self.inputs)):
            for plan in job.plans:
                precision = Precision(plan, job.device)
                model, optimizer = build_trainable(self.task, precision, self.device, train=self.train,
                                                   model=build_model(self.task, job.seed, job.weights))
                self.runs.append((plan.name, precision, model, optimizer))
        self.block_steps = job.block
        self.meter: Meter | None = None
        self.energy: EnergySource | None = None
        self.tokens: int | None = None

    def open_meter(self) -> None:
        """The device's energy counter, and its idle power over one window before any policy steps."""
        self.meter, self.energy = measuring(self.device)

    def size_blocks(self, warm_s: dict[str, float]) -> None:
        """Blocks long enough for the energy counter: the fastest policy's block spans its minimum window."""
        fastest = min(warm_s.values(), default=0.0)
        if self.meter is not None and fastest > 0:  # a quarter more: a round's steps may run faster than warm-up's
            self.block_steps = max(self.job.block, math.ceil(WINDOW_MARGIN * self.meter.min_window_s / fastest))

    def step(self, precision: Precision, model: Any, optimizer: Any, index: int, timer: StepTimer | None) -> None:
        if self.train:
            x, y = to_device(self.task.batch(index % self.task.steps, self.job.batch_size), self.device)
            if self.tokens is None:  # every batch of a task has the same shape: read once
                self.tokens = tokens_of(x)
            if timer:
                timer.start()
            train_step(self.task, model, precision, optimizer, x, y)
        else:
            if timer:
                timer.start()
            with torch.no_grad():
                forward(model, precision, self.inputs)
        if timer:
            timer.stop()

    def warm(self) -> tuple[dict[str, float], dict[str, float]]:
        """The warmup steps of every policy: each one's first call's time (compiling, where it compiles) and its last
        step's (what sizes the blocks for an energy counter)."""
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        for name, precision, model, optimizer in self.runs:
            with precision.session():
                for i in range(self.job.warmup):
                    timer = StepTimer(sync=self.sync)
                    self.step(precision, model, optimizer, i, timer)
                    if i == 0:
                        first[name] = timer.samples[0]
                    last[name] = timer.samples[0]
        if self.inputs is not None:
            self.tokens = tokens_of(self.inputs)
        return first, last

    def block(self, run: tuple[str, Precision, Any, Any], r: int) -> RoundBlock:
        """Round ``r``'s block of steps of one policy, timed and watched."""
        _, precision, model, optimizer = run
        timer, cpu = StepTimer(sync=self.sync), CpuMeter()
        with precision.session():
            cpu.start()
            window = self.meter.begin() if self.meter else None
            for k in range(self.block_steps):  # the same batches for every policy of a round: paired blocks
                self.step(precision, model, optimizer, r * self.block_steps + k, timer)
            # a block its warm-up sized may still run shorter than the counter's window (warm-up slowed by a
            # neighbour, a round's steps faster): more steps until it lasts it, as serving's blocks are timed
            k = 0
            while window is not None and window.elapsed_s < WINDOW_MARGIN * window.meter.min_window_s:
                self.step(precision, model, optimizer, (r + 1) * self.block_steps + k, timer)  # time moves on
                k += 1
            reading = window.end()[0] if window else None
            d = cpu.stop()
        return RoundBlock(round=r, median_s=statistics.median(timer.samples), n=len(timer.samples),
                          other_cores=d.other_cores if d else 0.0, pressure_s=d.pressure_s if d else None,
                          disturbed=bool(d and d.disturbed), joules=reading.joules if reading else None,
                          window_s=reading.seconds if reading else None)


def _rounds(stepper: _Stepper, progress: Callable[[int, int], None]
            ) -> tuple[dict[str, tuple[RoundBlock, ...]], dict[str, float]]:
    job, runs = stepper.job, stepper.runs
    stepper.open_meter()
    torch.manual_seed(job.seed)
    first, last = stepper.warm()
    stepper.size_blocks(last)
    out: dict[str, list[RoundBlock]] = {name: [] for name, *_ in runs}
    total, done = job.rounds * len(runs), 0
    first_s = 0.0  # the planned rounds' time: the extra rounds may take as long again, no longer
    start = time.perf_counter()
    r, active = 0, runs
    while active:
        for run in (active if r % 2 == 0 else active[::-1]):
            out[run[0]].append(stepper.block(run, r))
            done += 1
            progress(min(done, total), total)
        r += 1
        if r == job.rounds:
            first_s = time.perf_counter() - start
        if r >= job.rounds:
            close = _undecided(out, job.baseline) if r < job.max_rounds and \
                time.perf_counter() - start < 2 * first_s else set()
            active = [run for run in runs if run[0] in close or (close and run[0] == job.baseline)]
            if active:
                total = done + len(active) * (job.max_rounds - r)
    progress(done, done)
    return {k: tuple(v) for k, v in out.items()}, first


def _undecided(out: dict[str, list[RoundBlock]], baseline: str) -> set[str]:
    """The policies for which more rounds could change the recommendation: measured faster than the no-gain band
    (point above 1.02) but with an interval still reaching below it, and not beaten outright by a policy already
    measurably faster (its interval wholly above this one's). One measured at or below 1.02 stays unchosen
    whatever more rounds show: a narrower interval around its point never clears the band."""
    base = tuple(out.get(baseline, ()))
    cis = {name: ci for name, blocks in out.items()
           if name != baseline and (ci := paired_speedup(base, tuple(blocks))) is not None}
    bar = 1 + MIN_GAIN
    best_low = max((ci.low for ci in cis.values() if ci.low > bar), default=0.0)
    return {name for name, ci in cis.items() if ci.low <= bar < ci.point and ci.high > best_low}


# --- which policies the rounds time, and in blocks of how many steps ---
def round_block(report: Report, job: RoundsJob) -> int:
    """Inference passes of a quarter second or more are timed one per round: a pass that long is its own median
    (its spread on a quiet CPU is a few percent), and minilm's rounds take 28 s instead of 48 s. Shorter passes keep
    the configured block. Training keeps its blocks: optimizer steps vary more."""
    base = report.base
    if job.mode != "infer" or base is None or not base.timing:
        return job.block
    return max(1, min(job.block, math.ceil(ROUND_BLOCK_S / base.timing.median)))


def clearly_slower(report: Report, ran: list[str]) -> set[str]:
    """The policies the rounds need not time: their own undisturbed run at or below CLEARLY_SLOWER of fp32's speed
    (fp32's undisturbed too). The baselines are always timed."""
    base = report.base
    if base is None or not base.timing or was_disturbed(base.disturbance):
        return set()
    out = set()
    for name in ran:
        r = report.result(name)
        if name in (report.baseline, COMPILED_BASELINE) or not r.timing or was_disturbed(r.disturbance):
            continue
        if base.timing.median <= CLEARLY_SLOWER * r.timing.median:
            out.add(name)
    return out


__all__ = ["RoundsJob", "RoundsResult", "clearly_slower", "paired_speedup", "round_block", "run_rounds"]
