"""Per-layer range audit: train a few steps with hooks that measure every activation, every gradient
flowing into a module output and every parameter gradient against candidate formats."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.loop import build_trainable, prepare, to_device, train_step
from dtypelab.core.loop import threads as torch_threads
from dtypelab.core.machine.hardware import environment as current_environment
from dtypelab.core.policies import Precision
from dtypelab.core.results import AuditConfig, AuditReport, check_writable
from dtypelab.core.task import Task
from dtypelab.core.updates import UpdateCounter
from dtypelab.numerics.options import AuditOptions
from dtypelab.numerics.rangestats import RangeCounter
from dtypelab.numerics.recording import Recorder, build_report, install_hooks
from dtypelab.numerics.script import AuditDiagnosis
from dtypelab.run import Target
from dtypelab.script import diagnose_script, script_environment, script_record

Progress = Callable[[int, int], None]


def _audit_script(target: Target, opts: AuditOptions, fmts: tuple[str, ...], progress: Progress | None,
                  environment: dict[str, Any] | None) -> AuditReport:
    """A training script's audit: its own loop, in a process of its own, for ``opts.steps`` steps."""
    diagnosis = AuditDiagnosis(opts.steps, opts.every, opts.layers, fmts, opts.updates)
    text, out = diagnose_script(target, opts.policy, diagnosis, args=tuple(opts.script_args), device=opts.device,
                                seed=opts.seed, on_step=progress)
    env = script_environment(environment, opts.device, opts.hardware)
    if text is None:
        raise DtypelabError(f"the audit of {target.spec} gave no record: {out.reason or out.status}")
    report = script_record(AuditReport, text, target.spec, env)
    if opts.json_path:
        report.save(opts.json_path)
    return report


def _count_updates(counter: UpdateCounter | None, active: bool, skipped: bool) -> None:
    """The update counter's reading after a recorded step (a step GradScaler skipped updated nothing)."""
    if counter is not None and active:
        counter.after(skipped=skipped)


@dataclass
class _Watch:
    """What the audit watches in a step: the ranges (``rec``), the parameters' gradients and their lost updates."""

    rec: Recorder
    params: list[tuple[str, torch.nn.Parameter]]
    counter: UpdateCounter | None

    def after_backward(self) -> None:
        for name, p in self.params:
            if p.grad is not None:
                self.rec.record(name, "parameter", "param_grad", p.grad)
        if self.counter is not None:
            self.counter.before()


def _train(task: Task, model: torch.nn.Module, pol: Precision, optimizer: torch.optim.Optimizer,
           opts: AuditOptions, watch: _Watch, batch: tuple[int, torch.device], losses: list[float],
           progress: Progress) -> None:
    """The audited steps: every ``every``-th step records ranges; each step's loss goes to ``losses``."""
    bs, dev = batch
    with pol.session():
        for step in range(opts.steps):
            watch.rec.new_step(step % opts.every == 0, pol.grad_scale())
            inputs, target = to_device(task.batch(step, bs), dev)
            scale = pol.grad_scale()
            loss = train_step(task, model, pol, optimizer, inputs, target,
                              after_backward=watch.after_backward if watch.rec.active else None)
            _count_updates(watch.counter, watch.rec.active, pol.grad_scale() < scale)
            losses.append(float(loss.detach()))
            progress(step + 1, opts.steps)


def audit(task: str | Task, options: AuditOptions | None = None, *, progress: Progress | None = None,
          environment: dict[str, Any] | None = None, **settings: Any) -> AuditReport:
    """Train ``steps`` steps under ``policy`` and measure ranges every ``every`` steps (``AuditOptions``, or its
    fields as keywords); see the guide.

    A policy that cannot run here is an error; one measured pathologically slow here (fp16 on a CPU
    without fp16 arithmetic) is refused unless ``force``, as in ``bench``. ``task`` may be a training script (see
    ``dtypelab.session``): it runs with ``script_args`` for ``steps`` steps of its own loop, then stops."""
    opts = AuditOptions.build(options, **settings)
    fmts = tuple(opts.formats)
    counter = RangeCounter(fmts)  # raises for formats without a subnormal range, before training
    pattern = re.compile(opts.layers) if opts.layers else None
    check_writable(opts.json_path)
    target = Target.of(task)
    if target.is_script:
        return _audit_script(target, opts, fmts, progress, environment)
    spec, task_obj, dev, pol, hardware = prepare(target.given or target.spec, opts.policy, opts.device, opts.hardware,
                                                 opts.force)
    bs = opts.batch_size or task_obj.batch_size
    config = AuditConfig(task=spec, policy=pol.name, steps=opts.steps, every=opts.every, layers=opts.layers or "",
                         formats=fmts, batch_size=bs, seed=opts.seed, device=str(dev), task_name=task_obj.name)
    progress = progress or (lambda done, total: None)
    rec = Recorder(counter)
    losses: list[float] = []
    status, reason, start = "ok", "", time.perf_counter()
    with torch_threads(opts.threads):
        model, optimizer = build_trainable(task_obj, pol, dev, opts.seed)
        handles = install_hooks(model, rec, pattern)
        params = [(n, p) for n, p in model.named_parameters() if not pattern or pattern.search(n)]

        counter = UpdateCounter(params) if opts.updates else None

        try:
            _train(task_obj, model, pol, optimizer, opts, _Watch(rec, params, counter), (bs, dev), losses, progress)
        except KeyboardInterrupt:
            status, reason = "interrupted", f"interrupted after {len(losses)} steps"
        except Exception as exc:
            status, reason = "failed", describe_exception(exc)
        finally:
            for h in handles:
                h.remove()
    environment = environment if environment is not None else current_environment(hardware)
    report = build_report(config, rec, losses, status, reason, environment, time.perf_counter() - start,
                          updates=counter.rows() if counter is not None else ())
    if opts.json_path:
        report.save(opts.json_path)
    if status == "interrupted":
        raise KeyboardInterrupt
    return report
