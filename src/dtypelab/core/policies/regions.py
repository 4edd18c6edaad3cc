"""Regions: a layer whose config differs from its parent's runs inside a wrapper that stands in its parent's slot
(``RegionModule``, routed by its ``Region``: its inputs cast, its autocast state, its outputs back to what the next
layer expects); the layer itself is never patched. ``regions(model)`` finds them."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.policies.configs import Config
from dtypelab.core.task import map_tensors
from dtypelab.core.wrapping import LabModule, combined


def floats_to(dtype: torch.dtype | None, obj: Any) -> Any:
    """Every floating tensor in ``obj`` in ``dtype`` (None: as they are)."""
    if dtype is None:
        return obj
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)


@dataclass(frozen=True)
class Region:
    """How a module whose config differs from its parent's runs: the router of the wrapper that stands in its
    parent's slot (``core.wrapping.LabModule``; the module itself is never patched)."""

    device_type: str
    config: Config
    input_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    outer: torch.dtype = torch.float32  # what the model around it computes in

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return self.config.region_context(self.device_type)

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = floats_to(self.input_dtype, (args, kwargs))
        with self.context():
            out = module(*args, **kwargs)  # through its __call__: the user's own hooks on it still run
        return floats_to(self.output_dtype, out)


class RegionModule(LabModule):
    """A layer in a region of its own, as its parent holds it. Pickled (``torch.save`` of the whole model) it is the
    user's layer, in the dtype of the model around it (a cast is exact), so the file loads, and runs, as plain
    PyTorch; copied (an EMA), a region around the copy."""

    @staticmethod
    def wrap(module: nn.Module, lab: Any) -> RegionModule:
        return combined(RegionModule, type(module))(module, lab)

    def _lab_written(self, inner: nn.Module) -> nn.Module:
        outer = self.__dict__["_lab"].outer
        tensors = [*inner.parameters(), *inner.buffers()]
        if any(t.is_floating_point() and t.dtype != outer for t in tensors) and all(
                type(t) in (torch.Tensor, nn.Parameter) for t in tensors):
            return copy.deepcopy(inner).to(outer)
        return inner


def regions(model: nn.Module) -> dict[str, Region]:
    """Each layer in a region of its own, by its name in the model (as ``named_modules`` names it)."""
    found: dict[str, Region] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module._modules.items():
            if child is None:
                continue
            full = f"{prefix}{name}"
            if isinstance(child, RegionModule):
                found[full] = child.__dict__["_lab"]
                child = child.__dict__["_lab_module"]
            walk(child, full + ".")

    walk(model.__dict__.get("_lab_module", model), "")
    return found


def slot(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds layer ``name`` (as it is now, a region's layer itself), and its key there."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return parent.__dict__.get("_lab_module", parent), leaf


def unwrapped(module: nn.Module) -> nn.Module:
    """A region's layer itself; any other module as it is."""
    return module.__dict__["_lab_module"] if isinstance(module, RegionModule) else module


__all__ = ["Region", "RegionModule", "floats_to", "regions", "slot", "unwrapped"]
