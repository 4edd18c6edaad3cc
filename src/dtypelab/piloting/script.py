"""The autopilot on a training script's own loop (``dtypelab autopilot train.py``, ``session(autopilot=True)``).

The readings and moves are the task's: forward hooks armed for a sampled step, the weight gradients read after
``lab.backward``, the same controller. Recovery differs because a script's step cannot be replayed (its data loader
and loss are its own code): at a non-finite step the model and optimizer go back to the last in-memory checkpoint
and the model's *forward* on that step's inputs is replayed under the op tracer to name the origin; training then
goes on with the script's next batch. The steps since the checkpoint are dropped, not trained again, and a value
that goes non-finite only in the loss or the backward has no origin a replayed forward can find: the run stops
there and says so (``dtypelab trace train.py`` traces the whole step)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from dtypelab.core.policies import Precision
from dtypelab.core.results import AutopilotConfig, AutopilotReport, Move, Rollback
from dtypelab.piloting.controller import Controller, rules_of
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
from dtypelab.script import Diagnosis
from dtypelab.tracing import Snapshot, all_finite, trace_forward

# share of the step time the automatic checkpoint interval aims at: the Guard's 2%; under a GradScaler a non-finite
# step is skipped and leaves the state it started from, so a checkpoint is only the fallback for weights gone bad
CHECKPOINT_BUDGET, SCALED_CHECKPOINT_BUDGET = 0.02, 0.005
MAX_CHECKPOINT_EVERY = 100
FRAMEWORK = ("the autopilot runs on a plain loop's model (lab.setup): Lightning's and Hugging Face's Trainers keep "
             "their own precision plumbing (autocast, GradScaler), so a layer cannot be moved while they train")
NOT_IN_FORWARD = ("the model's forward on this step's inputs is finite (replayed from the checkpoint): the value "
                  "went non-finite in the loss or the backward, which a script's step cannot replay; run `dtypelab "
                  "trace` on the script to trace the whole step")


class PilotDiagnosis(Diagnosis):
    """Sent with the job (``dtypelab autopilot train.py``) or made by ``dtypelab.session(autopilot=...)``; runs in the
    script's process on its loop. ``settings`` are ``AutopilotOptions``' fields (start, promote_to, sample_every,
    headroom, horizon, max_rollbacks, checkpoint_every, json_path, plan_out, seed)."""

    def __init__(self, settings: dict[str, Any], script: str = "") -> None:
        self.settings, self.script = dict(settings), script
        self.model: nn.Module | None = None
        self.moves: list[Move] = []
        self.rollbacks: list[Rollback] = []
        self.dropped: set[int] = set()
        self.status, self.reason, self.finding = "ok", "", None
        self.plain_s: list[float] = []
        self.sampled_s: list[float] = []
        self.readings = 0
        self.checkpoint_s = 0.0
        self.stop_code = 0
        self.calls: list[tuple[tuple, dict]] = []
        self.device = torch.device("cpu")  # the model's, once setup has it
        self.start = time.perf_counter()

    # --- the session's hooks ------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], precision: Precision,
              emit: Any) -> None:
        s = self.settings
        self.model, self.precision = model, precision
        self.emit = emit or self._say  # run on its own: each move on stderr as it happens
        self.start_name = precision.plan.name
        self.optimizer = optimizers[0] if optimizers else None
        self.scaler = precision.grad_scaler()
        self.params = list(model.parameters())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.to = target_config(s.get("promote_to") or "auto", precision, self.device)
        self.every = int(s.get("sample_every") or FIRST_EVERY)
        self.controller = Controller(rules_of(s, self.every))
        self.monitor = Monitor(model)
        self.snapshot = Snapshot(model, self.optimizer, self.scaler)
        self.fixed_checkpoints = s.get("checkpoint_every")
        self.checkpoint_every = int(self.fixed_checkpoints or 1)
        self.checkpoint_step = -1
        self.next_sample = 0
        self.sampling: Any = None
        model.register_forward_pre_hook(self._keep_inputs, with_kwargs=True)
        self.start = time.perf_counter()

    def begin(self, step: int, grad_scale: float) -> None:
        if self.model is None or self.status != "ok":
            return
        if self.checkpoint_step < 0 or step - self.checkpoint_step >= self.checkpoint_every:
            self._checkpoint(step)
        self.rng = torch.get_rng_state()  # the replay draws the same dropout masks
        self.t0 = time.perf_counter()
        if step >= self.next_sample:
            self.sampling = self.monitor.reading()
            self.sampling.__enter__()

    def backward(self, loss: torch.Tensor) -> None:
        if self.sampling is not None:
            self.monitor.after_backward()

    def end(self, step: int, loss_values: list[float]) -> None:
        if self.model is None or self.status != "ok":
            return
        sampled, self.sampling = self.sampling, None
        if sampled is not None:
            sampled.__exit__(None, None, None)
        elapsed = time.perf_counter() - self.t0
        try:
            self._after(step, loss_values, elapsed, sampled is not None)
        finally:
            self.calls = []  # the inputs were kept for this step's replay only

    def _after(self, step: int, loss_values: list[float], elapsed: float, sampled: bool) -> None:
        bad = next((v for v in loss_values if not math.isfinite(v)), None)
        trigger = f"loss is {bad}" if bad is not None else ""
        if not trigger and self.scaler is None and not all_finite([p.detach() for p in self.params]):
            trigger = "a parameter is non-finite after the optimizer step"
        if trigger:
            self._recover(step, trigger)
            return
        if step > 0:  # the first step is everyone's warm-up
            (self.sampled_s if sampled else self.plain_s).append(elapsed)
        if not sampled:
            return
        self.readings += 1
        if not self.settings.get("sample_every") and len(self.plain_s) >= 3 and self.sampled_s:
            self.every = interval(self.sampled_s, self.plain_s)
            self.controller.horizon = int(self.settings.get("horizon") or 2 * self.every)
        self.next_sample = step + self.every
        wanted = to_move(self.controller, step, self.monitor.take(), self.precision, self.model, self.to,
                         self.scaler is not None)
        for name, cause, evidence, amax, limit in wanted:
            self._move(step, name, cause, evidence, amax, limit)
        if wanted:  # a rollback must restore weights of the dtypes they have now
            self._checkpoint(step + 1)

    def record(self, job: dict[str, Any], losses: list[float], scaler: dict[str, Any],
               metrics: dict[str, float]) -> str:
        return self.report(job, losses, scaler, metrics).to_json()

    def keep(self, text: str) -> None:
        """Run on its own: the summary on stderr, the record and plan where the settings say."""
        report = AutopilotReport.from_json(text)
        write_outputs(report, self.settings.get("json_path"), self.settings.get("plan_out"))
        moved = "; ".join(f"{m.layer} → {m.to} at step {m.step} ({m.cause})" for m in report.moves) or "nothing"
        print(f"dtypelab autopilot: {report.status}, from {report.config.start}; moved {moved}"
              + (f"; {len(report.rollbacks)} rollback(s)" if report.rollbacks else "")
              + (f": {report.reason}" if report.reason else ""), file=sys.stderr)

    def refuses_framework(self) -> str:
        return FRAMEWORK

    # --- internals --------------------------------------------------------------------------------------
    def report(self, job: dict[str, Any], losses: list[float], scaler: dict[str, Any],
               metrics: dict[str, float]) -> AutopilotReport:
        s = self.settings
        start = self.start_name if self.model is not None else str(s.get("start", ""))
        kept = tuple(v for i, v in enumerate(losses) if i not in self.dropped)
        status, reason = self.status, self.reason
        if self.model is None:
            status, reason = "failed", "the script never called lab.setup(model, optimizer): " + FRAMEWORK
        elif status == "ok" and getattr(sys, "last_value", None) is not None:  # run on its own, it died of this
            crash = sys.last_value
            status = "interrupted" if isinstance(crash, KeyboardInterrupt) else "failed"
            reason = f"the script raised {type(crash).__name__}: {crash}"
        elif status == "ok" and not metrics:
            reason = "the script ended without lab.finish(metric=...): no metric to compare"
        config = AutopilotConfig(
            task=job.get("script") or self.script, start=start, steps=len(losses), batch_size=0,
            seed=int(job.get("seed", s.get("seed", 0))), device=job.get("device") or str(self.device),
            sample_every=int(s.get("sample_every") or 0), promote_to=self.to.label if self.model is not None else "",
            headroom=float(s.get("headroom", 0.5)), horizon=int(s.get("horizon") or 0),
            trend_from=float(s.get("trend_from", 0.1)), trend_keep=float(s.get("trend_keep", 0.5)),
            max_rollbacks=int(s.get("max_rollbacks", 3)), task_name=job.get("task_name", ""))
        plan = final_plan(self.precision.plan, start, self.moves).to_dict() if self.model is not None else {}
        median = statistics.median(self.plain_s) if self.plain_s else 0.0
        return AutopilotReport(
            config=config, environment={}, status=status, reason=reason, moves=tuple(self.moves),
            rollbacks=tuple(self.rollbacks), final_plan=plan, losses=kept, metrics=dict(metrics),
            steps_rolled_back=len(self.dropped), steps_skipped=int(scaler.get("skipped", 0) or 0),
            samples=self.readings, sample_s=max(0.0, sum(self.sampled_s) - median * len(self.sampled_s)),
            sample_every=self.every if self.model is not None else 0,
            checkpoint_every=self.checkpoint_every if self.model is not None else 0, checkpoint_s=self.checkpoint_s,
            step_s=median, finding=self.finding, scaler=scaler, train_s=time.perf_counter() - self.start,
            wall_s=time.perf_counter() - self.start, created=time.strftime("%Y-%m-%dT%H:%M:%S"), live=True)

    @staticmethod
    def _say(kind: str, event: Move | Rollback) -> None:
        if isinstance(event, Move):
            print(f"dtypelab autopilot: step {event.step}: {event.layer} {event.from_} → {event.to} ({event.cause}): "
                  f"{event.evidence}", file=sys.stderr)
        else:
            back = "the step dropped" if event.to_step == event.step else f"rolled back to step {event.to_step}"
            print(f"dtypelab autopilot: step {event.step}: {event.trigger}; {back}", file=sys.stderr)

    def _keep_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():  # the step's own forwards, not a replay or an evaluation
            self.calls.append((args, kwargs))

    def _checkpoint(self, step: int) -> None:
        t = time.perf_counter()
        self.snapshot.take()
        self.checkpoint_s = time.perf_counter() - t
        self.checkpoint_step = step
        if not self.fixed_checkpoints and len(self.plain_s) >= 2:
            step_s = statistics.median(self.plain_s[-20:])
            budget = SCALED_CHECKPOINT_BUDGET if self.scaler is not None else CHECKPOINT_BUDGET
            self.checkpoint_every = max(1, min(MAX_CHECKPOINT_EVERY, math.ceil(self.checkpoint_s / (budget * step_s))))

    def _move(self, step: int, name: str, cause: str, evidence: str, amax: float | None = None,
              limit: float | None = None) -> None:
        was = label(self.precision, name, self.model)
        self.precision.promote(self.model, name, self.to, self.optimizer)
        m = Move(step, name, was, self.to.label, cause, evidence, amax, limit)
        self.moves.append(m)
        self.emit("move", m)

    def _recover(self, step: int, trigger: str) -> None:
        """Back to the checkpoint; the origin from the replayed forward; the layer moved, or the run stopped."""
        if self.scaler is not None and all_finite([p.detach() for p in self.params]):
            # GradScaler skipped the step: weights and optimizer state are those it started from, so nothing is
            # rolled back; the replay draws the step's dropout masks, and the script's RNG goes on as it was
            back, after = step, torch.get_rng_state()
            torch.set_rng_state(self.rng)
            finding = trace_forward(self.model, self.calls, trigger, step)
            torch.set_rng_state(after)
        else:
            back = self.checkpoint_step
            self.snapshot.restore()
            torch.set_rng_state(self.rng)
            finding = trace_forward(self.model, self.calls, trigger, step)
            self.snapshot.restore()  # the RNG and anything the replay touched
        self.dropped.update(range(back, step + 1))
        layer = movable(finding, self.precision, self.model, self.to) if finding.origin is not None else ""
        origin = origin_text(finding) if finding.origin is not None else NOT_IN_FORWARD
        self.rollbacks.append(Rollback(step, back, trigger, origin, layer))
        self.emit("rollback", self.rollbacks[-1])
        if not layer or len(self.rollbacks) > int(self.settings.get("max_rollbacks", 3)):
            self.status, self.finding, self.stop, self.stop_code = "stopped", finding, True, 1
            self.reason = f"step {step}: {trigger}; " + (
                f"{len(self.rollbacks)} rollbacks did not fix it: {origin}" if layer else
                (f"the origin is in no layer that a wider format would fix: {origin}" if finding.origin is not None
                 else origin))
            return
        self._move(step, layer, "non-finite", f"step {step}: {trigger}: {origin}; " + (
            "GradScaler skipped the step" if back == step else
            f"rolled back to step {back}, the {step + 1 - back} step(s) since dropped"))
        self._checkpoint(step + 1)
