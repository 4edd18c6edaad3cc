"""Weight-only quantization in float, as the field's tools do it (numerics only: a layer's weight becomes the exact
values its format's kernel would dequantize): round-to-nearest, GPTQ and AWQ.

The format is compressed-tensors' integer one (what llm-compressor writes and vLLM's Marlin/Machete kernels read):
symmetric, ``scale = amax / ((2^bits - 1) / 2)`` per group of input columns (per output channel without groups),
``q = clamp(round(w / scale), -2^(bits-1), 2^(bits-1) - 1)``, the weight ``q × scale`` in the scale's dtype (the
model's), so that a checkpoint written from it decompresses to the same values bit for bit.

- **GPTQ** (Frantar et al. 2022, as llm-compressor's ``GPTQModifier`` runs it): the group scales from the original
  weight; a damped Hessian ``2/N XᵀX`` of the layer's calibration inputs; columns quantized in order in blocks of 128,
  each column's error, divided by its inverse-Hessian diagonal, spread over the columns still to come.
- **AWQ** (Lin et al. 2023, as llm-compressor's ``AWQModifier`` with ``duo_scaling``): per input channel of the layers
  that share an input, ``s = x̄^α / w̄^(1-α)`` (the activations' mean magnitude, the weights' group-normalized
  magnitude), ``α`` searched on a grid of 20 for the least error of those layers' outputs, ``s`` multiplied into them
  and divided out of what feeds them (the norm before, or the linear layer before), then round-to-nearest. The loss
  is the balanced layers' own outputs (llm-compressor's is their parent module's output).

Both run layer group by layer group (a decoder layer's), each group's inputs taken with the groups before it already
quantized, as llm-compressor's sequential pipeline does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.calibration import Feed

GPTQ_BLOCK = 128  # columns per lazy-update block (GPTQ's and llm-compressor's default)
GPTQ_DAMP = 0.01  # dampening: this share of the Hessian's mean diagonal added to it (llm-compressor's default)
AWQ_GRID = 20  # α values tried (llm-compressor's n_grid)


@dataclass(frozen=True)
class IntFormat:
    """A symmetric integer weight format: ``bits``, a scale per ``group`` input columns (None: per output channel)."""

    bits: int = 4
    group: int | None = 128

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def fits(self, layer: nn.Linear) -> bool:
        return self.group is None or layer.in_features % self.group == 0


def scales(w: torch.Tensor, fmt: IntFormat, dtype: torch.dtype) -> torch.Tensor:
    """One scale per output row and group, ``(n, k / group)`` (``(n, 1)`` per channel), in ``dtype``."""
    n, k = w.shape
    grouped = w.float().reshape(n, -1, fmt.group or k)
    amax = grouped.abs().amax(-1)
    return (amax / ((2 ** fmt.bits - 1) / 2)).clamp(min=torch.finfo(dtype).tiny).to(dtype)


def _expand(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.repeat_interleave(k // scale.shape[1], dim=1)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """``w`` (columns of it: ``scale`` broadcast to them) rounded to the format and back, in the scale's dtype (the
    division too, as compressed-tensors divides: in bfloat16 a quotient can round to a tie that float32's would not
    reach)."""
    s = scale if scale.shape == w.shape else _expand(scale, w.shape[1])
    q = torch.clamp(torch.round(w.to(scale.dtype) / s), -fmt.qmax - 1, fmt.qmax)
    return q * s


def rtn(w: torch.Tensor, fmt: IntFormat, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: (the dequantized weight, its scales)."""
    s = scales(w, fmt, dtype)
    return fake_quantize(w, s, fmt), s


def gptq(w: torch.Tensor, hessian: torch.Tensor, fmt: IntFormat, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """GPTQ's column-by-column rounding of ``w`` (n × k) under ``hessian`` (k × k, ``2/N XᵀX``): (the dequantized
    weight, its scales: the original weight's)."""
    s = scales(w, fmt, dtype)
    W, H = w.float().clone(), hessian.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += GPTQ_DAMP * torch.mean(torch.diag(H)) * torch.eye(len(H), dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    k = W.shape[1]
    full = _expand(s, k)
    for i1 in range(0, k, GPTQ_BLOCK):
        i2 = min(i1 + GPTQ_BLOCK, k)
        W1, Err = W[:, i1:i2].clone(), torch.zeros(W.shape[0], i2 - i1)
        Hb = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = W1[:, i]
            q = fake_quantize(col[:, None], full[:, i1 + i:i1 + i + 1], fmt)[:, 0].float()
            err = (col - q) / Hb[i, i]
            W1[:, i:] -= err[:, None] * Hb[i, i:][None, :]
            W1[:, i] = q
            Err[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    return fake_quantize(W, s, fmt), s  # W's columns are on the grid already: this only casts them


# --- calibration inputs, layer group by layer group ------------------------------------------------------------------

def groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """``names`` in module order, grouped by the block that holds them (a decoder layer: ``model.layers.3``)."""
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    out: dict[str, list[str]] = {}
    for n in sorted(names, key=order.__getitem__):
        out.setdefault(n.rsplit(".", 2)[0] if n.count(".") >= 2 else "", []).append(n)
    return list(out.values())


@contextmanager
def _inputs(modules: dict[str, nn.Module], each: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """While open, every call of one of ``modules`` gives ``each(name, its input as rows)``."""
    def hook(name: str) -> Any:
        def seen(module: nn.Module, args: tuple[Any, ...]) -> None:
            each(name, args[0].detach().reshape(-1, args[0].shape[-1]).float())
        return seen

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def hessians(model: nn.Module, layers: dict[str, Any], calibration: Feed) -> dict[str, torch.Tensor]:
    """Each layer's ``2/N XᵀX`` over the calibration tokens it sees (float64 sums)."""
    sums = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in layers.items()}
    counts = dict.fromkeys(layers, 0)

    def add(name: str, x: torch.Tensor) -> None:
        sums[name] += x.double().T @ x.double()
        counts[name] += len(x)

    with _inputs(layers, add):
        calibration(model)
    return {n: 2 * sums[n] / max(1, counts[n]) for n in layers}


def _set(layer: nn.Linear, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """The layer's weight as its dequantized values; its scales kept beside it (what an export writes)."""
    with torch.no_grad():
        layer.weight.copy_(weight.to(layer.weight.dtype))
    if "weight_scale" in layer._buffers:
        layer._buffers["weight_scale"] = scale
    else:
        layer.register_buffer("weight_scale", scale, persistent=False)


@torch.no_grad()
def quantize_layers(model: nn.Module, formats: dict[str, IntFormat], method: str,
                    calibration: Feed | None) -> list[str]:
    """Every layer in ``formats`` quantized by ``method`` (rtn, gptq, awq), group by group; the layers AWQ found no
    mapping for (not a Llama-family decoder layer: rounded to nearest)."""
    modules: dict[str, Any] = dict(model.named_modules())
    plain: list[str] = []
    for group in groups(model, list(formats)):
        layers = {n: modules[n] for n in group}
        if method == "awq" and calibration is not None:
            balanced = awq_group(model, layers, formats, calibration)
            plain += [n for n in group if n not in balanced]
        h = hessians(model, layers, calibration) if method == "gptq" and calibration is not None else {}
        for n, layer in layers.items():
            dtype = layer.weight.dtype
            done = gptq(layer.weight, h[n], formats[n], dtype) if n in h else rtn(layer.weight, formats[n], dtype)
            _set(layer, *done)
    return plain


# --- AWQ --------------------------------------------------------------------------------------------------------------

# (what feeds the layers, the layers that share its output) in a Llama-family decoder layer, as llm-compressor's
# default mappings name them
AWQ_MAPPINGS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                ("self_attn.v_proj", ("self_attn.o_proj",)),
                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                ("mlp.up_proj", ("mlp.down_proj",)))


def mappings(layers: dict[str, Any], modules: dict[str, Any]) -> list[tuple[Any, list[str]]]:
    """The AWQ mappings present among ``layers``: (the module that feeds them, their names); one whose feeder's
    outputs are not the layers' inputs one for one (grouped-query attention's v_proj → o_proj) is left out, as
    llm-compressor leaves it."""
    if not layers:
        return []
    block = next(iter(layers)).rsplit(".", 2)[0]
    out = []
    for feeder, balanced in AWQ_MAPPINGS:
        names = [f"{block}.{b}" for b in balanced]
        source = modules.get(f"{block}.{feeder}")
        if source is None or not all(n in layers for n in names):
            continue
        width = source.weight.shape[0]
        if all(layers[n].in_features == width for n in names):
            out.append((source, names))
    return out


def awq_group(model: nn.Module, layers: dict[str, Any], formats: dict[str, IntFormat],
              calibration: Feed) -> set[str]:
    """AWQ's scales for each mapping among ``layers``, folded in (their weights still in float: rounded after); the
    layers balanced."""
    modules: dict[str, Any] = dict(model.named_modules())
    found = mappings(layers, modules)
    heads = {names[0]: modules[names[0]] for _, names in found}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in heads}
    with _inputs(heads, lambda n, x: seen[n].append(x)):
        calibration(model)
    for source, names in found:
        x = torch.cat(seen[names[0]])
        balanced = [modules[n] for n in names]
        s = _best_scale(x, balanced, formats[names[0]])
        with torch.no_grad():
            for b in balanced:
                b.weight.mul_(s.to(b.weight.dtype)[None, :])
            source.weight.div_(s.to(source.weight.dtype).reshape(-1, *([1] * (source.weight.dim() - 1))))
            if getattr(source, "bias", None) is not None:
                source.bias.div_(s.to(source.bias.dtype))
    return {n for _, names in found for n in names}


def _best_scale(x: torch.Tensor, balanced: list[Any], fmt: IntFormat) -> torch.Tensor:
    """The α on the grid whose scales give the balanced layers' least output error on ``x``; its scales."""
    weights = [b.weight.float() for b in balanced]
    k = x.shape[1]
    w_cat = torch.cat(weights)
    grouped = w_cat.abs().reshape(len(w_cat), -1, fmt.group or k)
    w_mean = (grouped / grouped.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(len(w_cat), k).mean(0)
    x_mean = x.abs().mean(0)
    ref = [x @ w.T for w in weights]
    best, best_err = torch.ones(k), float("inf")
    dtype = balanced[0].weight.dtype
    for i in range(AWQ_GRID):
        alpha = i / AWQ_GRID
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = sum((float((x @ (rtn(w * s, fmt, dtype)[0].float() / s).T - r).pow(2).mean())
                   for w, r in zip(weights, ref, strict=True)), 0.0)
        if err < best_err:
            best, best_err = s, err
    return best


__all__ = ["AWQ_MAPPINGS", "IntFormat", "fake_quantize", "gptq", "groups", "hessians", "quantize_layers", "rtn",
           "scales"]
