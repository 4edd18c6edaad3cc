"""float64: a numerical reference; fast on CPUs, often crippled on consumer GPUs."""

import torch

from dtypelab.core.policies.base import CastPolicy


class FP64(CastPolicy):
    name = "fp64"
    summary = "float64 weights, activations and gradients"
    compute_dtype = "float64"
    dtype = torch.float64
