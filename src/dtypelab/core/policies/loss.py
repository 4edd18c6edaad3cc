"""The loss as a choice (``POLICY+chunked-ce``): how a language model's output projection and cross-entropy are
computed, which decides in which dtype its logits live and how many of them exist at once.

- the task's own loss (no modifier): an ``hf:`` causal language model's is Hugging Face's, which projects every
  position to the whole vocabulary and upcasts all the logits to float32 before the cross-entropy: batch × sequence ×
  vocabulary × 4 bytes kept for the backward, and the bfloat16 logits and their float32 copy beside them while it runs.
- ``+chunked-ce`` (``+chunked-ceN``: N chunks, 8 by default): torchtune's ``LinearCrossEntropyLoss``. The positions
  are split into N chunks; each chunk is projected and its logits upcast to float32 and summed into the
  cross-entropy on their own, so that only one chunk's logits and their float32 copy exist at a time. What autograd
  keeps (each chunk's float32 log-probabilities) is the same; the transients are a chunk's. Under a plan that
  compiles (``+compile``), each chunk's cross-entropy is the one torch.compile makes (``FusedChunk``): it keeps the
  logits in their own dtype and a log-sum-exp per position instead of float32 log-probabilities.

A task offers the loss's inputs through ``Task.head_inputs`` (the last hidden states, the output projection and the
targets each position predicts); a task without it cannot take a loss choice, said in one line.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.errors import DtypelabError

IGNORE_INDEX = -100  # the target of a position with none (Hugging Face's and torchtune's convention)
DEFAULT_CHUNKS = 8  # torchtune's num_output_chunks
_LABEL = re.compile(r"chunked-ce(\d*)")


@dataclass(frozen=True)
class HeadInputs:
    """What a language model's loss is computed from: ``hidden`` (batch, positions, features), ``project`` (hidden
    states to logits: the output projection and whatever the model does to its logits after it, such as Gemma-2's
    soft-capping) and ``targets`` (batch, positions; ``IGNORE_INDEX`` where a position predicts nothing)."""

    hidden: torch.Tensor
    project: Callable[[torch.Tensor], torch.Tensor]
    targets: torch.Tensor


@dataclass(frozen=True)
class LossChoice:
    """A loss computed from ``HeadInputs`` in ``chunks`` chunks of the positions; ``compiled``: each chunk's
    cross-entropy as torch.compile makes it (``FusedChunk``), for a plan that compiles."""

    chunks: int = DEFAULT_CHUNKS
    compiled: bool = False

    @property
    def label(self) -> str:
        return "chunked-ce" + ("" if self.chunks == DEFAULT_CHUNKS else str(self.chunks))

    def describe(self) -> str:
        return (f"output projection and cross-entropy in {self.chunks} chunks, each chunk's logits upcast to float32 "
                "on their own (torchtune's LinearCrossEntropyLoss)")

    def __call__(self, inputs: HeadInputs) -> torch.Tensor:
        return chunked_cross_entropy(inputs, self.chunks, self.compiled)


def _inside(module: Any) -> Any:
    """What a wrapper holds: dtypelab's (``_lab_module``), peft's (its base model), torch.compile's (``_orig_mod``);
    None for a module that wraps nothing."""
    base = getattr(module, "get_base_model", None)
    if callable(base) and base() is not module:
        return base()
    return module.__dict__.get("_lab_module") or module.__dict__.get("_modules", {}).get("_orig_mod")


def language_model(model: nn.Module) -> Any:
    """The Hugging Face language model inside what dtypelab, peft and torch.compile wrapped it in (what has an output
    projection: ``get_output_embeddings``), or None."""
    seen: Any = model
    while seen is not None:
        heads = getattr(seen, "get_output_embeddings", None)
        if hasattr(seen, "get_decoder") and callable(heads) and heads() is not None:
            return seen
        seen = _inside(seen)
    return None


def logit_width(model: nn.Module) -> int:
    """The width of a language model's logits (its vocabulary, as its output projection has it), or 0 for a model
    with no output projection dtypelab can find (a Hugging Face one's, or a top-level ``lm_head`` / ``head`` /
    ``output`` Linear wider than its input)."""
    lm = language_model(model)
    head = lm.get_output_embeddings() if lm is not None else None
    inner: Any = model
    while head is None and inner is not None:
        head = next((getattr(inner, n) for n in ("lm_head", "head", "output")
                     if isinstance(getattr(inner, n, None), nn.Module)), None)
        inner = _inside(inner)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0
    width, features = int(weight.shape[0]), int(weight.shape[1])
    return width if width > features else 0


@functools.cache
def loss_choice(label: str, compiled: bool = False) -> LossChoice:
    """``chunked-ce`` or ``chunked-ceN`` as a LossChoice (``compiled``: for a plan that compiles); anything else is
    one line."""
    m = _LABEL.fullmatch(label)
    if m is None:
        raise DtypelabError(f"unknown loss {label!r}: chunked-ce (8 chunks) or chunked-ceN (N chunks)")
    chunks = int(m.group(1) or DEFAULT_CHUNKS)
    if not 1 <= chunks <= 1024:
        raise DtypelabError(f"+{label}: the number of chunks is 1 to 1024")
    return LossChoice(chunks, compiled)


def is_loss_label(label: str) -> bool:
    return _LABEL.fullmatch(label) is not None


class FusedChunk(torch.autograd.Function):
    """One chunk's summed cross-entropy as torch.compile makes it: for the backward it keeps the logits in their own
    dtype and one float32 log-sum-exp per position, and recomputes the float32 softmax there (inductor's partitioner
    recomputes the upcast and the exponentials rather than keep float32 log-probabilities: half the bytes at bfloat16).
    Run eagerly (a forecast's trace), each float32 intermediate lives one chunk's step, as chunking bounds it."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        wide = logits.float()
        lse = torch.logsumexp(wide, dim=-1)
        valid = targets != IGNORE_INDEX
        picked = wide.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
        ctx.save_for_backward(logits, lse, targets)
        return ((lse - picked) * valid).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse, targets = ctx.saved_tensors
        probs = torch.exp(logits.float() - lse[:, None])
        probs.scatter_add_(-1, targets.clamp(min=0)[:, None], -torch.ones_like(lse)[:, None])  # less the one-hot
        probs *= ((targets != IGNORE_INDEX) * grad)[:, None]
        return probs.to(logits.dtype), None


def chunked_cross_entropy(inputs: HeadInputs, chunks: int, compiled: bool = False) -> torch.Tensor:
    """The mean cross-entropy over the positions with a target, computed chunk by chunk along the positions
    (``tensor_split`` into ``chunks``, torchtune's split). Positions without a target are left to ``ignore_index``
    rather than dropped first as torchtune does: the same value, and a shape that does not depend on the data, which
    a forecast's fake tensors need (a task gives aligned targets without the last position: nothing to drop)."""
    targets = inputs.targets.reshape(-1)
    hidden = inputs.hidden.reshape(-1, inputs.hidden.shape[-1])
    total: Any = 0.0
    for h, t in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks), strict=True):
        logits = inputs.project(h)
        total = total + (FusedChunk.apply(logits, t) if compiled else
                         F.cross_entropy(logits.float(), t, reduction="sum", ignore_index=IGNORE_INDEX))
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


__all__ = ["DEFAULT_CHUNKS", "IGNORE_INDEX", "FusedChunk", "HeadInputs", "LossChoice", "chunked_cross_entropy",
           "is_loss_label", "language_model", "logit_width", "loss_choice"]
