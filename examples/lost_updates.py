"""A task whose every Adam update is smaller than half a bfloat16 spacing of its weight: pure bfloat16 training
cannot move it at all, while float32, autocast (float32 weights), stochastic rounding and Kahan summation can.

The model is one linear map whose weights start between 1 and 2, where bfloat16 values are 2^-7 apart, and must
each move by 0.1. Adam moves a weight by about its learning rate, 10^-3, per step: under the 2^-8 that a bfloat16
weight there needs to change at all, so every update rounds away. The metric, ``fit``, is the share of the starting
error that training removed (1: solved, 0: where it started).

    dtypelab bench examples/lost_updates.py:make_task --policies fp32,amp-bf16,bf16,bf16-sr,bf16-kahan
    dtypelab audit examples/lost_updates.py:make_task --updates
"""

from __future__ import annotations

import torch
from torch import nn

from dtypelab import Task

FEATURES, SHIFT, LR = 16, 0.1, 1e-3


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The starting weights (bfloat16 values in [1, 1.75], so no cast moves them) and the solution, 0.1 lower."""
    start = torch.linspace(1.0, 1.75, FEATURES).to(torch.bfloat16).float().unsqueeze(0)
    return start, start - SHIFT


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, x @ _weights()[1].T


def make_model() -> nn.Module:
    model = nn.Linear(FEATURES, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(_weights()[0])
    return model


def make_task(steps: int = 300) -> Task:
    held_x, held_y = _data(10**6, 1024)
    start_err = nn.functional.mse_loss(held_x @ _weights()[0].T, held_y).item()

    def evaluate(predict) -> dict[str, float]:
        mse = nn.functional.mse_loss(predict(held_x), held_y).item()
        return {"fit": 1 - mse / start_err, "mse": mse}

    return Task(name="lost-updates", make_model=make_model, train_batch=lambda step, bs: _data(step, bs),
                loss_fn=nn.functional.mse_loss, evaluate=evaluate, metric="fit", higher_is_better=True,
                make_optimizer=lambda p: torch.optim.Adam(p, lr=LR), steps=steps, batch_size=64,
                description="one linear map whose Adam updates (~1e-3) are below half a bfloat16 spacing of its "
                            "weights (2^-8 in [1, 2)): pure bfloat16 cannot train it")
