"""Pure float16, no loss scaling: what `model.half()` gives you. Small range: gradients underflow."""

import torch

from dtypelab.core.policies.base import CastPolicy


class FP16(CastPolicy):
    name = "fp16"
    summary = "float16 weights, activations, gradients and optimizer state, no loss scaling"
    compute_dtype = "float16"
    dtype = torch.float16
