"""``Autocast(dtype, scaler)``: float32 weights, eligible forward ops in ``dtype`` under ``torch.autocast``,
optionally a GradScaler (float16's narrow range needs one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import SHORT, Config, Facts, _float_dtype, bf16_missing
from dtypelab.core.policies.registry import REGISTRY, in_default, register
from dtypelab.core.task import map_tensors


def _to_float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16) else t


@dataclass(frozen=True)
class Autocast(Config):
    """float32 weights; eligible forward ops run in ``dtype`` under ``torch.autocast``; ``scaler`` adds a
    GradScaler (scale per step, skipped steps and their non-finite parameters are recorded)."""

    kind: ClassVar[str] = "autocast"
    dtype: str = "bfloat16"
    scaler: bool = False

    def __post_init__(self) -> None:
        dtype = _float_dtype(self.dtype, "autocast")
        if dtype not in ("bfloat16", "float16"):
            raise DtypelabError(f"autocast: dtype must be bfloat16 or float16, not {dtype}")
        object.__setattr__(self, "dtype", dtype)

    @property
    def facts(self) -> Facts:
        return Facts(compute_dtype=self.dtype, autocast_dtype=self.dtype, scales_loss=self.scaler)

    @property
    def label(self) -> str:
        return f"amp-{SHORT[self.dtype]}" + ("" if self.scaler == (self.dtype == "float16") else
                                             ("+scaler" if self.scaler else "-noscaler"))

    def describe(self) -> str:
        return f"torch.autocast({self.dtype}){' + GradScaler' if self.scaler else ''}, float32 weights"

    def supported(self, hw: HardwareInfo) -> str | None:
        return bf16_missing(hw, "bfloat16 autocast") if self.dtype == "bfloat16" else None

    def convert_output(self, output: Any) -> Any:
        # the script's loss runs after forward, outside autocast: in float32, as autocast would run it (Fabric
        # does the same); a float16 loss times GradScaler's 65536 overflows
        return map_tensors(_to_float32, output)


register("amp-bf16", Autocast("bfloat16"), "torch.autocast(bfloat16) with float32 weights", rank=6)
register("amp-fp16", Autocast("float16", scaler=True), "torch.autocast(float16) + GradScaler, float32 weights", rank=7)
# the fair baseline of float8 training, which compiles: a GPU's training sweep runs it
register("amp-bf16+compile", REGISTRY["amp-bf16"].compiled(), "torch.autocast(bfloat16) with float32 weights, under "
         "torch.compile: the fair baseline of float8 training, which compiles", sweeps=frozenset({"gpu-train"}),
         rank=11)
in_default("forecast-train", "amp-bf16", 3)
in_default("forecast-fine-tuning", "amp-bf16", 1)
in_default("forecast-fine-tuning", "amp-bf16+ckpt", 2)
