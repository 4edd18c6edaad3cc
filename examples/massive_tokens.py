"""A task where one layer's input has outliers that break float8 *tensorwise* scaling but not *rowwise*: a few
"massive" tokens (like the attention-sink tokens of large language models) whose values are 2^17 times the others'.

Their outputs do not count in the loss (their target is -1, as a padding or BOS token's would be), so float32 and
bfloat16 train on the other tokens undisturbed. With one float8 scale for the whole input (tensorwise), the scale is
set by the massive tokens and every ordinary token's values fall below float8's smallest subnormal: they flush to
zero, the layer sees nothing, and the model learns nothing. With one scale per row (rowwise), each token is scaled on
its own and nothing flushes.

    dtypelab bench examples/massive_tokens.py:make_task --policies amp-bf16,fp8-tensorwise-all-emu,fp8-rowwise-all-emu
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab import Task

FEATURES, CLASSES, EVERY, MASSIVE = 64, 4, 8, 2.0**17


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ teacher).argmax(1)
    massive = torch.arange(n) % EVERY == 0  # every 8th token, as a BOS token per short sequence would be
    x[massive] *= MASSIVE
    y[massive] = -1  # not in the loss, not in the metric
    return x, y


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def make_task() -> Task:
    held_x, held_y = _data(10**6, 1024)
    kept = held_y >= 0

    def evaluate(predict) -> dict[str, float]:
        out = predict(held_x)  # one batch with its massive tokens, as the model would see them
        return {"accuracy": (out.argmax(1)[kept] == held_y[kept]).float().mean().item()}

    return Task(name="massive-tokens", make_model=make_model, train_batch=lambda step, bs: _data(step, bs),
                loss_fn=lambda out, y: F.cross_entropy(out.float(), y, ignore_index=-1), evaluate=evaluate,
                metric="accuracy", make_optimizer=lambda p: torch.optim.Adam(p, lr=3e-3), steps=200, batch_size=128,
                description="every 8th token 2^17 times larger (out of the loss): tensorwise float8 scaling "
                            "flushes the others to zero, rowwise does not")
