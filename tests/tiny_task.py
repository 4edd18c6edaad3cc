"""Tiny tasks for tests: a 2-layer MLP on synthetic data, plus variants that misbehave on purpose."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from dtypelab import Task

X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
W = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
Y = (X @ W).argmax(1)


class MLP(nn.Module):
    """Misbehaves when the input dtype matches ``trap_dtype``: 'raise', 'crash' or 'hang'."""

    def __init__(self, trap_dtype: torch.dtype | None = None, trap: str = "raise") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        self.trap_dtype, self.trap = trap_dtype, trap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trap_dtype is not None and x.dtype == self.trap_dtype:
            if self.trap == "raise":
                raise ValueError(f"planted failure under {x.dtype}")
            if self.trap == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.trap == "hang":
                time.sleep(3600)
        return self.net(x)


def _task(trap_dtype: torch.dtype | None = None, trap: str = "raise") -> Task:
    def train_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(X), (batch_size,), generator=torch.Generator().manual_seed(step))
        return X[idx], Y[idx]

    def evaluate(predict) -> dict[str, float]:
        return {"accuracy": (predict(X).argmax(1) == Y).float().mean().item()}

    return Task(name="tiny", make_model=lambda: MLP(trap_dtype, trap), train_batch=train_batch,
                loss_fn=nn.functional.cross_entropy, evaluate=evaluate, metric="accuracy",
                higher_is_better=True, make_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                steps=30, batch_size=32)


def make_task() -> Task:
    return _task()


def make_raising_task() -> Task:
    return _task(torch.bfloat16, "raise")


def make_crashing_task() -> Task:
    return _task(torch.float64, "crash")


def make_hanging_task() -> Task:
    return _task(torch.bfloat16, "hang")


def make_broken_task() -> Task:
    return helper_that_fails()


def helper_that_fails() -> Task:
    raise RuntimeError("the user's own bug")


def not_a_task() -> int:
    return 42
