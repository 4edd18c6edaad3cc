"""Tiny tasks for tests: a 2-layer MLP on synthetic data, plus variants that misbehave on purpose."""

from __future__ import annotations

import dataclasses
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
            if self.trap == "kill" and os.environ.get("TINY_KILL") == "1":  # as the OOM killer or a lost node
                os.kill(os.getpid(), signal.SIGKILL)
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


class Recenter(nn.Module):
    """(x + 1000) - 1000: exact in float32, but bfloat16's 8-bit mantissa rounds x + 1000 to a multiple of 4, so
    this one layer, converted, wipes out its input; kept as an fp32 island it is harmless."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.full((width,), 1000.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.shift) - self.shift


def make_recenter_task() -> Task:
    return dataclasses.replace(_task(), name="tiny-recenter", make_model=lambda: nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), Recenter(32), nn.Linear(32, 3)))


def make_raising_task() -> Task:
    return _task(torch.bfloat16, "raise")


def make_crashing_task() -> Task:
    return _task(torch.float64, "crash")


def make_hanging_task() -> Task:
    return _task(torch.bfloat16, "hang")


def make_killed_task() -> Task:
    return _task(torch.bfloat16, "kill")


class RankTrap(MLP):
    """Misbehaves on torchrun's rank 1 only: raises under bfloat16, hangs under float64."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1" and x.dtype == torch.bfloat16:
            raise ValueError("planted failure on rank 1")
        if os.environ.get("RANK") == "1" and x.dtype == torch.float64:
            time.sleep(3600)
        return self.net(x)


def make_rank_trap_task() -> Task:
    return dataclasses.replace(_task(), name="tiny-rank-trap", make_model=lambda: RankTrap())


def make_broken_task() -> Task:
    return helper_that_fails()


def helper_that_fails() -> Task:
    raise RuntimeError("the user's own bug")


def not_a_task() -> int:
    return 42


# --- for the range audit: planted hazards --------------------------------------------------------
class _ShrinkGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by 1e-9, so everything upstream gets
    gradients far below float16's smallest subnormal (6e-8) yet well inside bfloat16's range."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1e-9


class ShrinkGrad(nn.Module):
    def forward(self, x):
        return _ShrinkGrad.apply(x)


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class PairOut(nn.Module):
    """A tuple output whose second element is an integer tensor (must be skipped, not crash)."""

    def forward(self, x):
        return x, x.argmax(-1)


class DictOut(nn.Module):
    def forward(self, x):
        return {"hidden": x * 0.5, "index": x.argmax(-1)}


class AuditNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.early = nn.Linear(8, 16)
        self.shrink = ShrinkGrad()
        self.shared = nn.Linear(16, 16)  # called twice per forward
        self.boom = Scale(1e5)  # activations ~1e5: past float16's 65504, nowhere near bfloat16's max
        self.unboom = Scale(1e-5)
        self.pair = PairOut()
        self.named = DictOut()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.shrink(self.early(x))
        h = self.shared(torch.tanh(self.shared(h)))
        h, _ = self.pair(self.unboom(self.boom(h)))
        return self.head(self.named(h)["hidden"])


def make_audit_task() -> Task:
    return Task(**{**_task().__dict__, "name": "audit-net", "make_model": AuditNet})


# --- for the memory window: large weights, pretrained (no fp32 training before inference) ------------------
def make_big_task() -> Task:
    """Eight 1024×1024 Linears: 32 MB of float32 weights, next to which activations are negligible."""
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(3))

    def make_model() -> nn.Module:
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    return Task(name="big", make_model=make_model, train_batch=lambda step, bs: (x[:bs], x[:bs]),
                loss_fn=nn.functional.mse_loss, evaluate=lambda predict: {"norm": float(predict(x).norm())},
                metric="norm", higher_is_better=True, steps=1, batch_size=4, pretrained=True)
