"""``Cast(dtype)``: pure precision. The module's parameters, buffers, floating inputs, activations, gradients and
optimizer state all in one float dtype; ``Cast("float32")`` is the baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import SHORT, Config, Facts, _float_dtype, bf16_missing
from dtypelab.core.policies.registry import EVERY_SWEEP, REGISTRY, in_default, register
from dtypelab.core.tolerance import BASELINE, COMPILED_BASELINE


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


register("fp64", Cast("float64"), sweeps=frozenset({"cpu-train", "gpu-train"}), rank=1)  # nobody serves float64
register(BASELINE, Cast("float32"), rank=2)
register("bf16", Cast("bfloat16"), rank=4)
register("fp16", Cast("float16"), rank=5)
# Compiled float baselines: a compiled quantized policy is only fairly compared with compiled float ones. Compiling a
# training step takes minutes on a small CPU: by name only there.
register(COMPILED_BASELINE, REGISTRY[BASELINE].compiled(), "float32 under torch.compile: the speed baseline of "
         "compiled policies", sweeps=EVERY_SWEEP - {"cpu-train"}, rank=9)
register("bf16+compile", REGISTRY["bf16"].compiled(), sweeps=EVERY_SWEEP - {"cpu-train"}, rank=10)
for _listing, _rank in (("forecast-train", 1), ("forecast-infer", 1), ("serve-measured", 1), ("serve-forecast-cpu", 1)):
    in_default(_listing, BASELINE, _rank)
for _listing, _rank in (("forecast-train", 2), ("forecast-infer", 2), ("serve-measured", 2), ("serve-forecast", 1),
                        ("serve-forecast-cpu", 2)):
    in_default(_listing, "bf16", _rank)
