"""Tasks for the profile tests: planted float64 promotion, float32 work under autocast, a broadcasting loss.
Line numbers matter: the tests read the PLANTED line."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import dtypelab

X = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
Y = torch.randn(512, 256, generator=torch.Generator().manual_seed(1))


def batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, len(X), (batch_size,), generator=g)
    return X[idx], Y[idx]


class Promoting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 256)
        self.scale = np.array([0.5])  # a NumPy float64 array, as a config loader gives it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * torch.from_numpy(self.scale)  # PLANTED: float32 × float64 is float64
        return (h @ h.t() @ h).float()


def _task(name: str, model: type[nn.Module] | object, target: object = None, loss: object = F.mse_loss,
          steps: int = 12) -> dtypelab.Task:
    return dtypelab.Task(
        name=name, make_model=model, train_batch=target or batch, loss_fn=loss,
        evaluate=lambda predict: {"mse": F.mse_loss(predict(X), Y).item()}, metric="mse", higher_is_better=False,
        steps=steps, batch_size=128)


def fp64_task() -> dtypelab.Task:
    return _task("fp64-promotion", Promoting)


def wide_task() -> dtypelab.Task:
    """A wide output whose loss autocast computes in float32."""
    return _task("wide", lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256)))


def broadcast_task() -> dtypelab.Task:
    """Predictions (N, 1) against a target (N,): mse_loss broadcasts to (N, N) and warns."""
    def target(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step, batch_size)
        return x, y[:, 0]

    return _task("broadcast", lambda: nn.Linear(64, 1), target)
