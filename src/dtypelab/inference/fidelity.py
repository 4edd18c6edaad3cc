"""How far a converted model's outputs are from fp32's: SQNR, max abs error, per-sample cosine."""

from __future__ import annotations

import math
from typing import Any

import torch

from dtypelab.core.task import tensors


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 20·log10(‖ref‖/‖ref−test‖) in dB; inf when identical."""
    ref, err = reference.double(), reference.double() - test.double()
    noise = torch.linalg.vector_norm(err).item()
    if not math.isfinite(noise):
        return -math.inf
    return math.inf if noise == 0 else 20 * math.log10(torch.linalg.vector_norm(ref).item() / noise)


def flat(outputs: Any) -> torch.Tensor:
    """Every floating tensor in a nested output, flattened and joined (float64)."""
    parts = [t.reshape(-1).double() for t in tensors(outputs)]
    return torch.cat(parts) if parts else torch.zeros(0)


def per_sample(outputs: Any) -> torch.Tensor | None:
    """Outputs as (samples, features): the leading dimension of every tensor is the sample. None when the
    tensors disagree on it (then per-sample cosine has no meaning)."""
    parts = [t.reshape(t.shape[0], -1).double() if t.dim() else t for t in tensors(outputs)]
    if not parts or any(p.dim() != 2 or p.shape[0] != parts[0].shape[0] for p in parts):
        return None
    return torch.cat(parts, dim=1)


def compare(reference: Any, test: Any) -> dict[str, float]:
    """Fidelity of ``test`` vs ``reference`` outputs of the same inputs; {} when their shapes differ.

    ``cos_min``/``cos_mean``: cosine similarity of each sample's output vector with fp32's, the worst and
    the mean; for an embedding model this is the number that decides retrieval quality.
    """
    ref, got = flat(reference), flat(test)
    if ref.shape != got.shape or not ref.numel():
        return {}
    out = {"max_abs_err": (ref - got).abs().max().item(), "sqnr_db": sqnr_db(ref, got)}
    a, b = per_sample(reference), per_sample(test)
    if a is not None and b is not None and a.shape == b.shape and a.shape[1] > 1:
        cos = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-30)
        out.update(cos_min=cos.min().item(), cos_mean=cos.mean().item())
    return out


compare_outputs = compare  # the public name (``dtypelab.compare_outputs``)
