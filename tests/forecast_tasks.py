"""Tasks for the forecast's tests: a model whose forward cannot be traced on fake tensors (its output's shape depends
on its values), one with frozen weights (nothing to keep for them), and one whose repeated blocks sit two levels down
(``encoder.stack.layers``, as Hugging Face nests them)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab import Task

X = torch.randn(512, 16, generator=torch.Generator().manual_seed(3))
Y = (X.sum(1) > 0).long()


class Gated(nn.Module):
    """Keeps the rows whose first hidden feature is positive: a data-dependent shape (boolean indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        kept = h[h[:, 0] > -1.0]  # every row, but only the values know it
        return self.b(kept)


class Frozen(nn.Module):
    """A frozen feature extractor under a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        for p in self.body.parameters():
            p.requires_grad_(False)
        self.head = nn.Linear(256, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Nested(nn.Module):
    """An embedding, four blocks in ``encoder.stack.layers`` (a ModuleList two levels down), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.encoder = nn.Module()
        self.encoder.stack = nn.Module()
        self.encoder.stack.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.encoder.stack.layers:
            h = layer(h)
        return self.head(h)


def _task(name: str, make) -> Task:
    def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(step * n, (step + 1) * n) % len(X)
        return X[idx], Y[idx]

    def evaluate(predict) -> dict[str, float]:
        return {"accuracy": float((predict(X).argmax(1) == Y).float().mean())}

    return Task(name=name, make_model=make, train_batch=batch, loss_fn=F.cross_entropy, evaluate=evaluate,
                metric="accuracy", steps=10, batch_size=32)


def gated() -> Task:
    return _task("gated", Gated)


def frozen() -> Task:
    return _task("frozen", Frozen)


def nested() -> Task:
    return _task("nested", Nested)
