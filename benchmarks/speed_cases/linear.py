"""One Linear layer trained on a batch of M rows: the shape of torchao's float8 microbenchmark (its float8 README,
"Performance": M, K, N of the forward; the forward and both backward GEMMs of a bfloat16 Linear against a Float8Linear
with dynamic tensorwise scaling, each compiled, on an H100). The case file names M, K and N as ``linear.py:M,K,N``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab import Task


def make_task(m: int = 4096, k: int = 8192, n: int = 16384) -> Task:
    def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(rows, k, generator=g), torch.zeros(rows, n)

    return Task(name=f"linear-{m}x{k}x{n}", make_model=lambda: nn.Linear(k, n, bias=False), train_batch=batch,
                loss_fn=F.mse_loss, metric="", batch_size=m, steps=10,
                make_optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                description=f"one Linear {k}->{n} on {m} rows (torchao's float8 microbenchmark shape)")


def make_large() -> Task:
    return make_task(4096, 8192, 16384)
