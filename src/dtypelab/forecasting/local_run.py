"""What a forecast runs on this machine: a step that cannot be traced, measured on real tensors and extrapolated;
the memory there is to do it in; and ``--check``'s process peak, measured as ``bench`` measures it."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from dtypelab.core.footprint import tensor_bytes
from dtypelab.core.measure import young_heap
from dtypelab.core.policies import Plan
from dtypelab.core.results import CheckResult, PolicyForecast
from dtypelab.core.task import Task
from dtypelab.forecasting.fake_step import Run, Target, Traced, shifted
from dtypelab.forecasting.ledger import Peak

CHECK_STEPS = 3  # --check: real steps, the first making the optimizer's state
TIMED_STEPS = 10  # --check: the steps timed for the measured step time (after WARM_STEPS), at least
TIMED_S, MORE_STEPS = 0.5, 100  # and fast steps until this much of them is timed, at most this many
WARM_STEPS = 3  # caches, the optimizer's state, a compiled policy's graphs


class HostJob(Protocol):
    """What this module reads of a forecaster's job (``job.ForecastJob``)."""

    @property
    def seed(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def infer_batch_size(self) -> int: ...

    @property
    def check_device(self) -> str: ...

    @property
    def check(self) -> bool: ...

    @property
    def plans(self) -> tuple[Plan, ...]: ...


class Host(Protocol):
    """What this module asks of a ``forecaster.Forecaster``: its public state and methods, nothing private."""

    @property
    def job(self) -> HostJob: ...

    task: Task
    target: Target
    meta: nn.Module
    trains: bool
    measured: dict[tuple[str, bool], tuple[list[Traced], tuple[int, ...]]]
    times: Any  # timing.StepTimes, or None without rates

    @property
    def times_here(self) -> bool: ...

    def time(self, plan: Plan, train: bool) -> Any: ...

    def converted(self, plan: Plan, depth: int | None = None) -> tuple[nn.Module, Plan, int]: ...

    def wrap(self, plan: Plan) -> Any: ...

    def hardware_here(self) -> Any: ...

    def run_here(self, plan: Plan, batch_size: int, train: bool, steps: int, device: str = "cpu") -> Traced: ...


def fallback(forecaster: Host, plan: Plan, batch_size: int, train: bool, why: str, notes: list[str],
             ) -> tuple[Traced, str]:
    """A step ``forecaster`` (a ``Forecaster``) could not trace on fake tensors: run here on real tensors at one or two
    small batch sizes (extrapolated along their line) when the model fits this machine, else its state alone."""
    if room_for(tensor_bytes(forecaster.meta.parameters())) and plan.distributed is None:
        sizes = (batch_size,) if batch_size <= 4 else (2, 4)
        key = (plan.name, train)
        measured = forecaster.measured
        if key not in measured or (measured[key][1] != sizes and len(sizes) == 1):
            measured[key] = ([run_here(forecaster, plan, b, train, steps=2) for b in sizes], sizes)
        runs, sizes = measured[key]
        notes.append(f"the step could not be traced on fake tensors ({why}); it was run here on real tensors at "
                     f"batch size {' and '.join(map(str, sizes))}" + (
                         " and extrapolated along the line through them" if len(sizes) > 1 else ""))
        return (runs[0] if len(runs) == 1 else extrapolate(runs, sizes, batch_size)), "measured"
    model, stand, extra = forecaster.converted(plan)
    run = Run(forecaster.task, stand, model, forecaster.target, wrap=forecaster.wrap(plan), converted=True)
    if not train:
        notes.append(f"the inference pass could not be traced on fake tensors ({why}), and the model is too large "
                     "to run here: its weights alone are counted, so its peak is at least this")
        return shifted(run.weights(), extra, "parameters"), "state-only"
    notes.append(f"the step could not be traced on fake tensors ({why}), and the model is too large to run "
                 "here: its weights, gradients and optimizer state are traced alone; activations are not "
                 "counted, so the peak is at least this")
    return shifted(run.state(), extra, "parameters"), "state-only"


def run_here(forecaster: Host, plan: Plan, batch_size: int, train: bool, steps: int, device: str = "cpu") -> Traced:
    """``steps`` real steps (or an inference pass) of the forecaster's task here, counted by the ledger."""
    task = forecaster.task
    torch.manual_seed(forecaster.job.seed)
    run = Run(task, plan, task.make_model(), replace(forecaster.target, timed=False), fake=False, device=device)
    if train:
        return run.train(lambda step: task.train_batch(step, batch_size), batch_size, steps=steps)
    return run.infer(lambda step: task.inference_inputs(batch_size), batch_size)


def extrapolate(runs: list[Traced], sizes: tuple[int, ...], batch_size: int) -> Traced:
    """The peak at ``batch_size`` on the line through two measured ones, category by category."""
    (a, b), (sa, sb) = runs, sizes
    t = (batch_size - sa) / (sb - sa)
    breakdown = {k: max(0, round(a.peak.breakdown[k] + t * (b.peak.breakdown[k] - a.peak.breakdown[k])))
                 for k in a.peak.breakdown}
    most = {k: max(0, round(a.most[k] + t * (b.most[k] - a.most[k]))) for k in a.most}
    return Traced(Peak(sum(breakdown.values()), breakdown, b.peak.phase, b.peak.module), most, b.parameter_bytes)


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def room_for(weights: int) -> bool | None:
    """Whether a model of ``weights`` bytes can be trained here for real (its weights, gradients, optimizer state
    and activations: eight times the weights, with the rest of the machine's work); None: the memory is unknown."""
    room = available_bytes()
    return None if room is None else 8 * weights < room


def process_peak(task: Task, plan: Plan, device: str, batch_size: int, train: bool, seed: int,
                  ) -> tuple[int | None, str]:
    """The run's peak as ``bench`` measures it (``MemoryMeter``): CHECK_STEPS training steps (or one inference
    pass) above the memory in use before the model was built."""
    from dtypelab.core.loop import build_model, build_trainable, forward, prime, to_device, train_step
    from dtypelab.core.measure import MemoryMeter
    from dtypelab.core.policies import Precision

    dev = torch.device(device)
    if dev.type == "cpu":
        prime(task, plan, dev, batch_size, train=train)
    precision = Precision(plan, dev)
    meter = MemoryMeter(dev)
    meter.start()
    model: nn.Module = build_model(task, seed)
    model, optimizer = build_trainable(task, precision, dev, model=model, train=train)
    meter.open_window()
    with precision.session():
        if train:
            for step in range(CHECK_STEPS):
                inputs, target = to_device(task.batch(step, batch_size), dev)
                train_step(task, model, precision, optimizer, inputs, target)
        else:
            with torch.no_grad():
                forward(model, precision, to_device(task.inference_inputs(batch_size), dev))
    peak = meter.peak_bytes()
    del model, optimizer
    return peak, meter.method


def step_seconds(task: Task, plan: Plan, device: str, batch_size: int, train: bool, seed: int) -> float:
    """--check's measured step time: the fastest of TIMED_STEPS training steps (or inference passes) after
    WARM_STEPS, on real tensors, the device synchronized around each (another process's burst slows steps, never
    speeds one: the fastest is the least disturbed)."""
    import time

    from dtypelab.core.loop import build_model, build_trainable, forward, to_device, train_step
    from dtypelab.core.measure import device_sync
    from dtypelab.core.policies import Precision

    dev = torch.device(device)
    sync = device_sync(dev) or (lambda: None)
    precision = Precision(plan, dev)
    model, optimizer = build_trainable(task, precision, dev, model=build_model(task, seed), train=train)
    times: list[float] = []
    step = 0
    with precision.session():
        # TIMED_STEPS at least; fast steps until TIMED_S of them (at most MORE_STEPS): the fastest of few
        # millisecond steps moves with the machine's moment more than the fastest of many
        while len(times) < TIMED_STEPS or (sum(times) < TIMED_S and len(times) < MORE_STEPS):
            if train:
                inputs, target = to_device(task.batch(step, batch_size), dev)
            else:
                inputs = to_device(task.inference_inputs(batch_size), dev)
            sync()
            start = time.perf_counter()
            if train:
                train_step(task, model, precision, optimizer, inputs, target)
            else:
                with torch.no_grad():
                    forward(model, precision, inputs)
            sync()
            if step >= WARM_STEPS:
                times.append(time.perf_counter() - start)
            step += 1
    return min(times)


MEASURE_ROUNDS = 3  # --check on this CPU: rounds of every policy's steps, interleaved, at most


def interleaved_steps(measure: dict[str, Any], rounds: int = MEASURE_ROUNDS) -> tuple[dict[str, float], str]:
    """Each policy's measured step (``measure[name]()`` runs its ``step_seconds``), in rounds over all of them in
    turn, each keeping its fastest: no policy is timed in a burst while another is timed in quiet. Stops after a round
    in which the machine was quiet; returns (seconds per policy, "" or what kept it busy in every round)."""
    from dtypelab.core.disturbance import describe, until_quiet

    best: dict[str, float] = {}
    failed: set[str] = set()

    def one_round() -> None:
        for name, run in measure.items():
            if name in failed:
                continue
            try:
                seconds = run()
            except Exception:  # its check's note says why its steps could not run here; no measured time
                failed.add(name)
                continue
            best[name] = min(best.get(name, seconds), seconds)

    _, busy = until_quiet(one_round, rounds)
    return best, "" if busy is None else f"the machine was busy in every round of --check's steps ({describe(busy)})"


def check(forecaster: Host, plan: Plan, notes: list[str]) -> CheckResult | None:
    """--check, for ``forecaster`` (a ``Forecaster``): the same steps on real tensors here, the ledger's peak over
    CHECK_STEPS steps, and the process peak as bench measures it."""
    if plan.distributed is not None:
        notes.append("--check: a distributed policy is measured by bench --nproc, not here")
        return None
    avail = plan.availability(forecaster.hardware_here())
    if not avail.ok:
        notes.append(f"--check: it cannot run here ({avail.reason})")
        return None
    if room_for(tensor_bytes(forecaster.meta.parameters())) is False:
        notes.append("--check: the model does not fit this machine's memory")
        return None
    device = forecaster.job.check_device
    train = forecaster.run_here(plan, forecaster.job.batch_size, True, CHECK_STEPS, device) if forecaster.trains and \
        "train" in plan.modes else None
    infer = forecaster.run_here(plan, forecaster.job.infer_batch_size, False, 1, device) if "infer" in plan.modes or \
        train is not None else None
    with young_heap():
        process, method = process_peak(forecaster.task, plan, device, forecaster.job.batch_size, train is not None,
                                       forecaster.job.seed)
    return CheckResult(CHECK_STEPS if train is not None else 1,
                       train.peak.total if train is not None else None,
                       infer.peak.total if infer is not None else None, process, method)


def retimed(forecaster: Host, results: list[PolicyForecast]) -> list[PolicyForecast]:
    """Where this machine's kernels were timed policy by policy: all of them again in interleaved rounds (and
    --check's steps likewise), and each policy's time made anew from those, its measured step beside it; else
    ``results`` as they are."""
    if not forecaster.times_here or forecaster.times is None:
        return results
    job = forecaster.job
    busy = forecaster.times.settle()
    plans = {p.name: p for p in job.plans}
    timed = [r for r in results if r.time is not None and r.time.step_s is not None and r.method != "state-only"]
    measured: dict[str, float] = {}
    if job.check:  # this CPU's steps, in interleaved rounds as its kernels were
        measured, steps_busy = interleaved_steps({r.policy: _step_timer(forecaster, plans[r.policy], r)
                                                  for r in timed if r.check is not None})
        busy = busy or steps_busy
    out = []
    for r in results:
        if r in timed:
            again = forecaster.time(plans[r.policy], r.train is not None) or r.time
            r = replace(r, time=replace(again, measured_s=measured.get(r.policy), disturbed=busy))
        out.append(r)
    return out


def _step_timer(forecaster: Host, plan: Plan, result: PolicyForecast) -> Any:
    job, train = forecaster.job, result.train is not None
    batch = job.batch_size if train else job.infer_batch_size
    return lambda: step_seconds(forecaster.task, plan, job.check_device, batch, train, job.seed)
