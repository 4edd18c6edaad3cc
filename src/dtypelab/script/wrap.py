"""What ``lab.setup`` returns: the script's model, optimizers and GradScaler *wrapped*, never patched.

The user's own objects are left exactly as they were (no instance attribute added or replaced), so whatever the
script does with them works as without dtypelab: ``torch.save(model)`` and ``pickle`` write the user's own class
(loadable with ``weights_only=True`` and without dtypelab), ``copy.deepcopy(model)`` gives a model that computes
with its own weights, ``state_dict()`` keys are unchanged, LR schedulers built before or after keep working.

The wrappers are the shape of Lightning Fabric's ``_FabricModule`` / ``_FabricOptimizer``: each is an instance of a
class made once per user class that derives from the wrapper and from the user's class, so ``isinstance`` checks
(``isinstance(opt, torch.optim.Optimizer)``, ``isinstance(model, MyNet)``) and the user's own methods
(``model.generate(...)`` calling ``self(...)``) go through the wrapper; every attribute the wrapper does not have is
read from, and written to, the wrapped object. What a forward or a step *does* is the session's
(``script.handle``): the wrappers only route calls to it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn


class Session(Protocol):
    """What the wrappers route to (``script.handle.Session``)."""

    precision: Any

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def optimizer_step(self, opt: torch.optim.Optimizer, closure: Any = None) -> Any: ...

    def scale_loss(self, outputs: Any) -> Any: ...

    def unscale(self, opt: torch.optim.Optimizer) -> None: ...


class _Transparent:
    """``pickle`` / ``torch.save`` of a wrapper write the wrapped object itself: its own class, its own state, no
    dtypelab in the file (``torch.load(f, weights_only=True)`` with the user's ``safe_globals`` reads it back).

    pickle checks that the class its reduce names is ``obj.__class__``: ``__reduce_ex__`` arms a one-shot answer
    (the wrapped object's class) for that one look-up; every other ``__class__`` read is the wrapper's own."""

    _lab_key = ""

    def __reduce_ex__(self, protocol: Any) -> Any:
        d = object.__getattribute__(self, "__dict__")
        inner = d[type(self)._lab_key]
        if isinstance(protocol, int) and protocol >= 2:  # only protocols 2+ check the class (copyreg.__newobj__)
            d["_lab_pickling"] = True
        return inner.__reduce_ex__(protocol)

    def _lab_class(self) -> type:
        d = object.__getattribute__(self, "__dict__")
        return type(d[type(self)._lab_key]) if d.pop("_lab_pickling", False) else type(self)

    __class__ = property(_lab_class)  # type: ignore[assignment]


@functools.cache
def _combined(wrapper: type, user: type) -> type:
    """The class of a wrapped object: the wrapper first (its methods win), the user's class for ``isinstance`` and
    the user's own methods. Made once per pair, so that every wrapped object of one class shares it."""
    try:
        return type(f"Lab{user.__name__}", (wrapper, user), {"__module__": wrapper.__module__})
    except TypeError:  # a class that cannot be derived from (a metaclass conflict, __init_subclass__ rules)
        return wrapper


class LabModule(_Transparent, nn.Module):
    """The model as ``lab.setup`` returns it: calls go through the session's forward (inputs converted, the
    policy's forward context, outputs back in float32 under autocast, the step timed); everything else is the
    wrapped module's."""

    _OWN = frozenset({"_lab", "_lab_module", "_lab_pickling"})
    _lab_key = "_lab_module"

    def __init__(self, module: nn.Module, lab: Session) -> None:
        nn.Module.__init__(self)  # not super(): the user's class's __init__ must not run again
        self.__dict__["_lab_module"] = module
        self.__dict__["_lab"] = lab
        self.__dict__["training"] = module.training

    @staticmethod
    def wrap(module: nn.Module, lab: Session) -> LabModule:
        return _combined(LabModule, type(module))(module, lab)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_lab"].forward(self.__dict__["_lab_module"], args, kwargs)

    # --- attributes: the wrapped module's ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_lab_module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in LabModule._OWN:
            self.__dict__[name] = value
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
        return self.__dict__["_lab_module"].named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_lab_module"].state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_lab_module"].load_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        # a module that holds this model as a child (an EMA container, a compiled model) loads it through here:
        # the keys under ``prefix`` are the wrapped model's own
        own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        result = self.__dict__["_lab_module"].load_state_dict(own, strict=False)
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)

    def register_buffer(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_lab_module"].register_buffer(*args, **kwargs)

    def register_parameter(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_lab_module"].register_parameter(*args, **kwargs)

    def add_module(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_lab_module"].add_module(*args, **kwargs)

    def get_submodule(self, target: str) -> nn.Module:
        return self.__dict__["_lab_module"].get_submodule(target)

    # --- copies: a wrapper around a copy (pickling: _Transparent) ----------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> LabModule:
        # an EMA copy: a wrapper around a copy of the weights, so that it computes with its own
        new = LabModule.wrap(copy.deepcopy(self.__dict__["_lab_module"], memo), self.__dict__["_lab"])
        memo[id(self)] = new
        return new

    def __copy__(self) -> LabModule:
        return LabModule.wrap(copy.copy(self.__dict__["_lab_module"]), self.__dict__["_lab"])


class LabOptimizer(_Transparent):
    """An optimizer as ``lab.setup`` returns it: ``step`` (with or without a closure) goes through the session
    (timed, GradScaler's step under a scaling policy); everything else is the wrapped optimizer's, whose
    ``param_groups`` and ``state`` are the very same objects (an LR scheduler may hold either)."""

    _lab_key = "_lab_optimizer"

    def __init__(self, optimizer: torch.optim.Optimizer, lab: Session) -> None:
        self.__dict__["_lab_optimizer"] = optimizer
        self.__dict__["_lab"] = lab

    @staticmethod
    def wrap(optimizer: torch.optim.Optimizer, lab: Session) -> LabOptimizer:
        cls = _combined(LabOptimizer, type(optimizer))
        obj = object.__new__(cls)
        LabOptimizer.__init__(obj, optimizer, lab)
        return obj

    def step(self, closure: Any = None) -> Any:
        return self.__dict__["_lab"].optimizer_step(self.__dict__["_lab_optimizer"], closure)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_lab_optimizer"].zero_grad(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.__dict__["_lab_optimizer"].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__["_lab_optimizer"].load_state_dict(state_dict)

    def add_param_group(self, group: dict[str, Any]) -> None:
        self.__dict__["_lab_optimizer"].add_param_group(group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_lab_optimizer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # what an LR scheduler marks on the optimizer (its wrapped ``step``, ``_opt_called``) stays on the
        # wrapper; the optimizer's own state is the optimizer's
        if name in ("param_groups", "state", "defaults"):
            setattr(self.__dict__["_lab_optimizer"], name, value)
        else:
            self.__dict__[name] = value

    def __repr__(self) -> str:
        return repr(self.__dict__["_lab_optimizer"])

    def __deepcopy__(self, memo: dict[int, Any]) -> LabOptimizer:
        new = LabOptimizer.wrap(copy.deepcopy(self.__dict__["_lab_optimizer"], memo), self.__dict__["_lab"])
        memo[id(self)] = new
        return new


class LabScaler(_Transparent):
    """The script's own GradScaler, handed to ``lab.setup``: the policy decides the loss scaling. Under a policy
    with a GradScaler its calls (``scale``, ``unscale_``, ``step``, ``update``) are the policy's scaler's; under any
    other they pass the loss and the step through unscaled, whatever the script's ``enabled=`` said. Its
    ``state_dict`` stays the script's own scaler's (checkpoints keep their format)."""

    _lab_key = "_lab_scaler"

    def __init__(self, scaler: torch.amp.GradScaler, lab: Session) -> None:
        self.__dict__["_lab_scaler"] = scaler
        self.__dict__["_lab"] = lab

    def scale(self, outputs: Any) -> Any:
        return self.__dict__["_lab"].scale_loss(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.__dict__["_lab"].unscale(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, LabOptimizer):  # what setup returned: it steps through the policy's scaler
            return optimizer.step(*args, **kwargs)
        # the script's own optimizer object (it kept its old name): stepped through the policy all the same
        return self.__dict__["_lab"].optimizer_step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        """Nothing: the session updates the policy's scale once every optimizer of the step has stepped."""

    def get_scale(self) -> float:
        return self.__dict__["_lab"].precision.grad_scale()

    def is_enabled(self) -> bool:
        return self.__dict__["_lab"].precision.grad_scaler() is not None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_lab_scaler"], name)


def unwrap(obj: Any) -> Any:
    """The script's own object behind a wrapper (itself when it is none)."""
    for key in ("_lab_module", "_lab_optimizer", "_lab_scaler"):
        inner = getattr(obj, "__dict__", {}).get(key)
        if inner is not None:
            return inner
    return obj
