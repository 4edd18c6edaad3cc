"""Activation checkpointing (``POLICY+ckpt``): each of a model's repeated blocks recomputed in the backward instead of
keeping its activations (``torch.utils.checkpoint``, non-reentrant). A block runs inside a wrapper in its parent's
slot (``CheckpointModule``); the block itself is not patched, and its names, ``state_dict`` keys and pickled form are
its own.

The blocks are what every transformer repeats: the children of a ``ModuleList`` or ``Sequential`` of two or more
modules of one class (``layers.0`` … ``layers.31``, ``encoder.layer.*``), the outermost such lists."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtypelab.core.errors import Unsupported
from dtypelab.core.footprint import kept_for_backward
from dtypelab.core.wrapping import LabModule, combined


def repeated_blocks(model: nn.Module) -> list[str]:
    """The names of the model's repeated blocks, outermost lists first (none: the model repeats nothing)."""
    found: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            kids = list(child.children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) else []
            if len(kids) >= 2 and len({type(c) for c in kids}) == 1 and next(kids[0].parameters(), None) is not None:
                found.extend(f"{full}.{n}" for n, _ in child.named_children())
                continue
            walk(child, full + ".")

    walk(model.__dict__.get("_lab_module", model), "")
    return found


_RECOMPUTING: list[nn.Module] = []  # the checkpointed blocks being recomputed now (in a backward), innermost last


def recomputing() -> list[nn.Module]:
    """The blocks whose forward is being run again for the backward (a tracker of modules then sees no new
    forward, and a ledger tells which block runs from here)."""
    return _RECOMPUTING


# a block's key/value cache, as Hugging Face's decoder layers take it (a Cache they append to in place)
CACHE_ARGUMENTS = ("past_key_value", "past_key_values", "layer_past")


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A checkpointed block's keyword arguments with no key/value cache: its recomputation would append the keys to
    the cache a second time (a Phi-3 or Gemma-2 block then attends over more keys than its mask has), and a training
    step reads no cache. Hugging Face's own checkpointing turns ``use_cache`` off for the same reason."""
    if not any(kwargs.get(k) is not None for k in CACHE_ARGUMENTS) and not kwargs.get("use_cache"):
        return kwargs
    out = {k: (None if k in CACHE_ARGUMENTS else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


class Recompute:
    """The router of a checkpointed block: under grad mode, the block's forward through ``torch.utils.checkpoint``
    (its inputs kept, everything inside recomputed in the backward); a plain call otherwise."""

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():
            return module(*args, **kwargs)
        kwargs = without_cache(kwargs)
        # what the checkpoint keeps for the backward (its inputs) is held outside autograd's saved-tensor hooks:
        # said to whoever counts the saved activations
        kept_for_backward([t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)])
        calls = [0]

        def run(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return module(*a, **k)
            _RECOMPUTING.append(module)  # the second call is the backward's recomputation
            try:
                return module(*a, **k)
            finally:
                _RECOMPUTING.pop()

        return checkpoint(run, *args, use_reentrant=False, **kwargs)


class CheckpointModule(LabModule):
    """A repeated block as its parent holds it, recomputed in the backward."""

    @staticmethod
    def wrap(module: nn.Module, lab: Recompute | None = None) -> CheckpointModule:
        return combined(CheckpointModule, type(module))(module, lab or Recompute())


def checkpoint_blocks(model: nn.Module, what: str = "+ckpt") -> list[str]:
    """Wrap each repeated block of ``model`` (in place, in its parent's slot); their names. A model that repeats
    nothing is refused (``Unsupported``: the policy is skipped, saying why)."""
    blocks = repeated_blocks(model)
    if not blocks:
        top = [f"{n} ({type(c).__name__})" for n, c in model.named_children()][:6]
        raise Unsupported(f"{what}: the model has no repeated blocks to checkpoint (a ModuleList or Sequential of two "
                          f"or more modules of one class); its top-level modules: {', '.join(top) or 'none'}")
    root = model.__dict__.get("_lab_module", model)
    for name in blocks:
        parent_name, _, leaf = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        parent = parent.__dict__.get("_lab_module", parent)
        if not isinstance(parent._modules[leaf], CheckpointModule):
            parent._modules[leaf] = CheckpointModule.wrap(parent._modules[leaf])
    return blocks


__all__ = ["CheckpointModule", "checkpoint_blocks", "recomputing", "repeated_blocks"]
