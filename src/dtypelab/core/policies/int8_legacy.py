"""int8 dynamic quantization with the deprecated torch.ao.quantization backend, kept because it was
measured fast on x86 CPUs: per-tensor (the default qconfig) and per-channel weight scales."""

from __future__ import annotations

from dtypelab.core.policies.quant import LegacyDynamicPolicy


class Int8DynLegacy(LegacyDynamicPolicy):
    name = "int8-dyn-legacy"
    summary = "int8 weights + activations, one scale per tensor, torch.ao.quantization (deprecated), CPU"
    arithmetic = "int8 × int8 matmul (fbgemm/x86), activations quantized per tensor at run time"


class Int8DynLegacyPerChannel(LegacyDynamicPolicy):
    name = "int8-dyn-legacy-pc"
    summary = "as int8-dyn-legacy with one weight scale per output channel"
    arithmetic = "int8 × int8 matmul (fbgemm/x86), per-channel weights, per-tensor activations"
    per_channel = True
