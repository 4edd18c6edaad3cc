"""``trace``: train a task under a policy with the NaN/Inf guard armed and report the first non-finite
value's origin, plus GradScaler's history under amp-fp16."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.hardware import HardwareInfo, probe
from dtypelab.core.hardware import environment as current_environment
from dtypelab.core.loop import build_trainable, prepare, to_device, train_step
from dtypelab.core.loop import threads as torch_threads
from dtypelab.core.results import Finding, TraceConfig, TraceReport, check_writable
from dtypelab.core.source import Sites
from dtypelab.core.task import Task, is_script
from dtypelab.tracing.guard import Guard, NonFiniteError

Progress = Callable[[int, int], None]


def trace(task: str | Task, *, policy: str = "fp32", steps: int | None = None, batch_size: int | None = None,
          seed: int = 0, device: str | None = None, threads: int | None = None, checkpoint_every: int | None = None,
          stop_on_skip: bool = False, force: bool = False, json_path: str | None = None,
          progress: Progress | None = None, environment: dict[str, Any] | None = None,
          hardware: HardwareInfo | None = None, script_args: Sequence[str] = ()) -> TraceReport:
    """Train ``steps`` steps (default: the task's) and stop at the first NaN/Inf in the loss, gradients or
    weights, naming the op that created it (see README). Under amp-fp16, steps GradScaler skips are
    logged, not errors, unless ``stop_on_skip`` or the scale collapses below 1. ``task`` may be a training script
    (see ``dtypelab.session``): it runs once with ``script_args``, every step traced, until its first NaN/Inf."""
    from dtypelab.script.runner import diagnose_script, script_record

    check_writable(json_path)
    if isinstance(task, str) and is_script(task):
        text, result = diagnose_script("trace", task, policy, args=script_args, device=device, seed=seed,
                                       on_step=progress)
        env = environment if environment is not None else current_environment(hardware or probe(device, 0.02))
        if text is None:
            report = TraceReport(TraceConfig(task=task, policy=str(policy), steps=0, batch_size=0, seed=seed,
                                             device=str(device or ""), checkpoint_every=0, stop_on_skip=False),
                                 env, status="failed", reason=result.reason, wall_s=result.wall_s)
        else:
            report = script_record(TraceReport, text, task, env)
        if json_path:
            report.save(json_path)
        return report
    if steps is not None and steps < 1:
        raise DtypelabError("--steps must be at least 1")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise DtypelabError("--checkpoint-every must be at least 1 (or omitted: chosen from its measured cost)")
    spec, task_obj, dev, pol, hardware = prepare(task, policy, device, hardware, force)
    n, bs = steps or task_obj.steps, batch_size or task_obj.batch_size
    config = TraceConfig(task=spec, policy=pol.name, steps=n, batch_size=bs, seed=seed, device=str(dev),
                         checkpoint_every=checkpoint_every or 0, stop_on_skip=stop_on_skip, task_name=task_obj.name)
    progress = progress or (lambda done, total: None)
    status, reason, finding = "clean", "", None
    start = time.perf_counter()
    with torch_threads(threads):
        model, optimizer = build_trainable(task_obj, pol, dev, seed)
        guard = Guard(model, optimizer, scaler=pol.grad_scaler(), checkpoint_every=checkpoint_every,
                      stop_on_skip=stop_on_skip,
                      sites=Sites.of(task_obj.make_model, task_obj.loss_fn or task_obj.compute_loss, task_obj.origin))

        def one_step(inputs: Any, target: Any) -> torch.Tensor:
            return train_step(task_obj, model, pol, optimizer, inputs, target)

        torch.manual_seed(seed)  # same dropout masks as bench
        try:
            with pol.session(), guard:
                for step in range(n):
                    batch = to_device(task_obj.batch(step, bs), dev)
                    guard.step(one_step, *batch)
                    progress(step + 1, n)
        except NonFiniteError as exc:
            status, finding = "found", exc.finding
        except KeyboardInterrupt:
            status, reason = "interrupted", f"interrupted after {guard.steps} steps"
        except Exception as exc:
            status, reason = "failed", describe_exception(exc)
    environment = environment if environment is not None else current_environment(hardware)
    report = TraceReport(
        config=config, environment=environment, status=status, reason=reason, finding=finding,
        losses=tuple(guard.losses), scaler=guard.log.stats() if guard.log else {},
        checkpoint_every=guard.every, checkpoint_s=guard.checkpoint_s, wall_s=time.perf_counter() - start,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if json_path:
        report.save(json_path)
    if status == "interrupted":
        raise KeyboardInterrupt
    return report


__all__ = ["Finding", "Guard", "NonFiniteError", "trace"]
