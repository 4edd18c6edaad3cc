"""What emulated float8 training does to each layer it converts: the float8 (e4m3) quantize-dequantize of a matmul's
operands as torchao's recipes scale them, written out by hand (the reference the tests check torchao's emulation
against), and per converted layer its output's SQNR against bfloat16 on the same input and the share of its input's
and weight's values that flush to zero.

Scaling, as torchao's recipes do it: ``tensorwise``, one scale per tensor, ``448 / amax``; ``rowwise`` (and the
forward of ``rowwise_with_gw_hp``), one scale per row of the input (per token) and per output row of the weight,
rounded down to a power of two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
EPS = 1e-12  # torchao's floor on amax (an all-zero row scales to something finite)


def float8_roundtrip(x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """``x`` quantized to float8 e4m3 with its recipe's scale and back, in float32."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = E4M3_MAX / amax.clamp(min=EPS)
    if rowwise:  # torchao's rowwise recipes round their scales down to a power of two
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() / scale


def float8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            rowwise: bool) -> torch.Tensor:
    """A float8 Linear's forward as emulated: both operands round-tripped through float8, multiplied in float32."""
    out = float8_roundtrip(x.reshape(-1, x.shape[-1]), rowwise) @ float8_roundtrip(weight, rowwise).T
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out + bias.float() if bias is not None else out


def _underflow(x: torch.Tensor, roundtrip: Callable[[torch.Tensor], torch.Tensor]) -> float:
    x = x.float().reshape(-1, x.shape[-1])
    nonzero = x != 0
    flushed = (roundtrip(x) == 0) & nonzero
    return float(flushed.sum()) / max(1, int(nonzero.sum()))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor (torchao wraps an MX-trained one in a subclass that holds it)."""
    while type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float | None:
    """The median over rows (tokens, samples) of each row's SQNR in dB: a few rows of huge values would own a
    whole-tensor SQNR and hide what the format did to all the others."""
    ref, out = ref.double().reshape(-1, ref.shape[-1]), out.double().reshape(-1, out.shape[-1])
    noise, signal = (ref - out).square().sum(1), ref.square().sum(1)
    if not bool(torch.isfinite(noise).all() and torch.isfinite(signal).all()):
        return None
    per_row = 10 * torch.log10(signal / noise)  # inf where a row is exact, -inf where its reference is zero
    return float(per_row.median())


def emulated_layers(model: nn.Module, run: Any, recipe: str, names: list[str] | None = None,
                    roundtrip: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[dict[str, Any]]:
    """Per converted layer of ``model`` (``names``; by default torchao's ``Float8Linear`` modules, whose values go
    through ``roundtrip``, by default the float8 recipe's), on the inputs ``run()`` (one forward pass)
    gives it: ``sqnr_db`` of its emulated output against the bfloat16 matmul of the same input and weight (the
    median over rows of each row's SQNR), and the
    shares of its input's and weight's non-zero values that flush to zero in float8 with the recipe's scales."""
    rowwise = recipe != "tensorwise"
    roundtrip = roundtrip or (lambda x: float8_roundtrip(x, rowwise))
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:  # None: the output stays
            seen.setdefault(name, (args[0].detach(), out.detach()))
        return hook

    hooks = [module.register_forward_hook(keep(name)) for name, module in model.named_modules()
             if (name in names if names is not None else type(module).__name__ == "Float8Linear")]
    try:
        run()  # as training runs it (torchao's MX layers take another path without autograd); the graph is dropped
    finally:
        for h in hooks:
            h.remove()
    modules = dict(model.named_modules())
    rows = []
    for name, (x, out) in seen.items():
        w, b = _plain(modules[name].weight.detach()), modules[name].bias
        b = _plain(b.detach()) if b is not None else None
        with torch.no_grad():
            ref = F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16),
                           b.to(torch.bfloat16) if b is not None else None)
        rows.append({"layer": name, "shape": f"{w.shape[0]}×{w.shape[1]}", "sqnr_db": _sqnr(ref, out),
                     "input_underflow": _underflow(x, roundtrip), "weight_underflow": _underflow(w, roundtrip)})
    return rows
