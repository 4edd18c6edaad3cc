"""TensorFloat-32: float32 storage, matmuls/convs on tensor cores with a 10-bit mantissa (CUDA only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.policies.base import Policy


class TF32(Policy):
    name = "tf32"
    summary = "float32 tensors, TF32 tensor-core matmuls and convolutions"
    compute_dtype = "tf32"

    def supported(self, hw: HardwareInfo) -> str | None:
        if not hw.is_cuda:
            return "tf32 is a CUDA tensor-core mode (Ampere or newer); this run is on the CPU"
        if hw.native("tf32") is False:
            return f"tf32 needs compute capability >= 8.0 (this GPU is {hw.cuda_capability})"
        return None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
        saved = (matmul.fp32_precision, conv.fp32_precision)
        matmul.fp32_precision, conv.fp32_precision = "tf32", "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision, conv.fp32_precision = saved
