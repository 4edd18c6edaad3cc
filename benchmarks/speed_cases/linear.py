"""One Linear layer trained on a batch of M rows: the shape of torchao's float8 microbenchmark (its float8 README,
"Performance": M, K, N of the forward; the forward and both backward GEMMs of a bfloat16 Linear against a Float8Linear
with dynamic tensorwise scaling, each compiled, on an H100). The case file names M, K and N as ``linear.py:M,K,N``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab import Task


class Shifted(nn.Module):
    """The Linear after a learned shift of its input: in a network a Linear's input needs its gradient, so its
    backward runs both GEMMs (the input's and the weight's), as the microbenchmark times them; a Linear fed the data
    itself would skip the input's."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(k))
        self.linear = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.shift)


def make_task(m: int = 4096, k: int = 8192, n: int = 16384) -> Task:
    def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(rows, k, generator=g), torch.zeros(rows, n)

    def evaluate(predict) -> dict[str, float]:  # forecasts never evaluate; a task must say how it would
        x, y = batch(0, 8)
        return {"val_loss": float(F.mse_loss(predict(x), y))}

    return Task(name=f"linear-{m}x{k}x{n}", make_model=lambda: Shifted(k, n), train_batch=batch,
                loss_fn=F.mse_loss, evaluate=evaluate, metric="val_loss", higher_is_better=False, batch_size=m,
                steps=10,
                make_optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                description=f"one Linear {k}->{n} on {m} rows (torchao's float8 microbenchmark shape)")


def make_large() -> Task:
    return make_task(4096, 8192, 16384)
