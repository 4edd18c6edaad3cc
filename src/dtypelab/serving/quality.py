"""Quality as users judge a served format (llama.cpp's ``--kl-divergence``, brevitas #1598): at every position of
the held-out documents, the KL divergence of the policy's next-token distribution from the baseline's, whether its
most likely token is the baseline's (top-1 agreement), and its negative log-likelihood; then, over the continuation's
positions and per context-length bucket, each figure with a bootstrap 95% interval over the documents (scipy's
``stats.bootstrap``, documents resampled: positions of one document are not independent).

The baseline's process writes its log-probabilities to safetensors files, one per batch of documents (reading them
runs no code; a batch at a time keeps a large vocabulary's log-probabilities off the heap); every other policy's
process reads them batch by batch and returns its per-position figures, small enough to cross the process
boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtypelab.core.results import Estimate, QualityBucket

CONFIDENCE = 0.95
RESAMPLES = 2000
FIRST_EDGE = 64  # context buckets: 1–64, 65–128, 129–256, … doubling up to the documents' length


@dataclass(frozen=True)
class PerPosition:
    """One policy's figures at every scored position, (documents, positions): position j predicts token j + 1 from
    a context of j + 1 tokens."""

    nll: list[list[float]]
    kl: list[list[float]] | None = None  # None: the baseline's own
    agree: list[list[bool]] | None = None


def chunk_path(folder: str, i: int) -> str:
    """The reference file of the ``i``-th batch of documents."""
    return str(Path(folder) / f"baseline-logprobs-{i:04d}.safetensors")


def joined(parts: list[PerPosition]) -> PerPosition:
    """Batches of documents' figures as one."""
    kl = None if any(p.kl is None for p in parts) else [row for p in parts for row in p.kl or []]
    agree = None if any(p.agree is None for p in parts) else [row for p in parts for row in p.agree or []]
    return PerPosition([row for p in parts for row in p.nll], kl, agree)


def write_reference(path: str, logprobs: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({"logprobs": logprobs.contiguous()}, path)


def kl_divergence(base: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """KL(base ‖ mine) of next-token distributions given as log-probabilities, per position (rounding can leave
    -1e-9 where they agree: floored at 0)."""
    return (base.exp() * (base - mine)).sum(-1).clamp(min=0.0)


def per_position(logprobs: torch.Tensor, windows: torch.Tensor, reference: str | None) -> PerPosition:
    """``logprobs`` (n, length - 1, vocab) of ``windows`` (n, length) against the reference file's (the baseline's),
    when given."""
    nll = -logprobs.gather(-1, windows[:, 1:, None].to(logprobs.device))[..., 0]
    if reference is None or not Path(reference).exists():
        return PerPosition(nll.tolist())
    from safetensors.torch import load_file

    base = load_file(reference)["logprobs"]
    kl = kl_divergence(base, logprobs)
    return PerPosition(nll.tolist(), kl.tolist(), (base.argmax(-1) == logprobs.argmax(-1)).tolist())


def _interval(samples: tuple[np.ndarray, ...], statistic: Any, seed: int) -> Estimate:
    """``statistic`` over the documents and its bootstrap interval (percentile: documents this few make BCa's
    acceleration noisy); a degenerate sample (every document the same) is its own interval."""
    from scipy import stats

    value = float(statistic(*samples, axis=-1))
    if all(np.ptp(s) == 0 for s in samples) or len(samples[0]) < 2:
        return Estimate(value, value, value)
    res = stats.bootstrap(samples, statistic, paired=len(samples) > 1, vectorized=True, n_resamples=RESAMPLES,
                          confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(seed))
    return Estimate(value, float(res.confidence_interval.low), float(res.confidence_interval.high))


def _mean(a: np.ndarray, axis: int = -1) -> Any:
    return np.mean(a, axis=axis)


def _ppl_change(nll: np.ndarray, base: np.ndarray, axis: int = -1) -> Any:
    return np.exp(np.mean(nll, axis=axis) - np.mean(base, axis=axis)) - 1.0


@dataclass(frozen=True)
class Judged:
    kl: Estimate | None
    top1: Estimate | None
    change: Estimate | None
    buckets: tuple[QualityBucket, ...]


def _span(value: PerPosition, base: PerPosition, cols: slice, seed: int) -> tuple[Estimate, Estimate, Estimate]:
    """The three figures over the positions ``cols`` (each document's mean, then the interval over documents)."""
    assert value.kl is not None and value.agree is not None
    kl = np.asarray(value.kl)[:, cols].mean(1)
    top1 = np.asarray(value.agree, dtype=float)[:, cols].mean(1)
    nll, ref = np.asarray(value.nll)[:, cols].mean(1), np.asarray(base.nll)[:, cols].mean(1)
    return (_interval((kl,), _mean, seed), _interval((top1,), _mean, seed + 1),
            _interval((nll, ref), _ppl_change, seed + 2))


def edges(length: int) -> list[tuple[int, int]]:
    """Context buckets (first, last context length, inclusive) over positions 1 … ``length``: 1–64, 65–128, …"""
    out, start, end = [], 1, FIRST_EDGE
    while start <= length:
        out.append((start, min(end, length)))
        start, end = end + 1, end * 2
    return out


def judge(value: PerPosition, base: PerPosition, split: int, seed: int = 0) -> Judged:
    """The continuation's figures (positions from ``split``: the perplexity's) and each context bucket's."""
    if value.kl is None:
        return Judged(None, None, None, ())
    positions = len(value.nll[0])  # position j: a context of j + 1 tokens
    kl, top1, change = _span(value, base, slice(split - 1, positions), seed)
    buckets = []
    for first, last in edges(positions):
        b = _span(value, base, slice(first - 1, last), seed)
        buckets.append(QualityBucket(first, last, len(value.nll) * (last - first + 1), *b))
    return Judged(kl, top1, change, tuple(buckets))


__all__ = ["PerPosition", "chunk_path", "edges", "joined", "judge", "kl_divergence", "per_position", "write_reference"]
