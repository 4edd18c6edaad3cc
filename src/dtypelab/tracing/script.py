"""``dtypelab trace train.py``: the op tracer on the script's own loop. A script's step cannot be replayed inside its
run (its loss and its data are its own code), but the script can run again: the launcher seeds every RNG before its
first line, so the same script repeats the same steps. So by default it runs twice at most. First untraced, at its own
speed, with one fused finite check of the loss and the weights after each step (``arm_at=None``): a clean script
costs about one run. When a step goes non-finite, that run stops there, and a second run arms the op tracer from
that step on (``arm_at=k``), so only the bad step pays the tracer's several-times cost; its trace names the origin.
``every_step`` (``arm_at=0``) traces every step in one run, for a script that does not repeat itself."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch
from torch import nn

from dtypelab.core.results import TraceConfig, TraceReport
from dtypelab.core.source import Sites
from dtypelab.script import Diagnosis, ScriptJob
from dtypelab.tracing.guard import finding_of
from dtypelab.tracing.nonfinite import OpTracer, storage_key
from dtypelab.tracing.snapshot import all_finite


def trigger_of(loss_values: list[float], named: list[tuple[str, nn.Parameter]]) -> str:
    """Why a step counts as gone non-finite (its loss, else a weight after the optimizer step), or ""."""
    bad_loss = next((v for v in loss_values if not math.isfinite(v)), None)
    if bad_loss is not None:
        return f"loss is {bad_loss}"
    if all_finite([p.detach() for _, p in named]):
        return ""
    bad = [n for n, p in named if not bool(torch.isfinite(p).all())]
    return f"parameter {bad[0]} non-finite after the optimizer step" + (
        f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")


class TraceDiagnosis(Diagnosis):
    """Sent with the job (built where ``trace`` runs, used in the script's process). ``arm_at``: the first step run
    under the op tracer (None: none, only the finite checks; see the module's docstring)."""

    def __init__(self, arm_at: int | None = 0) -> None:
        self.arm_at = arm_at
        self.bad_step: int | None = None  # the first step gone non-finite, traced or not
        self.trigger = ""
        self.model: nn.Module | None = None
        self.named: list[tuple[str, nn.Parameter]] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.tracer: OpTracer | None = None
        self.loss: torch.Tensor | None = None
        self.finding = None
        self.started = 0.0
        self.start = time.perf_counter()

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], *_: Any) -> None:
        self.start = time.perf_counter()
        self.model, self.named = model, list(model.named_parameters())
        self.optimizer = optimizers[0] if optimizers else None

    def begin(self, step: int, grad_scale: float) -> None:
        if self.model is None or self.tracer is not None or self.arm_at is None or step < self.arm_at:
            return
        names = {storage_key(p): f"{n} (parameter)" for n, p in self.named}
        self.tracer = OpTracer(self.model, self.optimizer, names, step=step, sites=Sites())
        self.started = time.perf_counter()
        self.tracer.__enter__()

    def backward(self, loss: torch.Tensor) -> None:
        self.loss = loss

    def end(self, step: int, loss_values: list[float]) -> None:
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            tracer.__exit__(None, None, None)
        trigger = trigger_of(loss_values, self.named)
        if trigger:
            self.bad_step, self.trigger, self.stop = step, trigger, True
            if tracer is not None:
                self.finding = finding_of(tracer, self.named, self.loss, trigger, step,
                                          time.perf_counter() - self.started, replayed_steps=self.arm_at or 0)
        self.loss = None

    def record(self, job: ScriptJob, losses: list[float], scaler: dict[str, Any], *_: Any) -> str:
        if self.bad_step is not None and self.finding is None:  # untraced: what the next run arms the tracer for
            return json.dumps({"bad_step": self.bad_step, "trigger": self.trigger, "losses": losses})
        config = TraceConfig(task=job.script, policy=job.plan.get("name", ""), steps=len(losses), batch_size=0,
                             seed=job.seed, device=job.device, checkpoint_every=0,
                             stop_on_skip=False, task_name=job.task_name)
        return TraceReport(config=config, environment={}, status="found" if self.finding else "clean",
                           finding=self.finding, losses=tuple(losses), scaler=scaler, live=True,
                           wall_s=time.perf_counter() - self.start).to_json()
