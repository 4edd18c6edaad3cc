"""``TF32()``: float32 tensors, matmuls and convolutions on tensor cores with a 10-bit mantissa (CUDA only): a
process-wide flag, set for the run and restored."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, Facts
from dtypelab.core.policies.registry import register


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision, conv.fp32_precision = "tf32", "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved


@dataclass(frozen=True)
class TF32(Config):
    """float32 storage, matmuls and convolutions on tensor cores with a 10-bit mantissa (CUDA only)."""

    kind: ClassVar[str] = "tf32"
    label: ClassVar[str] = "tf32"

    @property
    def facts(self) -> Facts:
        return Facts(compute_dtype="tf32", process_wide=True)

    def describe(self) -> str:
        return "float32 tensors, TF32 tensor-core matmuls and convolutions"

    def supported(self, hw: HardwareInfo) -> str | None:
        if not hw.is_cuda:
            return "tf32 is a CUDA tensor-core mode (Ampere or newer); this run is on the CPU"
        if hw.native("tf32") is False:
            return f"tf32 needs compute capability >= 8.0 (this GPU is {hw.cuda_capability})"
        return None

    def session(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return _tf32()


register("tf32", TF32(), rank=3)
