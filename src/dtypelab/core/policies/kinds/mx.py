"""MX formats (OCP microscaling: a shared power-of-two scale per block of 32 values), torchao's prototypes: ``MXTrain``
(mxfp8 training of the Linear layers, ``MXFP8TrainingOpConfig``) and ``MXInfer`` (mxfp8 / mxfp4 dynamic inference,
``MXDynamicActivationMXWeightConfig``). Their kernels need a Blackwell GPU (compute capability 10.0+); with
``emulate`` they run anywhere through torchao's emulated kernels (``KernelPreference.EMULATED``: dequantized operands,
float32 matmuls), for their numerics only. NVFP4 is not here: torchao 0.18's NVFP4 configs assert an sm_100 GPU even
to emulate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dtypelab.core.backends import quiet, torchao_missing, torchao_module
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, Emulable, Facts, cuda_missing
from dtypelab.core.policies.registry import in_default, register

MX_BLOCK = 32  # values sharing one scale; a Linear's dimensions must be multiples of it
MX_FLOOR = (10, 0)  # Blackwell: MX tensor cores
ELEMENTS = {"mxfp8": "float8_e4m3fn", "mxfp4": "float4_e2m1fn_x2"}
NEEDS = "a GPU with MX tensor cores (compute capability 10.0+: Blackwell)"


def _mx_unfit(module: nn.Linear) -> str | None:
    if module.in_features % MX_BLOCK or module.out_features % MX_BLOCK:
        return f"{module.out_features}×{module.in_features}: MX needs dimensions divisible by {MX_BLOCK}"
    return None


def _convert(model: nn.Module, names: list[str], config: Any, what: str) -> tuple[nn.Module, dict[str, Any]]:
    """``quantize_`` with ``config`` on the Linear layers called ``names`` whose shapes MX takes."""
    modules = dict(model.named_modules())
    chosen, left_out = set(), []
    for name in (n for n in names if isinstance(modules[n], nn.Linear)):
        why = _mx_unfit(modules[name])
        if why:
            left_out.append({"layer": name, "why": why})
        else:
            chosen.add(name)
    if chosen:
        with quiet():
            torchao_module("quantization").quantize_(model, config, filter_fn=lambda m, fqn: fqn in chosen)
    return model, {"format": what, "converted": sorted(chosen), "left_out": left_out}


def mx_roundtrip(x: torch.Tensor, elements: str = "mxfp8") -> torch.Tensor:
    """``x`` quantized to an MX format (blocks of 32 along its last dimension) and back, in float32 (torchao's)."""
    mx = torchao_module("prototype.mx_formats.mx_tensor")
    flat = x.float().reshape(-1, x.shape[-1])
    return mx.MXTensor.to_mx(flat, getattr(torch, ELEMENTS[elements]), MX_BLOCK).dequantize(torch.float32
                                                                                          ).reshape(x.shape)


def _mx_training_torch() -> str | None:
    """Why this torch cannot run torchao's mxfp8 training (its weights are DTensor-aware wrappers that need
    DTensor's scaled_mm strategy, which torch 2.11 lacks and 2.13 has), or None."""
    try:
        from torch.distributed.tensor import _dispatch, _ops
    except ImportError:
        return f"torchao's mxfp8 training needs torch.distributed, which this torch ({torch.__version__}) lacks"
    if hasattr(_ops, "scaled_mm_single_dim_strategy") and hasattr(_dispatch, "is_pinned_handler"):
        return None
    return (f"torchao's mxfp8 training needs a newer torch than {torch.__version__} (DTensor's scaled_mm strategy, "
            "torchao's own check; torch 2.13 has it)")


class _MX(Emulable, Config):
    """What the MX kinds share: torchao's kernels on Blackwell, or their emulation anywhere (``emulate``)."""

    needs: ClassVar[str] = NEEDS

    def _facts(self, modes: tuple[str, ...], arithmetic: str) -> Facts:
        # torchao's MX layers take bfloat16 operands: the model is stored in bfloat16, as its examples run it
        return self.emulable(Facts(modes=modes, storage_dtype="bfloat16", backend="torchao", arithmetic=arithmetic,
                                   compute_dtype="float32" if self.emulate else "float8_e4m3fn"))

    def _runs(self) -> str:
        """What it runs, for the line that says why it cannot run here."""
        return "MX"

    def supported(self, hw: HardwareInfo) -> str | None:
        if self.emulate:
            return torchao_missing()
        return torchao_missing() or cuda_missing(hw, f"{self._runs()} runs MX tensor-core matmuls: it", MX_FLOOR)


@dataclass(frozen=True)
class MXTrain(_MX):
    """mxfp8 training: each converted Linear's matmuls take e4m3 operands with a power-of-two scale per 32 values
    (forward and both gradients), bfloat16 out; the model in bfloat16 (torchao's MX training takes bfloat16
    operands), as its examples train it."""

    kind: ClassVar[str] = "mx-train"
    recipe: str = "mxfp8"
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe != "mxfp8":
            raise DtypelabError(f"mx-train: unknown recipe {self.recipe!r}; torchao trains in mxfp8")

    def supported(self, hw: HardwareInfo) -> str | None:
        return super().supported(hw) or _mx_training_torch()

    @property
    def label(self) -> str:
        return "mxfp8" + ("-emu" if self.emulate else "")

    @property
    def facts(self) -> Facts:
        how = ("emulated: operands quantized and dequantized as MX tensor cores would, multiplied in float32; "
               "numerics only" if self.emulate else "MX tensor-core matmuls")
        return self._facts(("train",), f"mxfp8 (e4m3, a power-of-two scale per {MX_BLOCK} values) in the converted "
                                       f"Linear layers, {how}")

    def _runs(self) -> str:
        return "mxfp8 training"

    def describe(self) -> str:
        tail = " emulated: numerics only, no speed" if self.emulate else ""
        return f"mxfp8 training (torchao) in the Linear layers, bfloat16 elsewhere{tail}"

    def region(self, parent: Config, outer: Any) -> Config | None:
        return None  # an MX layer takes whatever its neighbours compute in

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        moe = torchao_module("prototype.moe_training.config")
        recipe = moe.MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if self.emulate else moe.MXFP8TrainingRecipe.MXFP8_RCEIL
        config = moe.MXFP8TrainingOpConfig.from_recipe(recipe)
        return _convert(model, names, config, "mxfp8 training" + (" (emulated)" if self.emulate else ""))



@dataclass(frozen=True)
class MXInfer(_MX):
    """MX inference: weights and activations (quantized at run time) in mxfp8 or mxfp4, a power-of-two scale per 32
    values, bfloat16 elsewhere."""

    kind: ClassVar[str] = "mx-infer"
    elements: str = "mxfp8"
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.elements not in ELEMENTS:
            raise DtypelabError(f"mx-infer: unknown elements {self.elements!r}; use one of {', '.join(ELEMENTS)}")

    @property
    def label(self) -> str:
        return f"{self.elements}-dyn" + ("-emu" if self.emulate else "")

    @property
    def facts(self) -> Facts:
        bits = "e4m3" if self.elements == "mxfp8" else "e2m1"
        how = "emulated: dequantized, multiplied in float32; numerics only" if self.emulate else "MX tensor cores"
        return self._facts(("infer",), f"{self.elements} ({bits}, a power-of-two scale per {MX_BLOCK} values) weights "
                                       f"and activations, {how}")

    def _runs(self) -> str:
        return f"{self.elements} inference"

    def describe(self) -> str:
        tail = ", emulated: numerics only, no speed" if self.emulate else ""
        return f"{self.elements} weights + {self.elements} activations (torchao, dynamic), bfloat16 elsewhere{tail}"

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        mx = torchao_module("prototype.mx_formats")
        kernel = torchao_module("quantization.quantize_.common.kernel_preference").KernelPreference
        dtype = getattr(torch, ELEMENTS[self.elements])
        config = mx.MXDynamicActivationMXWeightConfig(activation_dtype=dtype, weight_dtype=dtype,
                                                      kernel_preference=kernel.EMULATED if self.emulate
                                                      else kernel.AUTO)
        return _convert(model, names, config, self.elements + (" (emulated)" if self.emulate else ""))


# MX (Blackwell): mxfp8 training, mxfp8 / mxfp4 inference, and their emulated numerics (with --emulate, or by name)
register("mxfp8", MXTrain(), rank=33)
register("mxfp8-dyn", MXInfer("mxfp8"), rank=34)
register("mxfp4-dyn", MXInfer("mxfp4"), rank=35)
for _i, _emulated in enumerate((MXTrain(emulate=True), MXInfer("mxfp8", emulate=True), MXInfer("mxfp4", emulate=True))):
    register(_emulated.label, _emulated, sweeps=frozenset(), rank=46 + _i)
in_default("forecast-infer", "mxfp4-dyn", 8)
