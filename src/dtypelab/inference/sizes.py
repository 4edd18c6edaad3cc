"""What a model costs on disk: its state written with safetensors (or torch.save for torch.ao's packed
quantized modules, which safetensors cannot hold), and the bytes of its linear layers' weights.

torchao's quantized weights are tensor subclasses (int8 or fp8 data plus scales); they are flattened
into plain tensors with torchao's own safetensors support so the file holds exactly what is stored.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch
from torch import nn

from dtypelab.core.backends import torchao_module
from dtypelab.core.executorch import PteModule

SAFETENSORS, TORCH, PTE = "safetensors", "torch.save", "executorch .pte"


def _is_plain(t: Any) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and not t.is_quantized


def state_format(model: nn.Module) -> str:
    """safetensors, unless the state holds something only torch.save can write (torch.ao packed params)."""
    for t in model.state_dict().values():
        if not isinstance(t, torch.Tensor) or t.is_quantized:
            return TORCH
    return SAFETENSORS


def dedupe_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shared tensors (tied weights) stored once, as safetensors requires; the rest made contiguous."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for key, t in state.items():
        if _is_plain(t) and t.numel():
            ident = (t.untyped_storage().data_ptr(), t.storage_offset())
            if ident in seen:
                continue
            seen.add(ident)
            t = t.detach().to("cpu").contiguous()
        out[key] = t
    return out


def flatten_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain tensors and safetensors metadata for a model whose state may hold torchao subclasses."""
    state = dedupe_state(model.state_dict())
    if all(_is_plain(t) for t in state.values()):
        return state, {}
    support = torchao_module("prototype.safetensors.safetensors_support")
    try:
        tensors, metadata = support.flatten_tensor_state_dict({k: v.detach().to("cpu") for k, v in state.items()})
    except ValueError:  # a subclass torchao cannot save (MX training's weight wrapper): the tensors that hold it
        tensors, metadata = dedupe_state(dict(_inner(state))), {}  # tied weights: once
    return {k: v.contiguous() for k, v in tensors.items()}, metadata


def _inner(state: dict[str, torch.Tensor]) -> Any:
    for key, t in state.items():
        if _is_plain(t) or not hasattr(t, "__tensor_flatten__"):
            yield key, t.detach().to("cpu")
        else:
            names, _ = t.__tensor_flatten__()
            yield from _inner({f"{key}.{n}": getattr(t, n) for n in names})


def serialize(model: nn.Module, metadata: dict[str, Any] | None = None) -> tuple[bytes, str]:
    """(file bytes, format) of the model's state; ``metadata`` (JSON-able) is stored alongside."""
    extra = {"dtypelab": json.dumps(metadata or {})}
    if isinstance(model, PteModule):  # the program as a device loads it (export writes the metadata beside it)
        return model.program, PTE
    if state_format(model) == TORCH:
        buf = io.BytesIO()
        torch.save({"state_dict": model.state_dict(), "metadata": extra}, buf)
        return buf.getvalue(), TORCH
    from safetensors.torch import save

    tensors, meta = flatten_state(model)
    return save(tensors, metadata={**meta, **extra}), SAFETENSORS


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's state on disk: safetensors (shared tensors stored once, quantized weights as
    their int8/fp8 data plus scales), or torch.save where safetensors cannot hold it."""
    return len(serialize(model)[0])


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really stores: int8 data plus scales for quantized and subclass tensors."""
    if t.is_quantized:
        extra = (t.q_per_channel_scales().numel() * 16 if t.qscheme() in
                 (torch.per_channel_affine, torch.per_channel_symmetric) else 16)  # float64 scale + int64 zp
        return t.numel() * t.int_repr().element_size() + extra
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n) is not None)
    return t.numel() * t.element_size()


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of every linear layer's weight (the part int8 and fp8 schemes shrink), biases excluded."""
    total = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) and isinstance(weight, torch.Tensor):
            total += tensor_bytes(weight)
        elif type(m).__name__ == "Linear" and callable(weight) and "quantized" in type(m).__module__:
            total += tensor_bytes(weight())  # torch.ao's packed weight unpacks to a quantized tensor
    return total
