"""Built-in tasks: small, offline, and quick enough on two CPU cores to sweep every policy."""

from __future__ import annotations

from collections.abc import Callable

import torch


def epoch_batch(n: int, step: int, batch_size: int, seed: int = 0) -> torch.Tensor:
    """Indices of batch ``step`` when n samples are shuffled anew (deterministically) each epoch."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size]


def batched(predict: Callable, inputs: torch.Tensor, size: int = 512) -> torch.Tensor:
    """Run predict over inputs in chunks and concatenate the outputs."""
    return torch.cat([predict(inputs[i:i + size]) for i in range(0, len(inputs), size)])
