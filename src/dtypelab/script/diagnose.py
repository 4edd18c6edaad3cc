"""What a session does besides measuring, on the script's own loop: nothing (bench), or a diagnosis the job brings —
the NaN guard's op tracer (``dtypelab.tracing``) or the range audit (``dtypelab.numerics``). A diagnosis is an object
of its capability, sent with the job; the session calls these hooks around every step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dtypelab.core.policies import Precision
    from dtypelab.script.messages import ScriptJob

Emit = Callable[..., None]  # a message to the launcher: ``emit(kind, *payload)`` (nothing when run on its own)


class Diagnosis:
    """What a session does besides measuring: nothing (bench)."""

    stop = False
    stop_code = 0  # the exit code when it stops a script that runs on its own

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], precision: Precision,
              emit: Emit) -> None: ...

    def begin(self, step: int, grad_scale: float) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def before_step(self) -> None:
        """An optimizer is about to step (the first of the training step's): its gradients are there."""

    def end(self, step: int, loss_values: list[float]) -> None: ...

    def record(self, job: ScriptJob, losses: list[float], scaler: dict[str, Any],
               metrics: dict[str, float]) -> str | None:
        """The record to write (JSON) when the run ends, or None."""
        return None

    def refuses_framework(self) -> str:
        """Why this diagnosis cannot run on a framework's own loop (Lightning, Hugging Face), or ""."""
        return ""

    def keep(self, text: str) -> None:
        """The script ran on its own (not driven by dtypelab): what to do with the record here (nothing)."""
