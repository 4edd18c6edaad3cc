"""A precision kind of your own, in one file: bfloat16 weights whose updates add up in a float32 master copy.

Pure bfloat16 training rounds every update into the weight's 8-bit mantissa: an update smaller than half the
weight's spacing (about weight / 256) is lost, so small learning rates and late training stall. Here the model and
its activations run in bfloat16 as before, but the optimizer steps a float32 copy of each weight (and keeps its own
state in float32); the bfloat16 weight is that copy, rounded, after every step.

    dtypelab bench digits --policies fp32,bf16,examples/custom_precision.py:bf16-master
    dtypelab bench train.py --policies fp32,examples/custom_precision.py:bf16-master

The kind is a frozen ``dtypelab.Config`` subclass with a ``kind`` name, which registers it, and its ``facts`` (what
it is, as data); ``register`` names a
policy that uses it. The hooks it overrides are the ones it needs (see the guide, "Your own precision"); what a
capability asks beyond them (here `tune`) is registered with that capability's adapters.
"""

# --8<-- [start:kind]
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dtypelab import Config, Facts, register
from dtypelab.tuning import RANGE_DTYPE, TUNES

# each bfloat16 weight's float32 master copy, by the weight's identity; weak, so it goes with the model
_MASTERS = WeakIdKeyDictionary()


@dataclass(frozen=True)
class BF16Master(Config):
    kind: ClassVar[str] = "bf16-master"

    @property
    def facts(self) -> Facts:
        # the model's weights and inputs are cast to bfloat16, whose speed verdict (the hardware probe's) applies;
        # small updates add up in the master copy: none is lost
        return Facts(modes=("train",), storage_dtype="bfloat16", compute_dtype="bfloat16", keeps_updates=True)

    def describe(self) -> str:
        return "bfloat16 weights and activations, updates applied to a float32 master copy (float32 optimizer state)"

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        """The optimizer steps the float32 copies (its state is made in float32 too); the weights take the result,
        rounded to bfloat16."""
        swapped = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dtype != torch.bfloat16:
                    continue  # a layer another config keeps in float32 steps as it is
                master = _MASTERS.get(p)
                if master is None:
                    master = _MASTERS[p] = p.detach().float()
                grad, p.grad = p.grad, None
                p.data = master  # the optimizer updates the master copy in place
                p.grad = grad.float()
                swapped.append(p)
        try:
            return step()
        finally:
            for p in swapped:
                grad, p.grad = p.grad, None
                p.data = p.data.to(torch.bfloat16)
                p.grad = grad.to(torch.bfloat16)


    def master_tensors(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The master copies, which bench's memory breakdown counts as ``master_weights``."""
        return [_MASTERS[p] for group in optimizer.param_groups for p in group["params"] if p in _MASTERS]


register("bf16-master", BF16Master())

# what `tune` asks of a kind (each capability keeps its own questions): it may give single layers this config when
# training, and its range audit checks each layer's values against bfloat16's
TUNES.register(BF16Master)(lambda config: ("train",))
RANGE_DTYPE.register(BF16Master)(lambda config: "bfloat16")
# --8<-- [end:kind]
