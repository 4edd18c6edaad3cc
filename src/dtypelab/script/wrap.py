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
from typing import Any, Protocol

import torch
from torch import nn

from dtypelab.core.wrapping import Transparent, combined


class Session(Protocol):
    """What the wrappers route to (``script.handle.Session``)."""

    precision: Any

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def optimizer_step(self, opt: torch.optim.Optimizer, closure: Any = None) -> Any: ...

    def scale_loss(self, outputs: Any) -> Any: ...

    def unscale(self, opt: torch.optim.Optimizer) -> None: ...


class LabOptimizer(Transparent):
    """An optimizer as ``lab.setup`` returns it: ``step`` (with or without a closure) goes through the session
    (timed, GradScaler's step under a scaling policy); everything else is the wrapped optimizer's, whose
    ``param_groups`` and ``state`` are the very same objects (an LR scheduler may hold either)."""

    _lab_key = "_lab_optimizer"

    def __init__(self, optimizer: torch.optim.Optimizer, lab: Session) -> None:
        self.__dict__["_lab_optimizer"] = optimizer
        self.__dict__["_lab"] = lab

    @staticmethod
    def wrap(optimizer: torch.optim.Optimizer, lab: Session) -> LabOptimizer:
        cls = combined(LabOptimizer, type(optimizer))
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


class LabScaler(Transparent):
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
