"""``dtypelab trace train.py``: the op tracer on the script's own loop. A script's steps cannot be replayed (its loss
is computed in its own code), so every step runs under the op tracer from its first forward to its optimizer step;
the first step whose loss or weights go non-finite is diagnosed from that trace and the run stops there. Tracing
every op costs several times the step time: this is a diagnostic run, not a measurement."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from dtypelab.core.results import TraceConfig, TraceReport
from dtypelab.core.source import Sites
from dtypelab.script import Diagnosis
from dtypelab.tracing.guard import finding_of
from dtypelab.tracing.nonfinite import OpTracer, storage_key


class TraceDiagnosis(Diagnosis):
    """Sent with the job (built where ``trace`` runs, used in the script's process)."""

    def __init__(self) -> None:
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
        if self.model is None or self.tracer is not None:
            return
        names = {storage_key(p): f"{n} (parameter)" for n, p in self.named}
        self.tracer = OpTracer(self.model, self.optimizer, names, step=step, sites=Sites())
        self.started = time.perf_counter()
        self.tracer.__enter__()

    def backward(self, loss: torch.Tensor) -> None:
        self.loss = loss

    def end(self, step: int, loss_values: list[float]) -> None:
        if self.tracer is None:
            return
        tracer, self.tracer = self.tracer, None
        tracer.__exit__(None, None, None)
        bad_loss = next((v for v in loss_values if not math.isfinite(v)), None)
        trigger = f"loss is {bad_loss}" if bad_loss is not None else ""
        if not trigger:
            bad = [n for n, p in self.named if not bool(torch.isfinite(p).all())]
            if bad:
                trigger = f"parameter {bad[0]} non-finite after the optimizer step" + (
                    f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        if trigger:
            self.finding = finding_of(tracer, self.named, self.loss, trigger, step, time.perf_counter() - self.started)
            self.stop = True
        self.loss = None

    def record(self, job: dict[str, Any], losses: list[float], scaler: dict[str, Any], *_: Any) -> str:
        config = TraceConfig(task=job.get("script", ""), policy=job["plan"]["name"], steps=len(losses), batch_size=0,
                             seed=job.get("seed", 0), device=job.get("device", ""), checkpoint_every=0,
                             stop_on_skip=False, task_name=job.get("task_name", ""))
        return TraceReport(config=config, environment={}, status="found" if self.finding else "clean",
                           finding=self.finding, losses=tuple(losses), scaler=scaler, live=True,
                           wall_s=time.perf_counter() - self.start).to_json()
