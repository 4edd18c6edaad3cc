"""Every layer's ranges on a sampled step: the largest |value| a layer takes in and gives out in a low-precision
format (forward hooks, armed for that step only), and how much of its weight gradient sits below that format's
smallest normal (read after backward). Readings stay on the device until the step ends: one transfer per step,
no host sync per layer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from dtypelab.core.task import tensors

# The formats whose limits a layer can run into before float32's: bfloat16 has float32's range (and smallest normal),
# so a layer computing in it is not read at all; only the non-finite recovery applies there.
LOW = (torch.float16,)


@dataclass
class Reading:
    """One layer on one sampled step."""

    dtype: torch.dtype  # the low format it computed in (its output's)
    amax: float  # largest |value| of its float inputs and outputs (inputs: a low-precision layer casts them)
    underflow: float | None = None  # share of its weight gradient at or below the format's smallest normal


@dataclass
class Monitor:
    model: nn.Module
    _amax: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _dtype: dict[str, torch.dtype] = field(default_factory=dict)
    _under: dict[str, torch.Tensor] = field(default_factory=dict)

    _seen: set[tuple] = field(default_factory=set)

    def __post_init__(self) -> None:
        # leaves: a container's ranges are its children's
        self.leaves = {n: m for n, m in self.model.named_modules() if n and not any(True for _ in m.children())}

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Arm the forward hooks for one step."""
        self._amax, self._dtype, self._under, self._seen = {}, {}, {}, set()
        handles = [m.register_forward_hook(self._hook(n)) for n, m in self.leaves.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, out: object) -> None:
            outs = [t for t in _floats(out) if t.dtype in LOW]
            if not outs:  # computed in float32: no low-precision limit to run into
                return
            self._dtype[name] = outs[0].dtype
            with torch.no_grad():
                for t in outs + _floats(args):
                    key = (t.data_ptr(), t.dtype, t.numel())  # a layer's input is often the last one's output
                    if t.numel() and key not in self._seen:
                        self._seen.add(key)
                        lo, hi = torch.aminmax(t.detach())  # one pass, no |t| copy
                        self._amax.setdefault(name, []).append(torch.maximum(hi, -lo).float())
        return hook

    @torch.no_grad()
    def after_backward(self) -> None:
        """Read the weight gradients of the layers that computed in a low format (train_step's hook)."""
        for name in self._dtype:
            grads = [p.grad for p in self.leaves[name].parameters(recurse=False) if p.grad is not None]
            if grads:
                tiny = torch.finfo(self._dtype[name]).tiny
                counts = torch.stack([(g.abs() <= tiny).sum() for g in grads]).sum()
                self._under[name] = counts.float() / sum(g.numel() for g in grads)

    def take(self) -> dict[str, Reading]:
        """This step's readings, one transfer to the host."""
        names = [n for n in self._dtype if self._amax.get(n)]
        if not names:
            return {}
        amax = torch.stack([torch.stack(self._amax[n]).max() for n in names]).tolist()
        under_names = [n for n in names if n in self._under]
        under = dict(zip(under_names, torch.stack([self._under[n] for n in under_names]).tolist(), strict=True)) \
            if under_names else {}
        return {n: Reading(self._dtype[n], a, under.get(n)) for n, a in zip(names, amax, strict=True)}



def _floats(obj: object) -> list[torch.Tensor]:
    return [t for t in tensors(obj) if t.is_floating_point()]
