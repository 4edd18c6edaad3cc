"""``trace``: train a task under a policy with the NaN/Inf guard armed and report the first non-finite
value's origin, plus GradScaler's history under amp-fp16."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from dtypelab.core.errors import describe_exception
from dtypelab.core.loop import build_trainable, prepare, to_device, train_step
from dtypelab.core.loop import threads as torch_threads
from dtypelab.core.machine.hardware import environment as current_environment
from dtypelab.core.results import Finding, TraceConfig, TraceReport, check_writable
from dtypelab.core.source import Sites
from dtypelab.core.task import Task
from dtypelab.run import Target
from dtypelab.script import diagnose_script, script_environment, script_record
from dtypelab.tracing.guard import Guard, NonFiniteError
from dtypelab.tracing.options import TraceOptions
from dtypelab.tracing.script import TraceDiagnosis

Progress = Callable[[int, int], None]


def trace(task: str | Task, options: TraceOptions | None = None, *, progress: Progress | None = None,
          environment: dict[str, Any] | None = None, **settings: Any) -> TraceReport:
    """Train ``steps`` steps (default: the task's) and stop at the first NaN/Inf in the loss, gradients or weights,
    naming the op that created it (``TraceOptions``, or its fields as keywords; see the guide). Under amp-fp16,
    steps GradScaler skips are logged, not errors, unless ``stop_on_skip`` or the scale collapses below 1. ``task``
    may be a training script (see ``dtypelab.session``): it runs with ``script_args`` untraced until its first NaN/Inf,
    then once more from the same seed with the tracer armed from that step (``every_step``: once, every step
    traced)."""
    opts = TraceOptions.build(options, **settings)
    check_writable(opts.json_path)
    target = Target.of(task)
    if target.is_script:
        report = _trace_script(target, opts, progress, environment)
        if opts.json_path:
            report.save(opts.json_path)
        return report
    spec, task_obj, dev, pol, hardware = prepare(target.given or target.spec, opts.policy, opts.device, opts.hardware,
                                                 opts.force)
    steps, batch_size, seed, checkpoint_every = opts.steps, opts.batch_size, opts.seed, opts.checkpoint_every
    stop_on_skip, threads, json_path = opts.stop_on_skip, opts.threads, opts.json_path
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


def _trace_script(target: Target, opts: TraceOptions, progress: Progress | None,
                  environment: dict[str, Any] | None) -> TraceReport:
    """A script: untraced until a step goes non-finite, then again with the tracer armed from that step (see
    ``tracing.script``); ``every_step``: one run, every step traced."""
    start = time.perf_counter()

    def run(arm_at: int | None) -> tuple[str | None, Any]:
        return diagnose_script(target, opts.policy, TraceDiagnosis(arm_at), args=tuple(opts.script_args),
                               device=opts.device, seed=opts.seed, on_step=progress)

    text, out = run(0 if opts.every_step else None)
    first = json.loads(text) if text is not None else None
    if first is not None and "bad_step" in first:  # untraced, it went non-finite there: trace that step
        text, out = run(first["bad_step"])
        again = json.loads(text) if text is not None else None
        if again is not None and again.get("status") != "found":  # clean, or non-finite elsewhere, untraced
            seen = f"step {again['bad_step']}" if "bad_step" in again else "no step"
            text, out = None, replace(out, status="failed", reason=(
                f"the script went non-finite at step {first['bad_step']} ({first['trigger']}), but when run again "
                f"from the same seed with the op tracer armed from that step, {seen} did: it does not repeat itself "
                "(unseeded data order, non-deterministic kernels?); --every-step traces every step in one run"))
    env = script_environment(environment, opts.device, opts.hardware)
    if text is None:
        return TraceReport(TraceConfig(task=target.spec, policy=str(opts.policy), steps=0, batch_size=0,
                                       seed=opts.seed, device=str(opts.device or ""), checkpoint_every=0,
                                       stop_on_skip=False),
                           env, status="failed", reason=out.reason or out.status, wall_s=time.perf_counter() - start)
    return replace(script_record(TraceReport, text, target.spec, env), wall_s=time.perf_counter() - start)


__all__ = ["Finding", "Guard", "NonFiniteError", "TraceOptions", "trace"]
