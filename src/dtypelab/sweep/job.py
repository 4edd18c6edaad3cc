"""One policy's measurement: training or inference on the core loop, timed, with its memory window. A ``Work`` of
``dtypelab.run``: it runs wherever a launcher puts it (this process, a child process)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dtypelab.core.calibration import calibrating, task_feed
from dtypelab.core.disturbance import CpuMeter
from dtypelab.core.errors import Unsupported, describe_exception
from dtypelab.core.loop import (
    DIVERGED_PATIENCE,
    Watch,
    atomic_save,
    build_model,
    build_trainable,
    evaluate,
    fingerprint,
    fit,
    forward,
    make_predict,
    prime,
    threads,
    to_device,
)
from dtypelab.core.measure import MemoryMeter, StepTimer, device_sync, slow_verdict, young_heap
from dtypelab.core.policies import BASELINE, Plan, Precision, get_policy, policy_info
from dtypelab.core.results import PolicyResult
from dtypelab.core.stats import summarize
from dtypelab.core.task import Task, load_task, plain, tensors
from dtypelab.inference import PTE, compare, layer_fidelity, linear_weight_bytes, serialize
from dtypelab.profiling import Profiler, profile_inference, profile_training, trace_path
from dtypelab.sweep.measures import counted_state, emulated_layers, model_bytes

Progress = Callable[[int, int], None]  # (steps done, total)


@dataclass(frozen=True)
class Job:
    """Everything a child needs, picklable: the task travels as its spec and is re-loaded there; the policy
    travels as its plan (a name is resolved here, in the parent)."""

    task_spec: str
    plan: Plan
    mode: str  # "train", "infer", or "reference" (train fp32 and save weights for inference runs)
    steps: int
    batch_size: int
    warmup: int
    seed: int
    device: str
    workdir: str  # shared by all jobs of one sweep: initial weights, reference weights and outputs
    threads: int | None = None
    per_layer: bool = False  # infer: also compare every layer's output with the fp32 model's
    time_box_s: float | None = None  # infer: stop timing after this many timed seconds ...
    min_timed: int = 4  # ... once at least this many passes after warm-up are timed
    # Median step time above which this policy is pathologically slow on this very model (10x fp32's): the run
    # stops after warm-up + SLOW_AFTER steps and is reported skipped as slow. None: run to the end (--force).
    slow_step_s: float | None = None
    baseline_step_s: float | None = None  # fp32's median step (fastest, when it was disturbed), for the reason
    slow_span_s: float = 0.0  # >0: fp32 was disturbed; judge the fastest step over timed steps this long
    profile_steps: int = 0  # --profile: steps profiled after the measurement (never part of its timing)
    peaks: dict[str, float] | None = None  # the hardware probe's GFLOP/s, for the profile's utilisation
    rated: dict[str, float] | None = None  # the device's rated peak TFLOP/s, for the profile's MFU
    trace_dir: str | None = None  # --trace-dir: the profiled steps' raw Chrome trace goes here
    # a Task object the caller passed (inline runs only: the sweep refuses a child process for one), used as it is
    given: Task | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", get_policy(self.plan))

    @property
    def policy(self) -> str:
        return self.plan.name

    @property
    def name(self) -> str:
        return self.plan.name

    def __call__(self, report: Progress) -> PolicyResult:
        return run_job(self, report)

    @property
    def init_path(self) -> str:
        return os.path.join(self.workdir, "init.pt")

    @property
    def reference_weights(self) -> str:
        return os.path.join(self.workdir, "reference.pt")

    @property
    def reference_outputs(self) -> str:
        return os.path.join(self.workdir, "reference_outputs.pt")


def _warmup(job: Job, samples: list[float]) -> int:
    return min(job.warmup, max(0, len(samples) - 1))


def too_slow(job: Job, samples: list[float], cpu: CpuMeter | None = None) -> str:
    """``slow_verdict`` for this job: past 10x fp32's median step (``job.slow_step_s``), the run stops; never while
    ``cpu`` saw other processes take the CPU since the run began (their time, not the policy's pace)."""
    slow = slow_verdict(samples, job.warmup, job.slow_step_s, job.steps, job.baseline_step_s, job.slow_span_s)
    busy = cpu.stop() if slow and cpu is not None else None
    return "" if busy is not None and busy.disturbed else slow


def _profiler(job: Job, device: torch.device, precision: Precision, samples: list[float]) -> Profiler | None:
    if not job.profile_steps:
        return None
    timed = summarize(samples[_warmup(job, samples):])
    return Profiler(device, precision, job.profile_steps, dict(job.peaks or {}), timed.median if timed else None,
                    trace_path(job.trace_dir, job.policy), rated=dict(job.rated or {}))


def _slow_result(job: Job, reason: str, samples: list[float], losses: tuple[float, ...] = ()) -> PolicyResult:
    return PolicyResult(policy=job.policy, status="skipped", reason=reason, skip="slow", batch_size=job.batch_size,
                        warmup=_warmup(job, samples), step_times_s=tuple(samples), losses=losses)


def train(task: Task, job: Job, precision: Precision, progress: Progress) -> PolicyResult:
    device = torch.device(job.device)
    if device.type == "cpu":
        prime(task, job.plan, device, job.batch_size, train=True)
    meter = MemoryMeter(device)
    meter.start()  # before the model exists: weights, optimizer state and activations all count
    model = build_model(task, job.seed, job.init_path)
    init = fingerprint(model)
    model, optimizer = build_trainable(task, precision, device, model=model)
    meter.open_window()  # loading and converting the weights is not the run's peak
    timer, cpu = StepTimer(sync=device_sync(device)), CpuMeter()
    cpu.start()
    run = fit(task, model, precision, optimizer, device, job.steps, job.batch_size, job.seed, timer,
              Watch(progress, lambda samples: too_slow(job, samples, cpu)))
    disturbance = cpu.stop()
    if run.cut:
        return _slow_result(job, run.cut, timer.samples, tuple(run.losses))
    peak = meter.peak_bytes()
    with precision.session():
        metrics = evaluate(task, model, precision, device)
    if job.mode == "reference":
        atomic_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, job.reference_weights)
    # after the metric and the reference weights: the counting forward pass may move BatchNorm's statistics, and
    # the lost-update probe trains a few steps more
    memory, updates, counted = counted_state(task, model, precision, optimizer, device, job.batch_size, job.steps)
    emulated = emulated_layers(task, model, precision, device, job.batch_size, job.steps)
    profiler = _profiler(job, device, precision, timer.samples)  # after the metric: it trains a few steps more
    profile = profile_training(task, model, precision, optimizer, profiler, job.batch_size, job.steps) \
        if profiler and job.mode != "reference" else None
    reason = f"loss non-finite from step {run.first_nonfinite}" if run.diverged else ""
    if run.stopped:
        reason += f"; stopped after {DIVERGED_PATIENCE} non-finite steps"
    return PolicyResult(
        policy=job.policy, status="diverged" if run.diverged else "ok", reason=reason, batch_size=job.batch_size,
        warmup=_warmup(job, timer.samples), step_times_s=tuple(timer.samples), losses=tuple(run.losses),
        first_nonfinite_step=run.first_nonfinite, metrics=metrics, peak_memory_bytes=peak,
        load_peak_memory_bytes=meter.load_peak, memory_method=meter.method, model_bytes=model_bytes(model),
        init_fingerprint=init, scaler=precision.stats(), conversion=precision.conversion(),
        disturbance=disturbance.to_dict() if disturbance else {}, profile=profile, memory=memory,
        updates=tuple(updates), notes=counted, emulated_layers=tuple(emulated),
    )


class _Slow(Exception):
    """A timed pass found the run pathologically slow (``too_slow``): it stops there."""


class _InferTiming:
    """An inference run's timed passes. The evaluation's forward passes with the timing batch's shapes count as
    steps (the same work on other samples: no pass is run twice), then passes on the timing batch fill up to
    ``steps`` or the time box. The memory window holds timed passes only: a pass of another shape closes it,
    and the next timed one opens it anew; the peak is read after each timed pass."""

    def __init__(self, job: Job, timer: StepTimer, meter: MemoryMeter, progress: Progress, batch: Any) -> None:
        self.job, self.timer, self.meter, self.progress = job, timer, meter, progress
        self.signature = _signature(batch)
        self.peak, self.open = 0, True

    def done(self) -> bool:
        n, job = len(self.timer.samples), self.job
        return n >= job.steps or (job.time_box_s is not None and n >= job.warmup + job.min_timed
                                  and sum(self.timer.samples) >= job.time_box_s)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not self.open:
            self.meter.reset()
            self.open = True
        self.timer.start()
        yield
        self.timer.stop()
        self.peak = max(self.peak, self.meter.peak_bytes())
        self.progress(min(len(self.timer.samples), self.job.steps), self.job.steps)
        slow = too_slow(self.job, self.timer.samples)
        if slow:
            raise _Slow(slow)

    def around(self, batch: Any) -> contextlib.AbstractContextManager[Any]:
        if self.done() or _signature(batch) != self.signature:
            self.open = False
            return contextlib.nullcontext()
        return self.step()


def _signature(batch: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors(batch))


def infer(task: Task, job: Job, precision: Precision, progress: Progress) -> PolicyResult:
    device = torch.device(job.device)
    weights = None if task.pretrained else job.reference_weights
    if device.type == "cpu" and not job.plan.compiles:  # priming a compiled policy would compile it twice
        prime(task, job.plan, device, job.batch_size, train=False)
    meter = MemoryMeter(device)
    meter.start()
    model = build_model(task, job.seed, weights)
    init = fingerprint(model)
    inputs = to_device(task.inference_inputs(job.batch_size), device)
    with calibrating(task_feed(inputs)):  # what GPTQ and AWQ read: the task's own inputs
        model = precision.convert_module(model.to(device)).eval()
    timer = StepTimer(sync=device_sync(device))
    timing = _InferTiming(job, timer, meter, progress, inputs)
    first_call_s = None
    with precision.session(), torch.no_grad():
        if job.plan.compiles:  # compilation is part of loading: timed apart, outside the memory window
            timer.start()
            forward(model, precision, inputs)
            first_call_s = timer.stop()
            timer.samples.clear()
        meter.open_window()
        cpu = CpuMeter()
        cpu.start()
        outputs: list[Any] = []  # what the task's evaluation ran the model on: the fidelity set
        try:
            metrics = evaluate(task, model, precision, device, record=outputs, around=timing.around)
            while not timing.done():
                with timing.step():
                    forward(model, precision, inputs)
        except _Slow as slow:
            return _slow_result(job, str(slow), timer.samples)
        progress(job.steps, job.steps)
        disturbance = cpu.stop()
        peak = timing.peak
        if not outputs:
            outputs.append(plain(make_predict(model, precision, device)(inputs)))
        layers = ()
        if job.per_layer:
            reference = build_model(task, job.seed, weights).to(device).eval()
            layers = tuple(layer_fidelity(reference, model, inputs, precision))
    profiler = _profiler(job, device, precision, timer.samples)
    profile = profile_inference(model, precision, inputs, profiler) if profiler else None
    if job.policy == BASELINE:
        atomic_save(outputs, job.reference_outputs)
    fidelity = compare(torch.load(job.reference_outputs, weights_only=True), outputs) \
        if os.path.exists(job.reference_outputs) else {}
    blob, fmt = serialize(model)
    return PolicyResult(
        policy=job.policy, status="ok", batch_size=job.batch_size, warmup=_warmup(job, timer.samples),
        step_times_s=tuple(timer.samples), metrics=metrics, fidelity=fidelity, peak_memory_bytes=peak,
        load_peak_memory_bytes=meter.load_peak, memory_method=meter.method, model_bytes=len(blob),
        init_fingerprint=init, size={"format": fmt, "file_bytes": len(blob),
                                     # a .pte holds its weights inside the program: no linear layer to count
                                     "linear_weight_bytes": None if fmt == PTE else linear_weight_bytes(model)},
        first_call_s=first_call_s if first_call_s is not None else (timer.samples[0] if timer.samples else None),
        per_layer=layers, disturbance=disturbance.to_dict() if disturbance else {}, profile=profile,
        conversion=precision.conversion(),
    )


def run_job(job: Job, progress: Progress | None = None, task: Task | None = None) -> PolicyResult:
    """Measure one policy. Exceptions become a failed result naming the user's line, never a crash."""
    progress = progress or (lambda done, total: None)
    start = time.perf_counter()
    try:
        task = task or job.given or load_task(job.task_spec)
        precision = Precision(job.plan, job.device)
        with threads(job.threads), young_heap():
            result = (infer if job.mode == "infer" else train)(task, job, precision, progress)
    except Unsupported as exc:  # the policy means nothing for this task (no low-bit variant of its optimizer)
        result = PolicyResult(job.policy, "skipped", str(exc), skip="inapplicable")
    except torch.cuda.OutOfMemoryError as exc:
        result = PolicyResult(job.policy, "oom", f"CUDA out of memory: {str(exc).splitlines()[0]}")
    except MemoryError:
        result = PolicyResult(job.policy, "oom", "out of host memory (MemoryError)")
    except Exception as exc:
        result = PolicyResult(job.policy, "failed", describe_exception(exc))
    return replace(result, info=policy_info(job.plan), wall_s=time.perf_counter() - start)
