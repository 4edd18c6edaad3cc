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
from dtypelab.core.hardware import hardware_for, resolve_device
from dtypelab.core.loop import build_trainable, evaluate, prepare, to_device, train_step
from dtypelab.core.loop import threads as torch_threads
from dtypelab.core.policies import get_policy
from dtypelab.core.results import AutopilotConfig, AutopilotReport, Move, Rollback, check_writable
from dtypelab.core.source import Sites
from dtypelab.core.task import Task
from dtypelab.piloting.controller import Controller, rules_of
from dtypelab.piloting.handle import settings_of
from dtypelab.piloting.monitor import Monitor
from dtypelab.piloting.moves import (
    FIRST_EVERY,
    final_plan,
    interval,
    label,
    movable,
    origin_text,
    target_config,
    to_move,
    write_outputs,
)
from dtypelab.piloting.options import AutopilotOptions
from dtypelab.piloting.script import PilotDiagnosis
from dtypelab.run import Target
from dtypelab.script import diagnose_script, script_record
from dtypelab.tracing import Guard, NonFiniteError

Progress = Callable[[int, int], None]


def _script(target: Target, opts: AutopilotOptions, progress: Progress | None,
            on_move: Callable[[Move], None] | None, environment: dict[str, Any] | None) -> AutopilotReport:
    """The autopilot on a training script's own loop (``piloting.script``): one run, moves reported as they happen."""
    start = get_policy(opts.start)
    wrong = start.mode_error("train")
    if wrong:
        raise DtypelabError(wrong)
    dev = resolve_device(opts.device)
    hardware = hardware_for(dev, opts.hardware, budget_s=0.02)
    start.require(hardware, opts.force)
    moves: list[Move] = []
    rollbacks: list[Rollback] = []

    def heard(msg: tuple[Any, ...]) -> None:
        if msg[0] == "move":
            moves.append(msg[1])
            if on_move is not None:
                on_move(msg[1])
        elif msg[0] == "rollback":
            rollbacks.append(msg[1])

    began = time.perf_counter()
    env = environment if environment is not None else current_environment(hardware)
    config = AutopilotConfig(task=target.spec, start=start.name, steps=0, batch_size=0, seed=opts.seed,
                             device=str(dev), sample_every=opts.sample_every or 0, promote_to=opts.promote_to,
                             headroom=opts.headroom, horizon=opts.horizon or 0, max_rollbacks=opts.max_rollbacks,
                             task_name=target.path, trend_from=opts.trend_from, trend_keep=opts.trend_keep)
    try:
        text, out = diagnose_script(target, start, PilotDiagnosis(settings_of(opts, start)),
                                    args=tuple(opts.script_args), device=opts.device, seed=opts.seed,
                                    timeout_s=math.inf, on_step=progress, on_message=heard)
    except KeyboardInterrupt:  # the script's process is gone: the moves it reported are the timeline
        report = AutopilotReport(config, env, status="interrupted", reason="interrupted; the moves and rollbacks "
                                 "reported until then are kept", moves=tuple(moves), rollbacks=tuple(rollbacks),
                                 live=True, wall_s=time.perf_counter() - began, created=time.strftime(
                                     "%Y-%m-%dT%H:%M:%S"))
        if opts.json_path:
            report.save(opts.json_path)
        raise
    if text is None:
        skipped = out.value.get("reason") if isinstance(out.value, dict) and out.value.get("kind") == "skip" else ""
        report = AutopilotReport(config, env, status="failed", reason=skipped or out.reason or out.status,
                                 moves=tuple(moves),
                                 rollbacks=tuple(rollbacks), live=True, wall_s=out.wall_s,
                                 created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    else:
        report = dataclasses.replace(script_record(AutopilotReport, text, target.spec, env), wall_s=out.wall_s)
    write_outputs(report, opts.json_path, opts.plan_out)
    return report


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
    target = Target.of(task)
    if target.is_script:
        return _script(target, opts, progress, on_move, environment)
    if opts.script_args:
        raise DtypelabError(f"script_args: arguments after -- are for a training script; {target.spec} is a task")
    spec, task_obj, dev, precision, hardware = prepare(target.given or target.spec, opts.start, opts.device,
                                                        opts.hardware, opts.force)
    to = target_config(opts.promote_to, precision, dev)
    n, bs = opts.steps or task_obj.steps, opts.batch_size or task_obj.batch_size
    every = opts.sample_every or FIRST_EVERY
    config = AutopilotConfig(task=spec, start=precision.plan.name, steps=n, batch_size=bs, seed=opts.seed,
                             device=str(dev), sample_every=opts.sample_every or 0, promote_to=to.label,
                             headroom=opts.headroom, horizon=opts.horizon or 0, max_rollbacks=opts.max_rollbacks,
                             task_name=task_obj.name, trend_from=opts.trend_from, trend_keep=opts.trend_keep)
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
        monitor, controller = Monitor(model), Controller(rules_of(opts.model_dump(), every))

        def one_step(inputs: Any, target: Any, after_backward: Callable[[], None] | None = None) -> torch.Tensor:
            return train_step(task_obj, model, precision, optimizer, inputs, target, after_backward=after_backward)

        def move(step: int, name: str, cause: str, evidence: str, amax: float | None = None,
                 limit: float | None = None) -> Move:
            was = label(precision, name, model)
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
                        layer = movable(f, precision, model, to)
                        rollbacks.append(Rollback(step, back, f.trigger, origin_text(f), layer))
                        if not layer or len(rollbacks) > opts.max_rollbacks:
                            status, finding = "stopped", f
                            reason = (f"step {step}: {f.trigger}; " + (
                                f"{len(rollbacks)} rollbacks did not fix it" if layer else
                                "the origin is in no layer that a wider format would fix") + f": {origin_text(f)}")
                            break
                        move(step, layer, "non-finite", f"step {step}: {f.trigger}: {origin_text(f)}; rolled back "
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
                            every = interval(sampled_s, plain_s)
                            controller.horizon = opts.horizon or 2 * every
                        next_sample = step + every
                        wanted = to_move(controller, step, monitor.take(), precision, model, to,
                                         guard.scaler is not None)
                        for name, cause, evidence, amax, limit in wanted:
                            move(step, name, cause, evidence, amax, limit)
                        if wanted:  # a rollback must restore weights of the dtypes they have now
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
    final = final_plan(precision.plan, config.start, moves)
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
    write_outputs(report, opts.json_path, opts.plan_out)
    if status == "interrupted":
        raise KeyboardInterrupt
    return report


__all__ = ["AutopilotOptions", "autopilot"]
