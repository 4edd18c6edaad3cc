"""``Cast(dtype)``: pure precision. The module's parameters, buffers, floating inputs, activations, gradients and
optimizer state all in one float dtype; ``Cast("float32")`` is the baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.policies.configs import SHORT, Config, Facts, _float_dtype, bf16_missing


@dataclass(frozen=True)
class Cast(Config):
    """Pure precision: the module's parameters, buffers and floating inputs all in ``dtype``."""

    kind: ClassVar[str] = "cast"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _float_dtype(self.dtype, "cast"))

    @property
    def facts(self) -> Facts:
        return Facts(compute_dtype=self.dtype, storage_dtype=self.dtype)

    @property
    def label(self) -> str:
        return SHORT[self.dtype]

    def describe(self) -> str:
        if self.dtype == "float32":
            return "float32 everywhere (baseline)"
        scaling = ", no loss scaling" if self.dtype == "float16" else ""
        return f"{self.dtype} weights, activations, gradients and optimizer state{scaling}"

    def supported(self, hw: HardwareInfo) -> str | None:
        return bf16_missing(hw, "bfloat16") if self.dtype == "bfloat16" else None

    def region(self, parent: Config, outer: torch.dtype) -> Config | None:
        if getattr(torch, self.dtype) == outer and parent.facts.autocast_dtype is None:
            return None  # runs as its parent does already (e.g. a layer excluded from quantization)
        return self
