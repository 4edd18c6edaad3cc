"""``autopilot``: train a task in a low-precision start configuration and move a layer out of it, while training goes
on, when its ranges say it is about to overflow or has underflowed; recover from a non-finite step by rolling back to
an in-memory checkpoint and moving the layer the trace names. The result is a record (every move with its evidence,
every rollback) and a plan file for the next run."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.hardware import environment as current_environment
from dtypelab.core.loop import build_trainable, evaluate, prepare, to_device, train_step
from dtypelab.core.loop import threads as torch_threads
from dtypelab.core.policies import Autocast, Cast, Config, Plan, Precision
from dtypelab.core.results import AutopilotConfig, AutopilotReport, Finding, Move, Rollback, check_writable, save_text
from dtypelab.core.source import Sites
from dtypelab.core.task import Task
from dtypelab.piloting.controller import Controller
from dtypelab.piloting.monitor import Monitor
from dtypelab.piloting.options import AutopilotOptions
from dtypelab.run import Target
from dtypelab.tracing import Guard, NonFiniteError

Progress = Callable[[int, int], None]
WIDE = ("float32", "float64")
FIRST_EVERY, MAX_EVERY = 10, 100  # steps between readings: at first, and at most when they are costly
READING_BUDGET = 0.02  # the automatic interval keeps the readings' extra time near this share of training time
NO_SCALER = "; the start has no GradScaler, which would scale the gradients into range for every layer at once"
TARGETS = {"fp32": Cast("float32"), "bf16": Cast("bfloat16"), "amp-bf16": Autocast("bfloat16")}


def _target(promote_to: str, precision: Precision, device: torch.device) -> Config:
    if promote_to != "auto":
        return TARGETS[promote_to]
    default = precision.plan.default
    fp16 = isinstance(default, (Cast, Autocast)) and default.dtype == "float16"
    if fp16 and device.type == "cuda" and torch.cuda.is_bf16_supported():  # bf16's range at fp16's speed class
        return Autocast("bfloat16") if isinstance(default, Autocast) else Cast("bfloat16")
    return Cast("float32")


def _label(precision: Precision, name: str, model: torch.nn.Module) -> str:
    """The config a layer runs in now (its rule, else the plan's default)."""
    return precision.plan.assign(model).get(name, precision.plan.default).label


def _origin_text(f: Finding) -> str:
    o = f.origin
    if o is None:
        return "no origin found"
    return f"{o.op} in {o.module or 'no module'} ({o.phase}): {o.diagnosis}"


def autopilot(task: str | Task, options: AutopilotOptions | None = None, *, progress: Progress | None = None,
              on_move: Callable[[Move], None] | None = None, environment: dict[str, Any] | None = None,
              **settings: Any) -> AutopilotReport:
    """Train ``task`` starting in ``start`` and move layers to ``promote_to`` when their numbers say so (see
    ``AutopilotOptions`` and the guide). Never restarts: a non-finite step rolls back to the last in-memory checkpoint
    (model, optimizer, GradScaler, RNG) and goes on with the layer the trace names moved; after ``max_rollbacks``,
    or when the origin is no layer a move can help, it stops with the trace's diagnosis. Ctrl-C keeps the record."""
    opts = AutopilotOptions.build(options, **settings)
    check_writable(opts.json_path)
    check_writable(opts.plan_out)
    if opts.promote_to != "auto" and opts.promote_to not in TARGETS:
        raise DtypelabError(f"--promote-to must be one of auto, {', '.join(TARGETS)}; got {opts.promote_to!r}")
    target = Target.of(task)
    if target.is_script:
        raise DtypelabError("autopilot runs a task (a built-in name or file.py:make_task); a training script's own "
                            "loop is not supported yet: run `dtypelab trace` on it, or wrap its model in a Task")
    spec, task_obj, dev, precision, hardware = prepare(target.given or target.spec, opts.start, opts.device,
                                                        opts.hardware, opts.force)
    to = _target(opts.promote_to, precision, dev)
    n, bs = opts.steps or task_obj.steps, opts.batch_size or task_obj.batch_size
    every = opts.sample_every or FIRST_EVERY
    config = AutopilotConfig(task=spec, start=precision.plan.name, steps=n, batch_size=bs, seed=opts.seed,
                             device=str(dev), sample_every=opts.sample_every or 0, promote_to=to.label,
                             headroom=opts.headroom, horizon=opts.horizon or 0, max_rollbacks=opts.max_rollbacks,
                             task_name=task_obj.name)
    progress = progress or (lambda done, total: None)
    status, reason, finding, metrics = "ok", "", None, {}
    moves: list[Move] = []
    rollbacks: list[Rollback] = []
    plain_s: list[float] = []
    sampled_s: list[float] = []
    lost = readings = 0
    start = time.perf_counter()
    with torch_threads(opts.threads):
        model, optimizer = build_trainable(task_obj, precision, dev, opts.seed)
        scaler = precision.grad_scaler()
        guard = Guard(model, optimizer, scaler=scaler, checkpoint_every=opts.checkpoint_every,
                      check_weights=scaler is None,
                      sites=Sites.of(task_obj.make_model, task_obj.loss_fn or task_obj.compute_loss, task_obj.origin))
        monitor, controller = Monitor(model), Controller(opts.headroom, opts.horizon or 2 * every)

        def one_step(inputs: Any, target: Any, after_backward: Callable[[], None] | None = None) -> torch.Tensor:
            return train_step(task_obj, model, precision, optimizer, inputs, target, after_backward=after_backward)

        def move(step: int, name: str, cause: str, evidence: str, amax: float | None = None,
                 limit: float | None = None) -> Move:
            was = _label(precision, name, model)
            precision.promote(model, name, to, optimizer)
            m = Move(step, name, was, to.label, cause, evidence, amax, limit)
            moves.append(m)
            if on_move is not None:
                on_move(m)
            return m

        torch.manual_seed(opts.seed)  # same dropout masks as bench
        step, loop_start, next_sample = 0, time.perf_counter(), 0
        try:
            with precision.session(), guard:
                while step < n:
                    batch = to_device(task_obj.batch(step, bs), dev)
                    sample = step >= next_sample
                    t0 = time.perf_counter()
                    try:
                        if sample:
                            with monitor.reading():
                                guard.step(one_step, *batch, after_backward=monitor.after_backward)
                        else:
                            guard.step(one_step, *batch)
                    except NonFiniteError as exc:
                        f = exc.finding
                        back = guard.rollback()
                        lost += step + 1 - back
                        layer = _movable(f, precision, model, to)
                        rollbacks.append(Rollback(step, back, f.trigger, _origin_text(f), layer))
                        if not layer or len(rollbacks) > opts.max_rollbacks:
                            status, finding = "stopped", f
                            reason = (f"step {step}: {f.trigger}; " + (
                                f"{len(rollbacks)} rollbacks did not fix it" if layer else
                                "the origin is in no layer that a wider format would fix") + f": {_origin_text(f)}")
                            break
                        move(step, layer, "non-finite", f"step {step}: {f.trigger}: {_origin_text(f)}; rolled back "
                                                        f"to step {back}")
                        guard.checkpoint()  # replays from here run in the configuration now in force
                        step = back
                        progress(step, n)
                        continue
                    if step:  # the first step is everyone's warm-up: it would be charged to the readings
                        (sampled_s if sample else plain_s).append(time.perf_counter() - t0)
                    if sample:
                        readings += 1
                        if not opts.sample_every and len(plain_s) >= 3 and sampled_s:
                            every = _interval(sampled_s, plain_s)
                            controller.horizon = opts.horizon or 2 * every
                        next_sample = step + every
                        moved = False
                        for name, w in controller.decide(step, monitor.take()).items():
                            if _label(precision, name, model) != to.label:
                                hint = NO_SCALER if w.cause == "underflow" and guard.scaler is None else ""
                                move(step, name, w.cause, w.evidence + hint, w.amax, w.limit)
                                moved = True
                        if moved:  # a rollback must restore weights of the dtypes they have now
                            guard.checkpoint()
                    step += 1
                    progress(step, n)
            train_s = time.perf_counter() - loop_start
            if status == "ok":
                metrics = evaluate(task_obj, model, precision, dev)
        except KeyboardInterrupt:
            status, reason = "interrupted", f"interrupted after {step} steps"
            train_s = time.perf_counter() - loop_start
        except DtypelabError:
            raise
        except Exception as exc:
            status, reason = "failed", describe_exception(exc)
            train_s = time.perf_counter() - loop_start
    median = statistics.median(plain_s) if plain_s else 0.0
    final = _final(precision.plan, config.start, moves)
    report = AutopilotReport(
        config=config, environment=environment if environment is not None else current_environment(hardware),
        status=status, reason=reason, moves=tuple(moves), rollbacks=tuple(rollbacks),
        final_plan=final.to_dict(), losses=tuple(guard.losses), metrics=metrics,
        steps_rolled_back=lost,
        steps_skipped=guard.log.skipped if guard.log else 0,
        samples=readings, sample_s=max(0.0, sum(sampled_s) - median * len(sampled_s)),
        sample_every=every, checkpoint_every=guard.every, checkpoint_s=guard.checkpoint_s, step_s=median,
        finding=finding,
        scaler=guard.log.stats() if guard.log else {}, train_s=train_s, wall_s=time.perf_counter() - start,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if opts.json_path:
        report.save(opts.json_path)
    if opts.plan_out:
        save_text(opts.plan_out, final.to_json() + "\n")
    if status == "interrupted":
        raise KeyboardInterrupt
    return report


def _interval(sampled_s: list[float], plain_s: list[float]) -> int:
    """Steps between readings so that they cost about READING_BUDGET of the time (as the checkpoints do)."""
    step = statistics.median(plain_s[-50:])
    extra = max(0.0, statistics.median(sampled_s[-5:]) - step)
    return max(FIRST_EVERY, min(MAX_EVERY, math.ceil(extra / (READING_BUDGET * step)) if step > 0 else FIRST_EVERY))


def _final(plan: Plan, start: str, moves: list[Move]) -> Plan:
    said = "; ".join(f"{m.layer} at step {m.step} ({m.cause})" for m in moves)
    return dataclasses.replace(plan, summary=f"autopilot from {start}: " + (f"moved {said}" if moves else
                                                                            "nothing moved"))


def _movable(f: Finding, precision: Precision, model: torch.nn.Module, to: Config) -> str:
    """The layer a non-finite step's origin lies in, when moving it could help: a module (or its nearest enclosing
    one) that does not yet run in the target config."""
    if f.origin is None or not f.origin.module:
        return ""
    if f.origin.outputs and all(t.dtype.removeprefix("torch.") in WIDE for t in f.origin.outputs):
        return ""  # the op already ran in a wide format: a log of zero, not a range a move would fix
    names = dict(model.named_modules())
    name = f.origin.module
    while name and name not in names:
        name = name.rpartition(".")[0]
    if not name or _label(precision, name, model) == to.label:
        return ""
    return name


__all__ = ["AutopilotOptions", "autopilot"]
