"""fp8 (e4m3) weight-only quantization with torchao: weights stored as float8_e4m3fn with one scale per
output channel, dequantized for the matmul. Storage is fp8; arithmetic is not, on any device."""

from __future__ import annotations

from typing import Any

import torch

from dtypelab.core.policies.quant import TorchaoPolicy, torchao_module


class FP8WeightOnly(TorchaoPolicy):
    name = "fp8-wo"
    summary = "fp8 e4m3 weights (per channel), float activations, torchao (emulated: fp8 storage only)"
    arithmetic = "emulated: fp8 e4m3 weights dequantized to float32 for every matmul"
    emulated = True

    def config(self) -> Any:
        return torchao_module("quantization").Float8WeightOnlyConfig(
            weight_dtype=torch.float8_e4m3fn, set_inductor_config=False)
