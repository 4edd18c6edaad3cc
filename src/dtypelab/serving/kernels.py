"""What a weight format's matmul runs on a GPU, as data: its kernel, the rate its FLOPs run at, the bytes its weight
stores, and the share of memory bandwidth the kernel reaches in single-stream decode relative to a bfloat16 GEMM.

The speed of a weight format is its kernel's, not its bytes' (published decode tables reach a different share of
bandwidth for each format). A relative share comes from one published table, named with it; the other tables are
left to check it (docs: Serving). A format's weights may be stored here by a stand-in (int4 and fp8 matmuls cannot be
converted on a CPU): their bytes then come from the format's layout (``stored_bytes``).

The shares are ratios of "memory bandwidth achieved" columns: the model's bytes times tokens per second, batch 1,
compiled, a short prompt. gpt-fast (pytorch-labs/gpt-fast README, Llama-2-7B, A100-80GB power-limited to 330 W):
bfloat16 1397.31 GB/s, int8 weight-only 1069.20, int4 weight-only groups of 32 862.69. torchao's quantization README
(torchao/quantization/README.md, Llama-3.1-8B on an H100): bfloat16 1904.75 GB/s, float8 weight-only 1339.93, float8
dynamic per-row 1161.47, per-tensor 873.58; (Llama-3-8B on an A100-80GB): int8 dynamic 64.75 against 1435.54.
"""

from __future__ import annotations

from dataclasses import dataclass

GPT_FAST = "gpt-fast README (Llama-2-7B, A100-80GB at 330 W, batch 1, compiled)"
TORCHAO_H100 = "torchao quantization README (Llama-3.1-8B, H100, batch 1, compiled)"
TORCHAO_A100 = "torchao quantization README (Llama-3-8B, A100-80GB, batch 1, compiled)"


@dataclass(frozen=True)
class Kernel:
    name: str  # what runs
    rate: str  # the rate key its FLOPs run at (core.speed)
    share: float  # bandwidth reached in decode, relative to a bfloat16 GEMM's
    source: str
    dequantizes: bool = True  # the weight is dequantized in the kernel (its FLOPs at the activations' rate)


KERNELS: dict[str, Kernel] = {
    "int8-weight-only": Kernel("int8 weight-only matmul (dequantized in the GEMM under torch.compile; torchao)",
                               "bfloat16", 1069.20 / 1397.31, GPT_FAST),
    "int4-weight-only": Kernel("tinygemm int4 (torch._weight_int4pack_mm), groups of 128", "bfloat16",
                               862.69 / 1397.31, GPT_FAST),
    "fp8-weight-only": Kernel("float8 weight-only matmul (dequantized in the GEMM under torch.compile; torchao)",
                              "bfloat16", 1339.93 / 1904.75, TORCHAO_H100),
    "fp8-dynamic-per-channel": Kernel("torch._scaled_mm, fp8 e4m3 rowwise (CUTLASS)", "fp8", 1161.47 / 1904.75,
                                      TORCHAO_H100, dequantizes=False),
    "fp8-dynamic-per-tensor": Kernel("torch._scaled_mm, fp8 e4m3 tensorwise (cuBLAS)", "fp8", 873.58 / 1904.75,
                                     TORCHAO_H100, dequantizes=False),
    "int8-dynamic": Kernel("torch._int_mm after quantizing each token (torchao int8 dynamic)", "int8",
                           64.75 / 1435.54, TORCHAO_A100, dequantizes=False),
}


def stored_bytes(key: str, rows: int, cols: int) -> int:
    """The bytes a ``rows`` x ``cols`` weight stores in a format converted by a stand-in here (torchao's layouts):
    int4 in groups of 128 with a bfloat16 scale and zero per group (tinygemm), fp8 with a float32 scale per row (or
    one per tensor)."""
    if key == "int4-weight-only":
        return rows * cols // 2 + rows * (cols // 128) * 2 * 2
    if key == "fp8-dynamic-per-channel":
        return rows * cols + rows * 4
    if key == "fp8-dynamic-per-tensor":
        return rows * cols + 4
    raise KeyError(key)


def kernel_key(scheme: str, granularity: str) -> str:
    return f"{scheme}-{granularity}" if scheme == "fp8-dynamic" else scheme


__all__ = ["KERNELS", "Kernel", "kernel_key", "stored_bytes"]
