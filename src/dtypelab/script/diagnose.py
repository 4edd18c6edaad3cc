"""What a session does besides measuring, on the script's own loop: nothing (bench), or a diagnosis the job brings —
the NaN guard's op tracer (``dtypelab.tracing``) or the range audit (``dtypelab.numerics``). A diagnosis is an object
of its capability, sent with the job; the session calls these hooks around every step."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Diagnosis:
    """What a session does besides measuring: nothing (bench)."""

    stop = False

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None: ...

    def begin(self, step: int, grad_scale: float) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def end(self, step: int, loss_values: list[float]) -> None: ...

    def record(self, job: dict[str, Any], losses: list[float], scaler: dict[str, Any]) -> str | None:
        """The record to write (JSON) when the run ends, or None."""
        return None
