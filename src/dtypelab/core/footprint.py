"""Where a training run's memory goes, counted from the tensors themselves: the weights, their gradients, the
optimizer's state, a kind's master copy, and the activations a forward pass keeps for the backward.

Bytes are exact: a tensor subclass (torchao's 8-bit optimizer state reports dtype float32) is counted by the inner
tensors that hold its data, and storage that two tensors share (a quantization table every state points at, tied
weights) is counted once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dtypelab.core.results.memory import COUNTED

CATEGORIES = COUNTED  # what bench counts from the tensors after a run


def leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold ``t``'s data: itself, or a wrapper subclass's inner tensors, recursively."""
    if hasattr(t, "to_local") and type(t).__name__ == "DTensor":
        t = t.to_local()
    if is_traceable_wrapper_subclass(t) or (type(t) not in (torch.Tensor, nn.Parameter)
                                            and hasattr(t, "__tensor_flatten__")):  # a wrapper (MX training's)
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from leaves(getattr(t, name))
    else:
        yield t


class ByteCounter:
    """Adds up tensors' bytes, each storage once: per storage, the span of it that the counted tensors view (a
    batch sliced from a dataset tensor is not the dataset). ``add`` returns how much a call added; the spans are
    shared across calls, so a tensor that two categories hold goes to the first that counts it."""

    def __init__(self) -> None:
        self.spans: dict[int, tuple[int, int]] = {}

    def add(self, tensors: Iterable[torch.Tensor]) -> int:
        added = 0
        for t in tensors:
            for leaf in leaves(t):
                size = leaf.numel() * leaf.element_size()
                if leaf.device.type == "meta" or size == 0:
                    added += size
                    continue
                ptr = leaf.untyped_storage().data_ptr()
                lo = leaf.storage_offset() * leaf.element_size()
                hi = lo + size
                old = self.spans.get(ptr)
                if old is None:
                    self.spans[ptr] = (lo, hi)
                    added += size
                else:
                    new = (min(lo, old[0]), max(hi, old[1]))
                    self.spans[ptr] = new
                    added += (new[1] - new[0]) - (old[1] - old[0])
        return added


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes ``tensors`` occupy, inner tensors of subclasses counted, shared storage once."""
    return ByteCounter().add(tensors)


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor of the optimizer's state (its moments, step counters; nested containers searched), and of its
    groups' hyperparameters (torchao's Adam keeps each group's lr as a tensor)."""
    hyper = [v for g in optimizer.param_groups for k, v in g.items() if k != "params" and isinstance(v, torch.Tensor)]
    return _state_tensors([*optimizer.state.values(), hyper])


def _state_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _state_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v)


def state_memory(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer],
                 masters: Iterable[torch.Tensor] = (), activations: int | None = None,
                 gradients: int | None = None) -> dict[str, int | None]:
    """The breakdown (bytes) of a model and its optimizers now: the frozen weights, the trained ones (parameters), their
    gradients, the optimizers' state
    less ``masters`` (which a kind keeps as the weights' exact values: ``master_weights``), and ``activations`` as
    measured (``saved_activations``); ``total`` adds them up. ``gradients``: as counted during a step, for a loop
    that sets them to None after its optimizer step."""
    counter = ByteCounter()
    params = list(model.parameters())
    masters = list(masters)
    master_ids = {id(t) for t in masters}
    out: dict[str, int | None] = {
        "frozen_weights": counter.add(p for p in params if not p.requires_grad),
        "parameters": counter.add(p for p in params if p.requires_grad),
        "gradients": counter.add(p.grad for p in params if p.grad is not None) if gradients is None else gradients,
        "master_weights": counter.add(masters),
        "optimizer_state": counter.add(t for opt in optimizers for t in state_tensors(opt)
                                       if id(t) not in master_ids),
        "activations": activations,
    }
    out["total"] = sum(v for v in out.values() if v is not None)
    return {k: out[k] for k in (*CATEGORIES, "total")}


@dataclass(frozen=True)
class ActivationPart:
    """Of a training step's activations, what some modules keep for their backward, counted apart (a kind's
    ``activation_parts``): its ``label`` is a column of bench's memory table and ``note`` says there what it is."""

    label: str
    note: str
    modules: tuple[nn.Module, ...] = ()
    width: int = 0  # also what is saved as wide as this (a language model's logits: ``loss_part``), wherever it runs


def as_wide(t: torch.Tensor, width: int) -> bool:
    """Whether ``t`` is as wide as a language model's logits (``width``, its vocabulary; never for 0): the logits,
    their float32 copy, the log-probabilities, their gradients."""
    return width > 0 and t.dim() >= 2 and t.shape[-1] == width


def loss_part(width: int) -> list[ActivationPart]:
    """The loss's share of the activations: what is saved as wide as a language model's logits (``width``, its
    vocabulary; none for 0): the float32 log-probabilities its cross-entropy keeps for the backward."""
    return [ActivationPart("loss", "the loss's logits and log-probabilities kept for the backward (as wide as the "
                                   "vocabulary; POLICY+chunked-ce computes them a chunk at a time)", (), width)] \
        if width else []


def part_records(parts: Sequence[ActivationPart], saved: dict[str, int]) -> list[dict[str, Any]]:
    """The parts as a record holds them (``MemoryBreakdown.parts``), with the bytes ``saved_activations`` counted."""
    return [{"label": p.label, "bytes": saved.get(p.label, 0), "note": p.note} for p in parts]


_KEEPERS: list[Any] = []  # the counts in progress (saved_activations): what else a backward keeps is said to them


def kept_for_backward(tensors: list[torch.Tensor]) -> None:
    """Tensors a step keeps for its backward outside autograd's saved-tensor hooks (a checkpointed block's inputs,
    which its recomputation holds): counted as activations by any count in progress."""
    for pack in _KEEPERS:
        for t in tensors:
            pack(t)


@contextlib.contextmanager
def saved_activations(model: nn.Module, parts: Sequence[ActivationPart] = ()) -> Iterator[dict[str, int]]:
    """Inside the block, count the bytes autograd saves for the backward pass (each storage once; the weights
    themselves excluded: they are counted as parameters). ``out["bytes"]`` holds the largest amount saved between two
    backward passes (gradient accumulation: one micro-batch's forward, freed by its backward before the next), which
    is the activations' peak; ``out["uncounted"]``, tensors it could not read (no storage). ``parts``: modules whose
    own saves are also counted apart, under their label (a LoRA adapter's input: ``out["adapters' inputs"]``), at the
    same peak."""
    weights = {leaf.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"
               for leaf in leaves(p)}
    named = {p.label: p.modules for p in parts}
    widths = {p.label: p.width for p in parts}
    live: dict[str, Any] = {"counter": ByteCounter(), "bytes": 0, "backward": False, **dict.fromkeys(named, 0)}
    out = {"bytes": 0, **dict.fromkeys(named, 0)}
    inside: dict[str, int] = dict.fromkeys(named, 0)  # how deep the forward is in each label's modules

    def pack(t: torch.Tensor) -> torch.Tensor:
        if live["backward"]:  # a backward pass ran since the last save: this is the next forward, from nothing
            live.update(counter=ByteCounter(), bytes=0, backward=False, **dict.fromkeys(named, 0))
        try:  # whatever the count meets, the training code it runs inside must go on
            if t.device.type == "meta" or t.untyped_storage().data_ptr() not in weights:
                added = live["counter"].add([t])
                live["bytes"] += added
                for label, depth in inside.items():
                    live[label] += added if depth or as_wide(t, widths[label]) else 0
                if live["bytes"] > out["bytes"]:
                    out.update(bytes=live["bytes"], **{label: live[label] for label in named})
        except Exception:
            out["uncounted"] = out.get("uncounted", 0) + 1
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        live["backward"] = True
        return t

    def enter(label: str) -> Any:
        return lambda module, args: inside.__setitem__(label, inside[label] + 1)

    def leave(label: str) -> Any:
        return lambda module, args, output: inside.__setitem__(label, inside[label] - 1)

    handles = [h for label, modules in named.items() for m in modules
               for h in (m.register_forward_pre_hook(enter(label)), m.register_forward_hook(leave(label)))]
    _KEEPERS.append(pack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield out
    finally:
        _KEEPERS.remove(pack)
        for h in handles:
            h.remove()
