"""digits: scikit-learn's bundled 8×8 handwritten digits, a small CNN, held-out accuracy."""

from __future__ import annotations

import torch
from torch import nn

from dtypelab.core.task import Task
from dtypelab.core.tasks import batched, epoch_batch


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values 0..16
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]  # fixed 20% held out
    return x[train], y[train], x[test], y[test]


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_task() -> Task:
    x_train, y_train, x_test, y_test = _data()

    def train_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = epoch_batch(len(y_train), step, batch_size)
        return x_train[idx], y_train[idx]

    def evaluate(predict) -> dict[str, float]:
        logits = batched(predict, x_test)
        return {
            "accuracy": (logits.argmax(1) == y_test).float().mean().item(),
            "test_loss": nn.functional.cross_entropy(logits, y_test).item(),
        }

    return Task(
        name="digits", make_model=DigitsCNN, train_batch=train_batch,
        loss_fn=nn.functional.cross_entropy, evaluate=evaluate, metric="accuracy", higher_is_better=True,
        steps=300, batch_size=64, infer_batch=lambda n: x_test[:n],
        description="8×8 digits (scikit-learn), 2-conv CNN, held-out accuracy on 360 images",
    )
