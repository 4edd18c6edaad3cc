"""Autocast to bfloat16: float32 master weights, bf16 matmuls/convs. No loss scaling needed."""

import torch

from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.policies.base import AutocastPolicy, bf16_missing


class AmpBF16(AutocastPolicy):
    name = "amp-bf16"
    summary = "torch.autocast(bfloat16) with float32 weights"
    compute_dtype = "bfloat16"
    dtype = torch.bfloat16

    def supported(self, hw: HardwareInfo) -> str | None:
        return bf16_missing(hw, "bfloat16 autocast")
