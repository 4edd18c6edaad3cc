"""What each op of a traced step costs in time, as ``core.machine.speed.Op``: its FLOPs, the bytes it reads and writes,
the rate it computes at and its group. The ledger records one per op it sees (``Ledger.ops``), in the phases that make a
step (forward, backward, optimizer).

FLOPs come from torch's ``flop_counter`` formulas (matmuls, convolutions, attention, ``_scaled_mm``); the kernels it has
none for are counted here: ``_int_mm`` and packed weight-only matmuls by their shapes, the CPU's flash attention with
the formula of CUDA's (their arguments start alike). An op that returns views of its inputs, or only allocates, runs no
kernel and is left out. A matmul's rate is its operands' dtype (``tf32`` for float32 while the TF32 flag is set, ``fp8``
for float8 operands, ``int8`` for ``_int_mm``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from dtypelab.core.footprint import leaves
from dtypelab.core.machine.speed import Op
from dtypelab.forecasting.kernels import signature

aten = torch.ops.aten
_OPTIONAL = {n: getattr(aten, n) for n in ("_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm",
                                           "_scaled_dot_product_flash_attention_for_cpu",
                                           "_scaled_dot_product_flash_attention_for_cpu_backward") if hasattr(aten, n)}
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm, aten._int_mm,
           *(p for n, p in _OPTIONAL.items() if "pack_mm" in n)}
_SAME_FLOPS = {p: (aten._scaled_dot_product_flash_attention_backward if n.endswith("backward")
                   else aten._scaled_dot_product_flash_attention) for n, p in _OPTIONAL.items() if "attention" in n}
CONVOLUTIONS = {aten.convolution, aten.convolution_backward, aten._convolution, aten.cudnn_convolution,
                aten._slow_conv2d_forward, aten.convolution_overrideable}
NO_KERNEL = {aten.empty, aten.empty_strided, aten.empty_like, aten.detach, aten.lift_fresh, aten.alias,
             aten._local_scalar_dense}
LOW = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, n)}
RECORDED = ("forward", "backward", "optimizer")  # the phases a step repeats (not the batch's fetch)


def _storages(tensors: list[torch.Tensor], ident: Callable[[torch.UntypedStorage], int]) -> dict[int, int]:
    """storage -> the bytes of it these tensors cover (a view counts its own elements; each storage once)."""
    out: dict[int, int] = {}
    for t in tensors:
        for leaf in leaves(t):
            if isinstance(leaf, torch.Tensor):
                key = ident(leaf.untyped_storage())
                out[key] = max(out.get(key, 0), leaf.numel() * leaf.element_size())
    return out


def _rate(packet: Any, tensors: list[torch.Tensor]) -> str:
    if packet is aten._int_mm:
        return "int8"
    # a tensor subclass (torchao's float8 and quantized tensors) computes in its inner tensors' dtypes
    dtypes = {leaf.dtype for t in tensors for leaf in leaves(t) if isinstance(leaf, torch.Tensor)}
    if dtypes & LOW:
        return "fp4" if any("float4" in str(d) for d in dtypes) else "fp8"
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        if dtype in dtypes:
            if dtype is torch.float32 and torch.backends.cuda.matmul.fp32_precision == "tf32":
                return "tf32"
            return str(dtype).removeprefix("torch.")
    return "float32"


def _flops(packet: Any, args: Any, kwargs: dict[str, Any], out: Any, ins: list[torch.Tensor],
           outs: list[torch.Tensor]) -> float:
    formula = flop_registry.get(_SAME_FLOPS.get(packet, packet))
    if formula is not None:
        try:
            return float(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take this overload's arguments: by shape below
            pass
    if packet in MATMULS and ins and outs:  # (m, k) @ (k, n), however the weight is packed: 2·m·n·k
        return 2.0 * outs[0].numel() * ins[0].shape[-1]
    return 0.0


def _variant(rate: str, ins: list[torch.Tensor], phase: str) -> str:
    """"rowwise" for a float8 GEMM of the forward whose operands carry a scale per row or column (torchao's float8
    tensors hold their scale beside their data): torchao's rowwise recipe runs that GEMM with fast accumulation, on
    PyTorch's rowwise CUTLASS kernel; its backward GEMMs, slow-accumulating, run cuBLAS with the scales applied after
    (pytorch/ao#1325), as a tensorwise GEMM does."""
    if rate != "fp8" or phase != "forward":
        return ""
    scales = [leaf for t in ins for leaf in leaves(t) if isinstance(leaf, torch.Tensor) and leaf is not t
              and leaf.dtype == torch.float32]
    return "rowwise" if any(s.numel() > 1 for s in scales) else ""


def _returns_views(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def record(func: Any, args: Any, kwargs: dict[str, Any], out: Any, phase: str,
           ident: Callable[[torch.UntypedStorage], int] = id, calls: bool = True) -> Op | None:
    """The op as the time model takes it; None for one that runs no kernel (a view, an allocation). ``ident`` numbers
    storages (the ledger's serials; ``id`` only while no storage the ops name is freed); ``calls``: keep a heavy op's
    call (``Op.kernel``), for a device that times its kernels where they run (this CPU)."""
    packet = func._overloadpacket
    if packet in NO_KERNEL or _returns_views(func):
        return None
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not outs and not ins:
        return None
    flops = _flops(packet, args, kwargs, out, ins, outs)
    name = packet.__name__
    if phase == "optimizer":
        group = "optimizer"
    elif packet in MATMULS:
        group = "matmuls"
    elif "attention" in name:
        group = "attention"
    elif packet in CONVOLUTIONS:
        group = "convolutions"
    elif (packet in (aten._to_copy, aten.copy_) and len({t.dtype for t in ins + outs}) > 1) or \
            any(t.dtype in LOW for t in outs):
        group = "casts"  # dtype conversions, and float8 / MX scaling's quantizing ops
    else:
        group = "elementwise"
    heavy = group in ("matmuls", "attention", "convolutions")
    rate = _rate(packet, ins) if heavy or flops else ""
    # torch.compile fuses the model's elementwise ops, not the optimizer's update (eager, unless compiled itself)
    dtype = str(outs[0].dtype).removeprefix("torch.") if outs else ""
    return Op(group, rate, flops, tuple(_storages(ins, ident).items()), tuple(_storages(outs, ident).items()),
              variant=_variant(rate, ins, phase) if packet in MATMULS else "",
              work=flops / 2 if packet in MATMULS else 0.0, fusible=not heavy and group != "optimizer", dtype=dtype,
              kernel=signature(func, args, kwargs) if heavy and calls else (),
              causal=group == "attention" and _causal(func, args, kwargs))


def _causal(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """The call's ``is_causal`` argument, by its schema (forward and backward name it alike)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            value = kwargs.get("is_causal", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return False


__all__ = ["RECORDED", "record"]
