"""Wrappers that stand for a user's object without patching it: an instance of a class made once per user class,
derived from the wrapper and from the user's class (``isinstance`` and the user's own methods work), every attribute
the wrapper does not have read from and written to the wrapped object, ``pickle`` / ``torch.save`` writing the wrapped
object itself (its own class: loadable with ``weights_only=True`` and without dtypelab), ``copy.deepcopy`` giving a
wrapper around a copy. ``LabModule`` routes the module's calls to a router (``forward(module, args, kwargs)``): the
script session (``script.wrap``) for the model ``lab.setup`` returns, a region (``policies.precision``) for a layer a
plan gives a config of its own."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn


class Router(Protocol):
    """What a wrapped module's calls go to."""

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class Transparent:
    """``pickle`` / ``torch.save`` of a wrapper write the wrapped object itself: its own class, its own state, no
    dtypelab in the file (``torch.load(f, weights_only=True)`` with the user's ``safe_globals`` reads it back).

    pickle checks that the class its reduce names is ``obj.__class__``: ``__reduce_ex__`` arms a one-shot answer
    (the wrapped object's class) for that one look-up; every other ``__class__`` read is the wrapper's own."""

    _lab_key = ""

    def __reduce_ex__(self, protocol: Any) -> Any:
        d = object.__getattribute__(self, "__dict__")
        inner = self._lab_written(d[type(self)._lab_key])
        if isinstance(protocol, int) and protocol >= 2:  # only protocols 2+ check the class (copyreg.__newobj__)
            d["_lab_pickling"] = True
        return inner.__reduce_ex__(protocol)

    def _lab_written(self, inner: Any) -> Any:
        """What a file gets for the wrapped object: the object itself (a subclass may write a converted copy)."""
        return inner

    def _lab_class(self) -> type:
        d = object.__getattribute__(self, "__dict__")
        return type(d[type(self)._lab_key]) if d.pop("_lab_pickling", False) else type(self)

    def _lab_set_class(self, cls: type) -> None:
        # the wrapper's own class, swapped by whoever swaps it (FSDP2's fully_shard makes it an FSDP class)
        object.__dict__["__class__"].__set__(self, cls)

    __class__ = property(_lab_class, _lab_set_class)  # type: ignore[assignment]


@functools.cache
def combined(wrapper: type, user: type) -> type:
    """The class of a wrapped object: the wrapper first (its methods win), the user's class for ``isinstance`` and
    the user's own methods. Made once per pair, so that every wrapped object of one class shares it."""
    try:
        return type(f"Lab{user.__name__}", (wrapper, user), {"__module__": wrapper.__module__})
    except TypeError:  # a class that cannot be derived from (a metaclass conflict, __init_subclass__ rules)
        return wrapper


class LabModule(Transparent, nn.Module):
    """The model as ``lab.setup`` returns it: calls go through the session's forward (inputs converted, the
    policy's forward context, outputs back in float32 under autocast, the step timed); everything else is the
    wrapped module's."""

    _OWN = frozenset({"_lab", "_lab_module", "_lab_pickling"})
    _lab_key = "_lab_module"

    def __init__(self, module: nn.Module, lab: Router) -> None:
        nn.Module.__init__(self)  # not super(): the user's class's __init__ must not run again
        # the wrapped module's own containers, the very same dicts: the user's class's methods that read them on
        # self (``len(seq)``, ``seq[0]``, ``ModuleList.append``) see its children, and a parent's load_state_dict
        # walks into them
        for name in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
            self.__dict__[name] = module.__dict__[name]
        self.__dict__["_lab_module"] = module
        self.__dict__["_lab"] = lab
        self.__dict__["training"] = module.training

    @staticmethod
    def wrap(module: nn.Module, lab: Router) -> LabModule:
        return combined(LabModule, type(module))(module, lab)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_lab"].forward(self.__dict__["_lab_module"], args, kwargs)

    # --- attributes: the wrapped module's ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_lab_module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in LabModule._OWN:
            self.__dict__[name] = value
        elif name == "__class__":  # FSDP2's fully_shard swaps the class of the module it shards: the wrapper's
            object.__setattr__(self, name, value)
        elif name == "training":
            self.__dict__["training"] = value
            self.__dict__["_lab_module"].training = value
        else:
            setattr(self.__dict__["_lab_module"], name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.__dict__["_lab_module"], name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.__dict__["_lab_module"])) | set(object.__dir__(self)))

    def __repr__(self) -> str:
        return repr(self.__dict__["_lab_module"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        # a router that counts the step's gradients sees them first (weights updated by hand zero them here,
        # before the next step's forward, where the step is otherwise seen to end)
        before = getattr(self.__dict__["_lab"], "before_zero_grad", None)
        if before is not None:
            before()
        self.__dict__["_lab_module"].zero_grad(set_to_none)

    # --- nn.Module's tree: the wrapped module's, names unchanged -----------------------------------------------
    def train(self, mode: bool = True) -> LabModule:
        self.__dict__["_lab_module"].train(mode)
        self.__dict__["training"] = mode
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> LabModule:  # .to(), .cuda(), .half(), .double()
        self.__dict__["_lab_module"]._apply(fn, recurse)
        return self

    def apply(self, fn: Any) -> LabModule:
        self.__dict__["_lab_module"].apply(fn)
        return self

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.__dict__["_lab_module"].named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self.__dict__["_lab_module"].named_buffers(*args, **kwargs)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self.__dict__["_lab_module"].named_children()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        # the wrapped module's modules under their names, itself as this wrapper (what its parent holds and calls):
        # FSDP2 shards a wrapped block as a unit and finds the unit's state again by walking the root's modules
        inner = self.__dict__["_lab_module"]
        for name, module in inner.named_modules(*args, **kwargs):
            yield name, (self if module is inner else module)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_lab_module"].state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_lab_module"].load_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        # a module that holds this one as a child (an EMA container, a compiled model, a region's parent) loads it
        # through here: the wrapped module's own tensors (its children through the shared ``_modules``)
        self.__dict__["_lab_module"]._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                            unexpected_keys, error_msgs)

    def register_buffer(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_lab_module"].register_buffer(*args, **kwargs)

    def register_parameter(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_lab_module"].register_parameter(*args, **kwargs)

    def add_module(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_lab_module"].add_module(*args, **kwargs)

    def get_submodule(self, target: str) -> nn.Module:
        return self.__dict__["_lab_module"].get_submodule(target)

    # --- copies: a wrapper around a copy (pickling: Transparent) ----------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> LabModule:
        # an EMA copy: a wrapper around a copy of the weights, so that it computes with its own
        new = type(self).wrap(copy.deepcopy(self.__dict__["_lab_module"], memo), self.__dict__["_lab"])
        memo[id(self)] = new
        return new

    def __copy__(self) -> LabModule:
        return type(self).wrap(copy.copy(self.__dict__["_lab_module"]), self.__dict__["_lab"])


__all__ = ["LabModule", "Router", "Transparent", "combined"]
