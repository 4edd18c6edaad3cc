"""``autopilot``: train a task in a low-precision start configuration and move a layer out of it, while training goes
on, when its ranges say it is about to overflow or has underflowed; recover from a non-finite step by rolling back to
an in-memory checkpoint and moving the layer the trace names. The result is a record (every move with its evidence,
every rollback) and a plan file for the next run."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.loop import build_trainable, evaluate, prepare, to_device, train_step
from dtypelab.core.loop import threads as torch_threads
from dtypelab.core.machine.hardware import environment as current_environment
from dtypelab.core.machine.hardware import hardware_for, resolve_device
from dtypelab.core.policies import Precision, get_policy
from dtypelab.core.results import AutopilotConfig, AutopilotReport, Move, Rollback, check_writable
from dtypelab.core.source import Sites
from dtypelab.core.task import Task
from dtypelab.piloting.controller import rules_of
from dtypelab.piloting.handle import settings_of
from dtypelab.piloting.moves import target_config, write_outputs
from dtypelab.piloting.options import AutopilotOptions
from dtypelab.piloting.pilot import Pilot
from dtypelab.piloting.script import PilotDiagnosis
from dtypelab.run import Note, Target
from dtypelab.script import ScriptSkip, diagnose_script, script_record
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

    def heard(msg: Note) -> None:
        if msg.kind == "move":
            moves.append(msg.payload[0])
            if on_move is not None:
                on_move(msg.payload[0])
        elif msg.kind == "rollback":
            rollbacks.append(msg.payload[0])

    began = time.perf_counter()
    env = environment if environment is not None else current_environment(hardware)
    config = AutopilotConfig(task=target.spec, start=start.name, steps=0, batch_size=0, seed=opts.seed,
                             device=str(dev), sample_every=opts.sample_every or 0, promote_to=opts.promote_to,
                             max_rollbacks=opts.max_rollbacks, task_name=target.path, rules=rules_of(opts.model_dump()))
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
        skipped = out.value.reason if isinstance(out.value, ScriptSkip) else ""
        report = AutopilotReport(config, env, status="failed", reason=skipped or out.reason or out.status,
                                 moves=tuple(moves),
                                 rollbacks=tuple(rollbacks), live=True, wall_s=out.wall_s,
                                 created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    else:
        report = dataclasses.replace(script_record(AutopilotReport, text, target.spec, env), wall_s=out.wall_s)
    write_outputs(report, opts.json_path, opts.plan_out)
    return report


@dataclass
class _Flight:
    """The training loop's position: the step next to run and the steps lost to rollbacks."""

    pilot: Pilot
    guard: Guard
    one_step: Callable[..., torch.Tensor]
    task: Task
    n: int
    batch_size: int
    dev: torch.device
    progress: Progress
    step: int = 0
    lost: int = 0

    def one(self) -> bool:
        """One step (a rollback after a non-finite one); False when the pilot stops."""
        step = self.step
        batch = to_device(self.task.batch(step, self.batch_size), self.dev)
        sample = self.pilot.sampled(step)
        t0 = time.perf_counter()
        try:
            if sample:
                with self.pilot.monitor.reading():
                    self.guard.step(self.one_step, *batch, after_backward=self.pilot.monitor.after_backward)
            else:
                self.guard.step(self.one_step, *batch)
        except NonFiniteError as exc:
            back = self.guard.rollback()  # a task's step replays: the steps since are trained again
            self.lost += step + 1 - back
            if not self.pilot.nonfinite(step, back, exc.finding.trigger, exc.finding, f"rolled back to step {back}"):
                return False
            self.guard.checkpoint()  # replays from here run in the configuration now in force
            self.step = back
            self.progress(back, self.n)
            return True
        if self.pilot.stepped(step, time.perf_counter() - t0, sample, self.guard.scaler is not None):
            self.guard.checkpoint()  # a rollback must restore weights of the dtypes they have now
        self.step += 1
        self.progress(self.step, self.n)
        return True

    def fly(self, precision: Precision, model: nn.Module) -> tuple[float, dict[str, float]]:
        """Every step until the end or the pilot stops, then the metrics of a flight that ended well: (the loop's
        seconds, the metrics). Ctrl-C and a failure end it with the pilot's status saying why."""
        metrics: dict[str, float] = {}
        loop_start = time.perf_counter()
        try:
            with precision.session(), self.guard:
                while self.step < self.n and self.one():
                    pass
            train_s = time.perf_counter() - loop_start
            if self.pilot.status == "ok":
                metrics = evaluate(self.task, model, precision, self.dev)
        except KeyboardInterrupt:
            self.pilot.status, self.pilot.reason = "interrupted", f"interrupted after {self.step} steps"
            train_s = time.perf_counter() - loop_start
        except DtypelabError:
            raise
        except Exception as exc:
            self.pilot.status, self.pilot.reason = "failed", describe_exception(exc)
            train_s = time.perf_counter() - loop_start
        return train_s, metrics


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
    settings = opts.model_dump()
    progress = progress or (lambda done, total: None)
    start = time.perf_counter()
    with torch_threads(opts.threads):
        model, optimizer = build_trainable(task_obj, precision, dev, opts.seed)
        scaler = precision.grad_scaler()
        guard = Guard(model, optimizer, scaler=scaler, checkpoint_every=opts.checkpoint_every,
                      check_weights=scaler is None,
                      sites=Sites.of(task_obj.make_model, task_obj.loss_fn or task_obj.compute_loss, task_obj.origin))
        pilot = Pilot(rules_of(settings), opts.sample_every, opts.max_rollbacks, precision, model, optimizer, to,
                      emit=lambda kind, event: on_move(event) if on_move is not None and kind == "move" else None)
        config = pilot.config(settings, task=spec, start=precision.plan.name, steps=n, batch_size=bs, seed=opts.seed,
                              device=str(dev), task_name=task_obj.name)

        def one_step(inputs: Any, target: Any, after_backward: Callable[[], None] | None = None) -> torch.Tensor:
            return train_step(task_obj, model, precision, optimizer, inputs, target, after_backward=after_backward)

        torch.manual_seed(opts.seed)  # same dropout masks as bench
        flight = _Flight(pilot, guard, one_step, task_obj, n, bs, dev, progress)
        train_s, metrics = flight.fly(precision, model)
    report = pilot.report(
        config, environment if environment is not None else current_environment(hardware), tuple(guard.losses),
        metrics=metrics, steps_rolled_back=flight.lost, steps_skipped=guard.log.skipped if guard.log else 0,
        checkpoint_every=guard.every, checkpoint_s=guard.checkpoint_s,
        scaler=guard.log.stats() if guard.log else {}, train_s=train_s, wall_s=time.perf_counter() - start)
    write_outputs(report, opts.json_path, opts.plan_out)
    if report.status == "interrupted":
        raise KeyboardInterrupt
    return report


__all__ = ["AutopilotOptions", "autopilot"]
