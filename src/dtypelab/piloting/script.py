"""The autopilot on a training script's own loop (``dtypelab autopilot train.py``, ``session(autopilot=True)``).

The readings, moves and record are the task's (``pilot.Pilot``): forward hooks armed for a sampled step, the weight
gradients read after ``lab.backward``, the same controller. Recovery differs because a script's step cannot be
replayed (its data loader and loss are its own code): at a non-finite step the model and optimizer go back to the
last in-memory checkpoint and the model's *forward* on that step's inputs is replayed under the op tracer to name the
origin; training then goes on with the script's next batch. The steps since the checkpoint are dropped, not trained
again, and a value that goes non-finite only in the loss or the backward has no origin a replayed forward can find:
the run stops there and says so (``dtypelab trace train.py`` traces the whole step)."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

import torch
from torch import nn

from dtypelab.core.policies import Precision
from dtypelab.core.results import AutopilotConfig, AutopilotReport, Move, Rollback
from dtypelab.piloting.controller import rules_of
from dtypelab.piloting.moves import target_config, write_outputs
from dtypelab.piloting.pilot import Pilot
from dtypelab.script import Diagnosis, ScriptJob
from dtypelab.tracing import CHECKPOINT_BUDGET, Snapshot, all_finite, checkpoint_interval, trace_forward

# share of the step time the automatic checkpoint interval aims at under a GradScaler (the Guard's is 2%): there a
# non-finite step is skipped and leaves the state it started from, so a checkpoint is only the fallback for weights
# gone bad
SCALED_CHECKPOINT_BUDGET = 0.005
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
        self.pilot: Pilot | None = None  # the decisions, once setup has the model
        self.dropped: set[int] = set()
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
        self.optimizer = optimizers[0] if optimizers else None
        self.scaler = precision.grad_scaler()
        self.params = list(model.parameters())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        to = target_config(s.get("promote_to") or "auto", precision, self.device)
        self.pilot = Pilot(rules_of(s), s.get("sample_every"), int(s.get("max_rollbacks", 3)), precision, model,
                           self.optimizer, to, emit=emit or self._say)  # on its own: each move on stderr
        self.snapshot = Snapshot(model, self.optimizer, self.scaler)
        self.fixed_checkpoints = s.get("checkpoint_every")
        self.checkpoint_every = int(self.fixed_checkpoints or 1)
        self.checkpoint_step = -1
        self.sampling: Any = None
        model.register_forward_pre_hook(self._keep_inputs, with_kwargs=True)
        self.start = time.perf_counter()

    @property
    def stop(self) -> bool:  # the autopilot had to stop: the session ends the script
        return self.pilot is not None and self.pilot.status == "stopped"

    def begin(self, step: int, grad_scale: float) -> None:
        if self.pilot is None or self.pilot.status != "ok":
            return
        if self.checkpoint_step < 0 or step - self.checkpoint_step >= self.checkpoint_every:
            self._checkpoint(step)
        self.rng = torch.get_rng_state()  # the replay draws the same dropout masks
        self.t0 = time.perf_counter()
        if self.pilot.sampled(step):
            self.sampling = self.pilot.monitor.reading()
            self.sampling.__enter__()

    def backward(self, loss: torch.Tensor) -> None:
        if self.sampling is not None and self.pilot is not None:
            self.pilot.monitor.after_backward()

    def end(self, step: int, loss_values: list[float]) -> None:
        if self.pilot is None or self.pilot.status != "ok":
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
        elif self.pilot.stepped(step, elapsed, sampled, self.scaler is not None):
            self._checkpoint(step + 1)  # a rollback must restore weights of the dtypes they have now

    def record(self, job: ScriptJob, losses: list[float], scaler: dict[str, Any],
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
    def report(self, job: ScriptJob, losses: list[float], scaler: dict[str, Any],
               metrics: dict[str, float]) -> AutopilotReport:
        s = self.settings
        kept = tuple(v for i, v in enumerate(losses) if i not in self.dropped)
        measured: dict[str, Any] = {"metrics": dict(metrics), "steps_rolled_back": len(self.dropped),
                    "steps_skipped": int(scaler.get("skipped_steps") or 0), "checkpoint_s": self.checkpoint_s,
                    "scaler": scaler, "train_s": time.perf_counter() - self.start,
                    "wall_s": time.perf_counter() - self.start, "live": True}
        common: dict[str, Any] = {"task": job.script or self.script, "steps": len(losses), "batch_size": 0,
                  "seed": job.seed if job.plan else int(s.get("seed", 0)), "device": job.device or str(self.device),
                  "task_name": job.task_name}
        if self.pilot is None:
            config = AutopilotConfig(start=str(s.get("start", "")), sample_every=int(s.get("sample_every") or 0),
                                     promote_to="", max_rollbacks=int(s.get("max_rollbacks", 3)), rules=rules_of(s),
                                     **common)
            return AutopilotReport(config=config, environment={}, status="failed", reason="the script never called "
                                   "lab.setup(model, optimizer): " + FRAMEWORK, losses=kept,
                                   created=time.strftime("%Y-%m-%dT%H:%M:%S"), **measured)
        pilot = self.pilot
        status, reason = pilot.status, pilot.reason
        if status == "ok" and getattr(sys, "last_value", None) is not None:  # run on its own, it died of this
            crash = sys.last_value
            status = "interrupted" if isinstance(crash, KeyboardInterrupt) else "failed"
            reason = f"the script raised {type(crash).__name__}: {crash}"
        elif status == "ok" and not metrics:
            reason = "the script ended without lab.finish(metric=...): no metric to compare"
        report = pilot.report(pilot.config(s, start=pilot.start_name, **common), {}, kept,
                              checkpoint_every=self.checkpoint_every, **measured)
        return dataclasses.replace(report, status=status, reason=reason)

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
        plain = self.pilot.plain_s if self.pilot is not None else []
        if not self.fixed_checkpoints:
            every = checkpoint_interval(self.checkpoint_s, plain, SCALED_CHECKPOINT_BUDGET if self.scaler is not None
                                        else CHECKPOINT_BUDGET)
            self.checkpoint_every = every or self.checkpoint_every

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
        recovered = "GradScaler skipped the step" if back == step else \
            f"rolled back to step {back}, the {step + 1 - back} step(s) since dropped"
        if not self.pilot.nonfinite(step, back, trigger, finding, recovered, no_origin=NOT_IN_FORWARD):
            self.stop_code = 1
            return
        self._checkpoint(step + 1)
