"""Profile a few steps of a policy with torch.profiler and summarise where the time went.

The steps run after the policy's measurement, on the same warm model, so the profiler's cost never enters
the measured step time; it is reported apart (a profiled step's wall time against the unprofiled median).
Each phase of a step is bracketed by a ``record_function`` and, on CUDA, synchronised at its ends, so the
phases' wall times add up to the step's.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from dtypelab.core.errors import describe_exception
from dtypelab.core.loop import forward, to_device, train_step
from dtypelab.core.policies import Precision
from dtypelab.core.results import ProfileSummary, SourceOp
from dtypelab.core.source import user_source
from dtypelab.core.task import Task
from dtypelab.profiling.summary import Against, dtype_of, input_dtypes, summarise, tally  # noqa: F401 (public here too)


class Marks:
    """The step's phases, timed by wall clock (synchronised on CUDA) and labelled for the profiler."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        with record_function(f"dtypelab.{phase}"):
            yield
            self.sync()
        self.seconds[phase] += time.perf_counter() - start


class _Float64Sources(TorchDispatchMode):
    """Where float64 enters: an op that makes a float64 tensor from non-float64 inputs (or from none), with the
    user's line that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[tuple[str, str], SourceOp] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(o, torch.Tensor) and o.dtype == torch.float64 for o in outs):
            ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if not ins or any(a.is_floating_point() and a.dtype != torch.float64 for a in ins):
                source, code, _ = user_source()
                name = f"aten::{func.__name__.split('.')[0]}"
                if source and (name, source) not in self.sites and len(self.sites) < 8:
                    mixed = "from float32 inputs" if ins else "from Python or NumPy values"
                    self.sites[(name, source)] = SourceOp(name, 0.0, 0.0, f"makes a float64 tensor {mixed}",
                                                          source, code)
        return out


@dataclass
class Profiler:
    """Profiles steps of one model under one precision. ``run(step_fn)`` calls ``step_fn(i, marks)`` for one
    warm-up step and ``steps`` profiled ones."""

    device: torch.device
    precision: Precision
    steps: int
    peaks: dict[str, float]
    timed_step_s: float | None = None
    trace_file: str | None = None
    rated: dict[str, float] = field(default_factory=dict)  # the device's rated peaks (TFLOP/s), for the MFU

    def run(self, mode: str, step_fn: Callable[[int, Callable[[str], Any]], None]) -> ProfileSummary:
        cuda = self.device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(self.device)) if cuda else (lambda: None)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        walls: list[float] = []
        marks = Marks(sync)
        plan = self.precision.plan
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                # the schedule's warm-up step pays the profiler's start-up; it is neither kept nor timed
                schedule = torch.profiler.schedule(wait=0, warmup=1, active=self.steps, repeat=1)
                with torch.profiler.profile(activities=activities, record_shapes=True, schedule=schedule) as prof:
                    for i in range(self.steps + 1):
                        if i == 1:
                            marks.seconds.clear()
                        sync()
                        start = time.perf_counter()
                        step_fn(i, marks)
                        sync()
                        if i >= 1:
                            walls.append(time.perf_counter() - start)
                        prof.step()
            if self.trace_file:
                prof.export_chrome_trace(self.trace_file)
            warned = tuple(dict.fromkeys(f"{w.category.__name__}: {str(w.message).splitlines()[0]}"
                                         for w in caught if not issubclass(w.category, DeprecationWarning)
                                         and "profiler" not in w.filename.replace(os.sep, "/")))  # its own notes
            events = list(prof.events())
            dtypes = None if not events or hasattr(events[0], "input_dtypes") else input_dtypes(prof)
            against = Against(cuda, self.peaks, tf32=any(c.facts.compute_dtype == "tf32" for c in plan.configs),
                              autocast=any(c.facts.autocast_dtype for c in plan.configs),
                              wants_fp64=plan.compute_dtype == "float64", rated=self.rated)
            summary = summarise(events, dtypes=dtypes, mode=mode, steps=self.steps, walls=walls,
                                phases=dict(marks.seconds), against=against, timed_step_s=self.timed_step_s,
                                warned=warned[:5])
            if summary.fp64_ops:  # one more step under a dispatch mode to find where float64 came in
                finder = _Float64Sources()
                with finder:
                    step_fn(self.steps + 1, lambda phase: contextlib.nullcontext())
                summary = replace(summary, fp64_sources=tuple(finder.sites.values()))
            return replace(summary, trace_file=os.path.abspath(self.trace_file) if self.trace_file else "")
        except Exception as exc:  # the measurement stands; the record says why there is no profile
            return ProfileSummary(mode=mode, steps=self.steps, device=self.device.type, step_s=0.0,
                                  error=describe_exception(exc))


def profile_training(task: Task, model: nn.Module, precision: Precision, optimizer: torch.optim.Optimizer,
                     profiler: Profiler, batch_size: int, first_step: int) -> ProfileSummary:
    """Profile training steps continuing from ``first_step`` (the task's batches from there on)."""
    device = profiler.device

    def step(i: int, mark: Callable[[str], Any]) -> None:
        with mark("data"):
            inputs, target = to_device(task.batch(first_step + i + 1, batch_size), device)
        train_step(task, model, precision, optimizer, inputs, target, mark=mark)

    model.train()
    with precision.session():
        return profiler.run("train", step)


def profile_inference(model: nn.Module, precision: Precision, inputs: Any, profiler: Profiler) -> ProfileSummary:
    """Profile forward passes on ``inputs`` (already on the device)."""

    def step(i: int, mark: Callable[[str], Any]) -> None:
        with mark("forward"):
            forward(model, precision, inputs)

    with precision.session(), torch.no_grad():
        return profiler.run("infer", step)
