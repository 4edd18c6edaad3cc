"""Tasks that go wrong in one layer, for `dtypelab autopilot` (its tests, guide and benchmark). Tiny models: fp16
arithmetic is slow on most CPUs.

    dtypelab autopilot examples/autopilot_tasks.py:make_drift_task --force
"""

from __future__ import annotations

import torch
from torch import nn

from dtypelab import Task

X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
W = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
Y = (X @ W).argmax(1)
STEPS = 70


def drift_scale(step: int) -> float:
    """The inputs' scale: 1 at step 0, 10^5 at the last step. fc1's outputs reach fp16's 65504 around step 50."""
    return 10.0 ** (5.0 * step / (STEPS - 1))


class Drifting(nn.Module):
    """fc1 sees the raw (drifting) inputs; the LayerNorm after it makes everything downstream scale-free, so float32
    learns the task at any scale and only fc1's own range is at stake."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _batch(scale) -> object:
    def train_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(X), (batch_size,), generator=torch.Generator().manual_seed(step))
        return X[idx] * scale(step), Y[idx]
    return train_batch


def _accuracy(scale: float):
    def evaluate(predict) -> dict[str, float]:
        out = predict(X * scale)
        return {"accuracy": (out.argmax(1) == Y).float().mean().item()}
    return evaluate


def _growing(name: str, scale) -> Task:
    return Task(name=name, make_model=Drifting, train_batch=_batch(scale), loss_fn=nn.functional.cross_entropy,
                evaluate=_accuracy(scale(STEPS - 1)), metric="accuracy", higher_is_better=True,
                make_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), steps=STEPS, batch_size=32)


def make_drift_task() -> Task:
    """Case 1: safe in fp16 for a while, then one layer's activations drift past fp16's range."""
    return _growing("drift", drift_scale)


def make_calm_task() -> Task:
    """Case 2: nothing comes near any format's limits."""
    return _growing("calm", lambda step: 1.0)


def leveling_scale(step: int) -> float:
    """Fast growth over the first 30 steps (x10 every 10 steps, to about 4% of fp16's limit at fc1's outputs), then
    slow growth (x3.5 over the last 40): they end near 15% of the limit. A straight line through the early readings'
    log says fp16 overflows around step 40; it never does."""
    return 10.0 ** (0.1 * step if step < 29 else 2.9 + 0.55 * (step - 29) / (STEPS - 30))


def linear_scale(step: int) -> float:
    """Growth in a straight line: fc1's outputs end near 15% of fp16's limit."""
    return 1.0 + 3000.0 * step / (STEPS - 1)


def make_leveling_task() -> Task:
    """Control: a layer's range grows fast early, then slowly, and never comes near fp16's limit: nothing moves."""
    return _growing("leveling", leveling_scale)


def make_linear_task() -> Task:
    """Control: a layer's range grows linearly to about 15% of fp16's limit: nothing moves."""
    return _growing("linear", linear_scale)


def make_tiny_loss_task() -> Task:
    """Underflow: a loss weighted by 1e-6 makes every gradient smaller than fp16's smallest subnormal; without a
    GradScaler, each layer computed in fp16 flushes its gradients to zero and stops learning."""
    return Task(name="tiny-loss", make_model=Drifting, train_batch=_batch(lambda step: 1.0),
                loss_fn=lambda out, y: 1e-6 * nn.functional.cross_entropy(out, y), evaluate=_accuracy(1.0),
                metric="accuracy", higher_is_better=True, make_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                steps=40, batch_size=32)


class LogOfZero(nn.Module):
    """log(relu(x)): -inf wherever a unit is off, in any format: no wider format fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.log(torch.relu(self.fc1(x))))


def make_log_zero_task() -> Task:
    return Task(name="log-zero", make_model=LogOfZero, train_batch=_batch(lambda step: 1.0),
                loss_fn=nn.functional.cross_entropy, evaluate=_accuracy(1.0), metric="accuracy",
                higher_is_better=True, make_optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), steps=20, batch_size=32)
