"""The model without its bytes: built on the meta device, and given fake twins on the CPU for a trace; torch.compile
run eagerly, as fake tensors need."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dtypelab.core.errors import TaskError, describe_exception
from dtypelab.core.task import Task


def meta_model(task: Task, seed: int) -> tuple[nn.Module, str]:
    """The task's model on the meta device, and a note when its factory could not build there (it is then built for
    real and its tensors allocated on this machine)."""
    torch.manual_seed(seed)
    try:
        # a factory that loads pretrained weights copies them into meta parameters: a no-op, which torch warns of
        with torch.device("meta"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
            return task.make_model(), ""
    except Exception as exc:
        note = f"the model's factory failed on the meta device ({describe_exception(exc)}); it was built for real here"
    torch.manual_seed(seed)
    try:
        return task.make_model(), note
    except Exception as exc:
        raise TaskError(f"building the model raised {describe_exception(exc)}") from exc


class _Twins:
    """Each real tensor's fake twin, made once: shared tensors stay shared. The originals are kept alive until the
    end, so that no id is reused for another tensor."""

    def __init__(self, mode: Any, device: torch.device) -> None:
        self.mode, self.device = mode, device
        self.memo: dict[int, torch.Tensor] = {}
        self.keep: list[Any] = []

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.memo:
            return self.memo[id(t)]
        self.keep.append(t)
        if is_traceable_wrapper_subclass(t):  # a tensor subclass (torchao's quantized weights): fake inner tensors
            names, ctx = t.__tensor_flatten__()
            inner = {n: self.tensor(getattr(t, n)) for n in names}
            out = type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
        elif t.device.type == "meta":
            out = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, t, self.device)
        else:
            out = self.mode.from_tensor(t)
        self.memo[id(t)] = out
        return out

    def parameter(self, p: nn.Parameter) -> torch.Tensor:
        if id(p) not in self.memo:
            self.keep.append(p)
            inner = p if is_traceable_wrapper_subclass(p) else p.detach()
            self.memo[id(p)] = nn.Parameter(self.tensor(inner), requires_grad=p.requires_grad)
        return self.memo[id(p)]


def materialize(model: nn.Module, mode: Any, device: torch.device) -> None:
    """Give every parameter, buffer and tensor attribute of ``model`` a fake twin on ``device`` (in place): shared
    tensors stay shared, a tensor subclass (torchao's quantized weights) gets fake inner tensors."""
    twins = _Twins(mode, device)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = twins.parameter(p)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = twins.tensor(b)
        for name, value in list(vars(module).items()):  # tensors kept as plain attributes (a mask, a table)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(module, name, twins.tensor(value))


@contextmanager
def faked() -> Iterator[Any]:
    """A FakeTensorMode (enter it under ``eager()``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _warm_constants()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def eager() -> Any:
    """torch.compile's functions run eagerly: inductor's kernels cannot run on fake tensors, and torch.compile
    cannot trace under a dispatch mode (the ledger); a compiled policy is counted as its eager ops."""
    return torch.compiler.set_stance("force_eager")


def _warm_constants() -> None:
    """torchao's low-bit optimizers build their quantization tables (small real constants, cached) the first time a
    state is made; made under fake tensors they would have no values to read."""
    try:
        from torchao.optim import subclass_4bit, subclass_8bit
    except Exception:  # no torchao: none of its optimizers can be asked for
        return
    for module in (subclass_8bit, subclass_4bit):
        for name in dir(module):
            if name.startswith("get_qmap"):
                getattr(module, name)()


def fresh(model: nn.Module) -> nn.Module:
    """A copy of a meta-device model to convert and trace (a deep copy of meta tensors costs nothing). Frozen weights
    of a tensor subclass are shared, not copied: nothing changes them, and a copy of torchao's NF4 weight quantizes
    its dequantized values again (on the meta device into another layout: its one-element factor's storage shrinks
    from the 512 bytes a real one keeps)."""
    memo: dict[int, Any] = {id(p): p for p in model.parameters()
                            if not p.requires_grad and is_traceable_wrapper_subclass(p)}
    return copy.deepcopy(model, memo)
