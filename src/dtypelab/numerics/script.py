"""``dtypelab audit train.py``: the range audit on the script's own loop. Forward hooks record every module's outputs
and, after each backward, the parameters' gradients, for ``steps`` steps (every ``every``-th), then the run stops with
the audit record."""

from __future__ import annotations

import re
import time
from typing import Any

import torch
from torch import nn

from dtypelab.core.results import AuditConfig
from dtypelab.core.updates import UpdateCounter
from dtypelab.numerics.rangestats import RangeCounter
from dtypelab.numerics.recording import Recorder, build_report, install_hooks
from dtypelab.script import Diagnosis, ScriptJob


class AuditDiagnosis(Diagnosis):
    """Sent with the job (built where ``audit`` runs, used in the script's process)."""

    def __init__(self, steps: int, every: int, layers: str | None, formats: tuple[str, ...],
                 updates: bool = False) -> None:
        self.steps, self.every, self.layers, self.formats = steps, every, layers or "", tuple(formats)
        self.updates = updates
        self.params: list[tuple[str, nn.Parameter]] = []
        self.counter: UpdateCounter | None = None
        self.precision: Any = None
        self._scale = 1.0

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], precision: Any = None,
              *_: Any) -> None:
        self.start = time.perf_counter()
        self.pattern = re.compile(self.layers) if self.layers else None
        self.rec = Recorder(RangeCounter(self.formats))
        install_hooks(model, self.rec, self.pattern)
        self.params = [(n, p) for n, p in model.named_parameters() if not self.pattern or self.pattern.search(n)]
        self.precision = precision
        if self.updates:
            self.counter = UpdateCounter(self.params)

    def begin(self, step: int, grad_scale: float) -> None:
        self.rec.new_step(step % self.every == 0 and step < self.steps, grad_scale)
        self._scale = grad_scale

    def backward(self, loss: torch.Tensor) -> None:
        if self.rec.active:
            for name, p in self.params:
                if p.grad is not None:
                    self.rec.record(name, "parameter", "param_grad", p.grad)

    def before_step(self) -> None:
        if self.counter is not None and self.rec.active:  # the gradients are there; the optimizer steps next
            self.counter.before()

    def end(self, step: int, loss_values: list[float]) -> None:
        self.stop = step + 1 >= self.steps
        if self.counter is not None:  # a step GradScaler skipped updated nothing
            scale = self.precision.grad_scale() if self.precision is not None else self._scale
            self.counter.after(skipped=scale < self._scale)

    def record(self, job: ScriptJob, losses: list[float], scaler: dict[str, Any], *_: Any) -> str:
        config = AuditConfig(task=job.script, policy=job.plan.get("name", ""), steps=len(losses),
                             every=self.every, layers=self.layers, formats=self.formats,
                             batch_size=0, seed=job.seed, device=job.device,
                             task_name=job.task_name)
        return build_report(config, self.rec, losses, "ok", "", {}, time.perf_counter() - self.start,
                            updates=self.counter.rows() if self.counter is not None else ()).to_json()
