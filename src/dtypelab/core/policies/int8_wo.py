"""int8 weight-only quantization with torchao: weights stored int8 (one scale per output channel),
activations stay float; saves memory bandwidth, not arithmetic."""

from __future__ import annotations

from typing import Any

from dtypelab.core.policies.quant import TorchaoPolicy, torchao_module


class Int8WeightOnly(TorchaoPolicy):
    name = "int8-wo"
    summary = "int8 weights (per channel), float activations, torchao"
    arithmetic = "float matmul on int8 weights scaled per channel (weight-only: activations stay float)"

    def config(self) -> Any:
        return torchao_module("quantization").Int8WeightOnlyConfig(set_inductor_config=False)
