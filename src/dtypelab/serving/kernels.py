"""What a weight format's matmul runs on a GPU, as data: its kernel, the rate its FLOPs run at, the bytes its weight
stores, and the share of memory bandwidth the kernel reaches in single-stream decode relative to a bfloat16 GEMM.

The speed of a weight format is its kernel's, not its bytes' (published decode tables reach a different share of
bandwidth for each format). A relative share comes from one published table, named with it; the other tables are
left to check it (docs: Serving). A format's weights may be stored here by a stand-in (int4 and fp8 matmuls cannot be
converted on a CPU): their bytes then come from the format's layout (``forecasting.layouts.layout_bytes``,
the training forecast's too).

Each share is fitted so that this forecast gives its table's published ratio of tokens per second to bfloat16's
(single stream: batch 1, a 5-token prompt, 200 tokens generated, compiled): a memory-bound decode step takes
a + b / share, so two forecasts fix it (``python benchmarks/serving.py --part calibrate`` prints these). The tables:
gpt-fast's README (pytorch-labs/gpt-fast, Llama-2-7B, A100-80GB power-limited to 330 W): int8 weight-only 155.58
tok/s and int4 weight-only (groups of 32: more scale bytes than the 128 stored here, which the fitted share absorbs)
196.80 against bfloat16's 104.9; torchao's quantization README (torchao/quantization/README.md), Llama-3.1-8B on an
H100: float8 weight-only 178.46, float8 dynamic per-row 154.63, per-tensor 116.40 against 126.90; and Llama-3-8B on
an A100-80GB: int8 dynamic 8.61 against 95.64. The int8 and int4 weight-only shares are checked against the
torchao tables they were not fitted to (docs: Serving).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dtypelab.core.policies import Quantize, WeightQuant
from dtypelab.core.policies.adapters import Adapter, constant

GPT_FAST = "gpt-fast README (Llama-2-7B, A100-80GB at 330 W, batch 1, compiled)"
TORCHAO_H100 = "torchao quantization README (Llama-3.1-8B, H100, batch 1, compiled)"
TORCHAO_A100 = "torchao quantization README (Llama-3-8B, A100-80GB, batch 1, compiled)"


@dataclass(frozen=True)
class Kernel:
    name: str  # what runs
    rate: str  # the rate key its FLOPs run at (core.machine.speed)
    share: float  # bandwidth reached in decode, relative to a bfloat16 GEMM's
    source: str
    dequantizes: bool = True  # the weight is dequantized in the kernel (its FLOPs at the activations' rate)
    # the share of its rate's GEMM FLOP/s the kernel reaches where the batch makes it compute-bound (a weight-only
    # kernel dequantizing in its inner loop falls behind cuBLAS there)
    compute: float = 1.0
    capability: tuple[int, int] = (8, 0)  # the least compute capability it runs on


KERNELS: dict[str, Kernel] = {
    "int8-weight-only": Kernel("int8 weight-only matmul (dequantized in the GEMM under torch.compile; torchao)",
                               "bfloat16", 0.8633, GPT_FAST),
    "int4-weight-only": Kernel("tinygemm int4 (torch._weight_int4pack_mm), groups of 128", "bfloat16",
                               0.8745, GPT_FAST),
    "fp8-weight-only": Kernel("float8 weight-only matmul (dequantized in the GEMM under torch.compile; torchao)",
                              "bfloat16", 0.7589, TORCHAO_H100),
    "fp8-dynamic-per-channel": Kernel("torch._scaled_mm, fp8 e4m3 rowwise (CUTLASS)", "fp8", 0.6144,
                                      TORCHAO_H100, dequantizes=False),
    "fp8-dynamic-per-tensor": Kernel("torch._scaled_mm, fp8 e4m3 tensorwise (cuBLAS)", "fp8", 0.4186,
                                     TORCHAO_H100, dequantizes=False),
    "int8-dynamic": Kernel("torch._int_mm after quantizing each token (torchao int8 dynamic)", "int8",
                           0.0346, TORCHAO_A100, dequantizes=False),
}


# What serving asks of a kind: the kernel a layer it converts runs on a GPU (a key of ``KERNELS``; None: the layer is
# not one the kind's kernel takes, and stays as it is). A kind of your own registers its answer in its file.
KERNEL: Adapter[str | None] = Adapter("the GPU kernel a layer the kind converts runs (a key of KERNELS)",
                                      constant(None))


@KERNEL.register(Quantize, WeightQuant)
def _quantized(config: Quantize | WeightQuant, layer: nn.Module) -> str | None:
    """The kind's own answer (``Quantize.kernel``)."""
    return config.kernel(layer)


MARLIN_BENCH = ("vllm-project/vllm#2497: IST-DASLab/marlin's bench.py, the int4 GEMM over torch's float16 GEMM: "
                "3.12x at batch 1 to 16, 1.01x at 128, 0.61x at 4000 (141 TFLOP/s flat from batch 128)")
TORCHAO_VLLM = ("torchao quantization README, vLLM serving Llama-3.1-8B on an H100 at 128 concurrent requests: "
                "int8 weight-only 0.65x bfloat16's output tokens/s")

# What vLLM runs for each format (``--engine vllm``): its own kernels, chosen by the checkpoint's scheme. A weight-only
# kernel's bandwidth share and its compute share (``compute``) are fitted to its bench: at batch 1 it reads its
# bytes at ``share`` of a float16 GEMM's bandwidth (3.12x from 4.125 bits a weight, groups of 128: 3.88x fewer
# bytes, so 0.80), where compute-bound it reaches ``compute`` of the GEMM's FLOP/s (0.61). The fp8 and int8 W8A8
# kernels are CUTLASS's scaled matmuls, their single-stream shares torchao's (``torch._scaled_mm`` is the same
# CUTLASS kernel family).
VLLM_KERNELS: dict[str, Kernel] = {
    "int4-weight-only": Kernel("Marlin W4A16 (GPTQ / AWQ / RTN int4, groups of 128; Machete on Hopper for large "
                               "batches)", "bfloat16", 0.80, MARLIN_BENCH, compute=0.61),
    "int8-weight-only": Kernel("torchao int8 weight-only through vLLM's torchao backend (dequantized, then a "
                               "bfloat16 GEMM)", "bfloat16", 0.8633, TORCHAO_VLLM, compute=0.29),
    "fp8-weight-only": Kernel("Marlin FP8 W8A16 (weights fp8, activations bfloat16)", "bfloat16", 0.7589,
                              TORCHAO_H100, compute=0.61),
    "fp8-dynamic-per-channel": Kernel("CUTLASS scaled_mm fp8 W8A8, per-channel weights, per-token activations",
                                      "fp8", 0.6144, TORCHAO_H100, dequantizes=False, capability=(8, 9)),
    "fp8-dynamic-per-tensor": Kernel("CUTLASS scaled_mm fp8 W8A8, per-tensor scales", "fp8", 0.4186, TORCHAO_H100,
                                     dequantizes=False, capability=(8, 9)),
    "int8-dynamic": Kernel("CUTLASS scaled_mm int8 W8A8, per-token activations (no published single-stream "
                           "table: fp8 rowwise's share)", "int8", 0.6144, "", dequantizes=False),
}


MACHETE = ("Neural Magic's Machete announcement (October 2024; MarkTechPost, 'Neural Magic Unveils Machete'): on "
           "Hopper it matches FP16's compute-bound performance and cuts weight memory about 4x where memory-bound")
# Hopper's own kernels where vLLM picks them over the ones above (compute capability 9.0 and later): Machete for
# W4A16, its memory-bound share Marlin's (the same bytes, read as fast), its compute-bound share cuBLAS's
VLLM_HOPPER: dict[str, Kernel] = {
    "int4-weight-only": Kernel("Machete W4A16 (GPTQ / AWQ / RTN int4, groups of 128; CUTLASS 3, Hopper)", "bfloat16",
                               0.80, MACHETE, compute=1.0, capability=(9, 0)),
}


AS_BF16 = Kernel("as a bfloat16 GEMM (no published decode table for this format)", "bfloat16", 1.0, "")


ENGINES = {"static": KERNELS, "vllm": VLLM_KERNELS}


def kernel_of(key: str, engine: str = "static", capability: tuple[int, int] | None = None) -> Kernel:
    """A format's kernel in ``engine`` on a card of ``capability`` (vLLM's Hopper kernels from 9.0); one with no
    published share here (a format just added) as a bfloat16 GEMM reading its stored bytes, and said so."""
    if engine == "vllm" and capability is not None and tuple(capability) >= (9, 0) and key in VLLM_HOPPER:
        return VLLM_HOPPER[key]
    return ENGINES[engine].get(key, AS_BF16)


__all__ = ["AS_BF16", "ENGINES", "KERNEL", "KERNELS", "VLLM_HOPPER", "VLLM_KERNELS", "Kernel", "kernel_of"]
