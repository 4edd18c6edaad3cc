"""``WeightQuant``: weight-only integer formats emulated in float, for their numerics (no speed: their kernels are a
GPU's), by the method users quantize with.

- ``w4a16-rtn`` / ``w4a16-gptq`` / ``w4a16-awq`` (and ``w8a16-*``): compressed-tensors' symmetric int4 (int8) weights,
  a bfloat16 scale per group of 128 inputs (per output channel for int8), bfloat16 activations: what llm-compressor
  writes and vLLM serves with Marlin or Machete. GPTQ and AWQ read calibration text (``core.calibration``; bench
  --mode generate gives it); the methods are ``core.weightquant``'s.
- ``int4-wo-emu``: torchao's int4 weight-only (``int4-wo``, tinygemm: asymmetric, a bfloat16 scale and zero point per
  group of 128, in its float zero-point domain), through torchao's own tinygemm quantize and dequantize primitives;
  what bench measures in place of ``int4-wo``, whose kernel this CPU lacks.
- ``int8-wo-emu``: torchao's int8 weight-only, its ``Int8Tensor``'s own dequantized weight: checked against the real
  ``int8-wo`` kernel here (tests/test_weight_quant.py).

A converted layer stays an ``nn.Linear`` whose weight holds the dequantized values (its scales beside it as the
buffer ``weight_scale``, what ``inference.compressed`` writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dtypelab.core.backends import quiet, torchao_missing, torchao_module
from dtypelab.core.calibration import calibration
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, Facts
from dtypelab.core.policies.registry import in_default, register, register_emulation
from dtypelab.core.weightquant import IntFormat, quantize_layers

METHODS = {"rtn": "round-to-nearest", "gptq": "GPTQ (calibrated: each column's rounding error spread over the rest)",
           "awq": "AWQ (calibrated: activation-aware scales folded in before round-to-nearest)"}
LAYOUTS = {"w4a16": IntFormat(4, 128), "w8a16": IntFormat(8, None), "tinygemm": IntFormat(4, 128),
           "int8-wo": IntFormat(8, None)}
TORCHAO_LAYOUTS = ("tinygemm", "int8-wo")  # torchao's own formats: round-to-nearest only
# the kernel key a GPU serves each with (serving.kernels): int4 by Marlin/Machete (vLLM) or tinygemm; compressed-
# tensors' int8 by vLLM's Marlin, whose 8-bit decode no published table gives (a bfloat16 GEMM reading its bytes)
GPU_KERNEL = {"w4a16": "int4-weight-only", "tinygemm": "int4-weight-only", "w8a16": "w8a16-marlin",
              "int8-wo": "int8-weight-only"}


@dataclass(frozen=True)
class WeightQuant(Config):
    """Inference only: each ``nn.Linear`` it covers holds its format's dequantized weight (numerics only)."""

    kind: ClassVar[str] = "weight-quant"
    layout: str = "w4a16"
    method: str = "rtn"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise DtypelabError(f"weight-quant: unknown layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")
        if self.method not in METHODS:
            raise DtypelabError(f"weight-quant: unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.layout in TORCHAO_LAYOUTS and self.method != "rtn":
            raise DtypelabError(f"weight-quant: torchao's {self.layout} rounds to nearest only")

    @property
    def fmt(self) -> IntFormat:
        return LAYOUTS[self.layout]

    @property
    def calibrated(self) -> bool:
        return self.method != "rtn"

    @property
    def facts(self) -> Facts:
        wide = "float32" if self.layout == "int8-wo" else "bfloat16"
        return Facts(modes=("infer",), compute_dtype=wide, storage_dtype=wide, emulated=True, numerics_only=True,
                     gpu_kernel=True,
                     speed_needs="a GPU's int4/int8 weight-only kernel (tinygemm; vLLM's Marlin or Machete)",
                     backend="torchao" if self.layout in TORCHAO_LAYOUTS else "dtypelab (compressed-tensors' format)",
                     arithmetic=f"emulated: {self.describe()}, dequantized to {wide} for every matmul")

    @property
    def label(self) -> str:
        if self.layout in TORCHAO_LAYOUTS:
            return {"tinygemm": "int4-wo", "int8-wo": "int8-wo"}[self.layout] + "-emu"
        return f"{self.layout}-{self.method}"

    def describe(self) -> str:
        fmt = self.fmt
        scales = f"groups of {fmt.group}" if fmt.group else "per output channel"
        if self.layout == "tinygemm":
            return "int4 weights (tinygemm: asymmetric, bfloat16 scale and zero point per group of 128), emulated"
        if self.layout == "int8-wo":
            return "int8 weights (torchao int8 weight-only, per channel), emulated"
        return f"int{fmt.bits} weights (symmetric, {scales}), bfloat16 activations, {METHODS[self.method]}, emulated"

    def supported(self, hw: HardwareInfo) -> str | None:
        return torchao_missing() if self.layout in TORCHAO_LAYOUTS else None

    def unfit(self, layer: nn.Linear) -> str | None:
        if not self.fmt.fits(layer):
            return f"{layer.out_features}×{layer.in_features}: the input width is not a multiple of {self.fmt.group}"
        return None

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        modules = dict(model.named_modules())
        linears = [n for n in names if isinstance(modules[n], nn.Linear)]
        kept = self.leaves(model)
        unfit = {n: why for n in linears if (why := HEAD if n in kept else self.unfit(modules[n]))}
        chosen = [n for n in linears if n not in unfit]
        report: dict[str, Any] = {"format": self.label, "converted": chosen,
                                  "left_out": [{"layer": n, "why": why} for n, why in unfit.items()]}
        if not chosen:
            return model, report
        if modules[chosen[0]].weight.is_meta:  # a forecast's trace: its stand-in counts the layout (stored_bytes)
            raise NotImplementedError(f"{self.label} is emulated in float: its stored layout is counted instead")
        if self.layout in TORCHAO_LAYOUTS:
            for n in chosen:
                _torchao_roundtrip(modules[n], self.layout)
            return model, report
        feed = calibration() if self.calibrated else None
        if self.calibrated and feed is None:
            raise DtypelabError(f"{self.label} needs calibration data, which this command does not give it: bench "
                                "(--mode generate: text; --mode infer: the task's inputs), tune and export do")
        plain = quantize_layers(model, dict.fromkeys(chosen, self.fmt), self.method, feed)
        if plain:
            report["notes"] = [f"rounded to nearest, not balanced by AWQ: {', '.join(plain)} (AWQ knows the Llama "
                               "family's mappings: a norm or linear layer that feeds these layers alone)"]
        return model, report

    def leaves(self, model: nn.Module) -> set[str]:
        """The output head (compressed-tensors' layouts: llm-compressor ignores it, vLLM serves it unquantized;
        torchao's policies convert it too)."""
        if self.layout in TORCHAO_LAYOUTS:
            return set()
        head = _head(model)
        return {n for n, m in model.named_modules(remove_duplicate=False) if head is not None and m is head and n}

    # --- what it stores and runs on a GPU (the forecasts' adapters read these) ---
    def stored_bytes(self, layer: nn.Module) -> int | None:
        """compressed-tensors' pack-quantized layout: the codes packed in int32, a bfloat16 scale per group (per
        channel); tinygemm's as ``int4-wo`` stores it; torchao's int8: codes and a scale per channel."""
        if not isinstance(layer, nn.Linear) or self.unfit(layer):
            return None
        n, k = layer.out_features, layer.in_features
        if self.layout == "tinygemm":
            n_pad, k_pad = -(-n // 8) * 8, -(-k // 1024) * 1024
            return n_pad * k_pad // 2 + (k_pad // 128) * n_pad * 2 * 2
        groups = k // self.fmt.group if self.fmt.group else 1
        scale_bytes = 4 if self.layout == "int8-wo" else 2
        return n * k * self.fmt.bits // 8 + n * groups * scale_bytes

    def kernel(self, layer: nn.Module) -> str | None:
        if not isinstance(layer, nn.Linear) or self.unfit(layer):
            return None
        return GPU_KERNEL[self.layout]


HEAD = "the output head stays as it is (llm-compressor's recipes ignore it; vLLM serves it unquantized)"


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else dict(model.named_modules()).get("lm_head")


def _torchao_roundtrip(layer: nn.Linear, layout: str) -> None:
    """The layer's weight as torchao's format dequantizes it: tinygemm's primitives, or int8's own tensor."""
    w = layer.weight.detach()
    with torch.no_grad():
        if layout == "int8-wo":
            probe = nn.Linear(layer.in_features, layer.out_features, bias=False)
            probe.weight.data = w.float().clone()
            with quiet():
                torchao_module("quantization").quantize_(probe, torchao_module("quantization").Int8WeightOnlyConfig(
                    set_inductor_config=False))
            layer.weight.copy_(probe.weight.dequantize().to(w.dtype))
            return
        p = torchao_module("quantization.quant_primitives")
        mapping = p.MappingType.ASYMMETRIC
        hp, block = w.to(torch.bfloat16), (1, 128)
        scale, zero = p._choose_qparams_affine_tinygemm(hp, mapping, block, torch.int32, 0, 15, None, torch.bfloat16,
                                                        torch.bfloat16)
        q = p._quantize_affine_tinygemm(hp, block, scale, zero, torch.int32, 0, 15)
        deq = p._dequantize_affine_tinygemm(q, block, scale, zero, torch.int32, 0, 15, output_dtype=torch.bfloat16)
        layer.weight.copy_(deq.to(w.dtype))


for _i, _method in enumerate(METHODS):
    register(f"w4a16-{_method}", WeightQuant("w4a16", _method), sweeps=frozenset(), rank=23 + _i / 10)
    register(f"w8a16-{_method}", WeightQuant("w8a16", _method), sweeps=frozenset(), rank=23.5 + _i / 10)
register("int4-wo-emu", WeightQuant("tinygemm"), sweeps=frozenset(), rank=22.5)
register("int8-wo-emu", WeightQuant("int8-wo"), sweeps=frozenset(), rank=13.5)
register_emulation("int4-wo", "int4-wo-emu")
# measured by bench --mode generate by default, after the other weight formats: int4 (torchao's, as its emulation
# here) and compressed-tensors' int4 by round-to-nearest, GPTQ and AWQ
for _name, _rank in (("int4-wo", 5.1), ("w4a16-rtn", 5.2), ("w4a16-gptq", 5.3), ("w4a16-awq", 5.4)):
    in_default("serve-measured", _name, _rank)
register_emulation("int8-wo", "int8-wo-emu")

__all__ = ["LAYOUTS", "METHODS", "WeightQuant"]
