"""``profile()``: one policy on one task, in this process — a short warm run, then profiled steps."""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass, fields
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.loop import build_trainable, fit, forward, prepare, threads, to_device
from dtypelab.core.machine.hardware import HardwareInfo, probe
from dtypelab.core.measure import StepTimer, device_sync
from dtypelab.core.policies import Plan, Precision, get_policy
from dtypelab.core.results import ProfileSummary
from dtypelab.core.task import Task, load_task
from dtypelab.profiling.collect import Profiler, profile_inference, profile_training
from dtypelab.profiling.options import PROFILE_STEPS


def trace_path(trace_dir: str | None, policy: str) -> str | None:
    """Where a policy's Chrome trace goes: DIR/<policy>.json (the name made file-safe)."""
    if not trace_dir:
        return None
    os.makedirs(trace_dir, exist_ok=True)
    return os.path.join(trace_dir, re.sub(r"[^A-Za-z0-9_.+-]", "_", policy) + ".trace.json")


@dataclass(frozen=True)
class ProfileSettings:
    """How a profile runs (``profile()``'s keywords)."""

    steps: int = PROFILE_STEPS
    warmup: int = 10
    batch_size: int | None = None
    device: str | None = None
    seed: int = 0
    threads_n: int | None = None
    trace_dir: str | None = None


def profile(task: str | Task, policy: str | Plan = "fp32", *, mode: str = "train", hardware: HardwareInfo | None = None,
            **settings: Any) -> ProfileSummary:
    """Where one policy's step time goes on this machine: ``warmup`` unprofiled steps (their median is the
    step time the profiler's cost is reported against), then ``steps`` profiled ones. ``mode="infer"``
    profiles forward passes of the task's model (its initial or pretrained weights). ``trace_dir`` also
    writes the raw Chrome trace (TensorBoard, Perfetto). ``settings``: ``ProfileSettings``' fields."""
    unknown = sorted(set(settings) - {f.name for f in fields(ProfileSettings)})
    if unknown:
        raise DtypelabError(f"profile: unknown setting {', '.join(unknown)}; use "
                            f"{', '.join(f.name for f in fields(ProfileSettings))}")
    return _profile(task, get_policy(policy), mode, hardware, ProfileSettings(**settings))


def _profile(task: str | Task, plan: Plan, mode: str, hardware: HardwareInfo | None,
             how: ProfileSettings) -> ProfileSummary:
    steps, warmup, batch_size, device, seed = how.steps, how.warmup, how.batch_size, how.device, how.seed
    threads_n, trace_dir = how.threads_n, how.trace_dir
    if mode not in ("train", "infer"):
        raise DtypelabError(f"unknown mode {mode!r}: use train or infer")
    if steps < 1 or warmup < 1:
        raise DtypelabError("--steps and --warmup must be at least 1 for a profile")
    if mode == "train":
        _, task_obj, dev, precision, hardware = prepare(task, plan, device, hardware, force=True)
    else:
        task_obj = load_task(task) if isinstance(task, str) else task
        hardware = hardware or probe(device, budget_s=0.05)
        dev = torch.device(hardware.device)
        wrong = plan.mode_error("infer")
        if wrong:
            raise DtypelabError(wrong)
        precision = Precision(plan, dev)
    bs = batch_size or task_obj.batch_size
    timer = StepTimer(sync=device_sync(dev))
    with threads(threads_n):
        if mode == "train":
            model, optimizer = build_trainable(task_obj, precision, dev, seed)
            fit(task_obj, model, precision, optimizer, dev, warmup, bs, seed, timer)
        else:
            torch.manual_seed(seed)
            model = precision.convert_module(task_obj.make_model().to(dev)).eval()
            inputs = to_device(task_obj.inference_inputs(bs), dev)
            with precision.session(), torch.no_grad():
                for _ in range(warmup):
                    timer.start()
                    forward(model, precision, inputs)
                    timer.stop()
        profiler = Profiler(dev, precision, steps, hardware.gflops, statistics.median(timer.samples),
                            trace_path(trace_dir, plan.name), rated=hardware.rated_tflops)
        if mode == "train":
            return profile_training(task_obj, model, precision, optimizer, profiler, bs, warmup)
        return profile_inference(model, precision, inputs, profiler)
