"""Pure bfloat16: fp32's range with 8 bits of mantissa, weights and optimizer state included."""

import torch

from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.policies.base import CastPolicy, bf16_missing


class BF16(CastPolicy):
    name = "bf16"
    summary = "bfloat16 weights, activations, gradients and optimizer state"
    compute_dtype = "bfloat16"
    dtype = torch.bfloat16

    def supported(self, hw: HardwareInfo) -> str | None:
        return bf16_missing(hw, "bfloat16")
