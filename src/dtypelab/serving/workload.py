"""The generation workload: prefill a prompt into a KV cache, then decode greedily one token per step, as a server
runs one batch of requests; and its quality on held-out text against another policy's.

The model is a causal language model with transformers' interface (``model(input_ids=..., past_key_values=cache,
use_cache=True, logits_to_keep=1)`` returning ``.logits``): a Hugging Face model, or a task file's model that takes
the same call. The prefill keeps the last position's logits only (``logits_to_keep=1``, what ``generate`` does),
so the logits it materializes are batch x vocabulary, not batch x prompt x vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from dtypelab.core.errors import DtypelabError
from dtypelab.core.executorch_lm import PteLM
from dtypelab.serving.kv import KVFormat, geometry, make_cache


@dataclass(frozen=True)
class Shape:
    """One batch of requests: ``batch_size`` prompts of ``prompt_len`` tokens, each continued by ``gen_len``."""

    prompt_len: int
    gen_len: int
    batch_size: int

    @property
    def context(self) -> int:
        return self.prompt_len + self.gen_len


def _logits(out: Any) -> torch.Tensor:
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    return logits


def _call(model: Any, ids: torch.Tensor, cache: Any, keep: int | None) -> torch.Tensor:
    kwargs: dict[str, Any] = {"past_key_values": cache, "use_cache": True}
    if keep is not None:
        kwargs["logits_to_keep"] = keep
    return _logits(model(input_ids=ids, **kwargs))


def compute_dtype(model: Any, config: Any, device: torch.device) -> torch.dtype:
    """The dtype the model's attention hands its cache (its keys and values): found by running one token (a
    program that holds its cache says)."""
    from transformers.cache_utils import DynamicCache

    if isinstance(model, PteLM):
        return model.dtype

    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor):
            return keys.dtype
    raise DtypelabError("the model filled no key/value cache: is it a causal language model with transformers' "
                        "cache interface?")


def new_cache(config: Any, fmt: KVFormat, shape: Shape, dtype: torch.dtype, device: torch.device,
              scales: list[tuple[float, float]] | None = None, model: Any = None) -> Any:
    """A cache for ``shape``'s whole context, allocated now (as a server reserves it before the first request);
    ``scales``: each layer's calibrated (key, value) scales, where the format takes them. A program that holds its
    cache (``model``) gives its own, started over."""
    if isinstance(model, PteLM):
        return model.new_cache(shape.batch_size, shape.context)
    cache = make_cache(config, fmt, shape.context, scales)
    kv_heads, head_dim = geometry(config)
    for layer in cache.layers:
        layer.allocate(shape.batch_size, kv_heads, head_dim, dtype, device)
    return cache


def prefill(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """The prompt into the cache; the first generated token of each sequence, (batch, 1)."""
    return _call(model, ids, cache, 1)[:, -1].argmax(-1, keepdim=True)


def decode(model: Any, token: torch.Tensor, cache: Any) -> torch.Tensor:
    """One step: the next token of each sequence from the last one and the cache."""
    return _call(model, token, cache, 1)[:, -1].argmax(-1, keepdim=True)


@dataclass(frozen=True)
class Generated:
    tokens: torch.Tensor  # (batch, gen_len): the greedy continuation, the prefill's token first
    ttft_s: float  # the prefill and its first token
    decode_s: float  # the gen_len - 1 decode steps after it


def generate(model: Any, ids: torch.Tensor, gen_len: int, cache: Any, sync: Callable[[], None]) -> Generated:
    """Prefill ``ids`` then decode ``gen_len - 1`` more tokens, timed (``sync`` waits for the device)."""
    sync()
    start = time.perf_counter()
    token = prefill(model, ids, cache)
    sync()
    first = time.perf_counter()
    out = [token]
    for _ in range(gen_len - 1):
        token = decode(model, token, cache)
        out.append(token)
    sync()
    end = time.perf_counter()
    return Generated(torch.cat(out, dim=1).cpu(), first - start, end - first)


@dataclass(frozen=True)
class Scored:
    nats: float  # mean negative log-likelihood of the continuation's tokens
    argmax: torch.Tensor  # (n, continuation): the predicted next token at each position
    logprobs: torch.Tensor  # (n, length - 1, vocab): every position's next-token log-probabilities, float32


def score(model: Any, windows: torch.Tensor, prompt_len: int, cache: Any) -> Scored:
    """Held-out ``windows`` (n, length) read through the cache: the first ``prompt_len`` tokens prefilled, the rest
    fed as one more chunk, so that every continuation position attends to keys and values the cache stored (in its
    format). Every position is scored (the prefill's logits kept whole); the continuation's make the perplexity."""
    first = _call(model, windows[:, :prompt_len], cache, 0)
    rest = _call(model, windows[:, prompt_len:-1], cache, None) if windows.shape[1] > prompt_len + 1 else first[:, :0]
    logprobs = F.log_softmax(torch.cat([first, rest], dim=1).float(), dim=-1)[:, :windows.shape[1] - 1]
    cont = logprobs[:, prompt_len - 1:]
    target = windows[:, prompt_len:]
    nats = F.nll_loss(cont.reshape(-1, cont.shape[-1]), target.reshape(-1)).item()
    return Scored(nats, cont.argmax(-1).cpu(), logprobs.cpu())


def first_divergence(tokens: torch.Tensor, reference: torch.Tensor) -> tuple[float, int]:
    """The mean position where each greedy continuation first differs from the reference's (its length where it
    never does), and how many differ anywhere."""
    differs = tokens != reference
    length = tokens.shape[1]
    firsts = [int(row.nonzero()[0]) if row.any() else length for row in differs]
    return sum(firsts) / len(firsts), sum(1 for f in firsts if f < length)


__all__ = ["Generated", "Scored", "Shape", "compute_dtype", "decode", "first_divergence", "generate", "new_cache",
           "prefill", "score"]
