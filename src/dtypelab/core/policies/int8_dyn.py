"""int8 dynamic quantization with torchao: int8 weights (one scale per output channel) and activations
quantized per token at run time; the matmul runs in int8 (VNNI / AMX on x86, int8 tensor cores on CUDA)."""

from __future__ import annotations

from typing import Any

from dtypelab.core.policies.quant import TorchaoPolicy, torchao_module


class Int8Dyn(TorchaoPolicy):
    name = "int8-dyn"
    summary = "int8 weights (per channel) + int8 activations (per token), torchao, eager"
    arithmetic = "int8 × int8 matmul, activations quantized per token at run time"
    compute_dtype = "int8"

    def config(self) -> Any:
        q = torchao_module("quantization")
        return q.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)


class Int8DynCompile(Int8Dyn):
    name = "int8-dyn-compile"
    summary = "int8-dyn under torch.compile (inductor fuses the quantize/scale steps); first call compiles"
    compiles = True
