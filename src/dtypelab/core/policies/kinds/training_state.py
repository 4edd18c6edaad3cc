"""The precision of the training *state*: bfloat16 weights whose small updates are not rounded away
(``BF16Update``: stochastic rounding or Kahan summation), and Adam's state in 8 or 4 bits or float8
(``LowBitState``, the ``+adam8bit`` modifier a plan carries in ``Plan.state``).

Both replace the task's or script's optimizer with the maintained implementation of the same algorithm, with the
same hyperparameters and the same parameter-group dicts (an LR scheduler made on the old optimizer still reaches the
new one): torchao's ``_AdamW(bf16_stochastic_round=True)`` and its low-bit ``AdamW8bit`` / ``AdamW4bit`` /
``AdamWFp8``; torch-optimi's optimizers with ``kahan_sum=True``. An optimizer with no such variant is a skip
(``Unsupported``) that names it, never a silent fallback.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dtypelab.core.backends import quiet
from dtypelab.core.errors import DtypelabError, Unsupported
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, Facts, bf16_missing, cuda_missing
from dtypelab.core.policies.registry import in_default, register, register_state_modifier

METHODS = {"stochastic-round": "bf16-sr", "kahan": "bf16-kahan"}
BITS = {"8bit": "8-bit", "4bit": "4-bit", "fp8": "float8"}
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def _adam_family(optimizer: torch.optim.Optimizer) -> str | None:
    """'adamw' or 'adam' for torch's and torchao's Adam optimizers (decoupled weight decay or not), else None."""
    if isinstance(optimizer, torch.optim.Adam):  # torch's AdamW is an Adam with decoupled weight decay
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        if any(g.get("maximize") for g in optimizer.param_groups):
            return None
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
        return "adamw" if decoupled else "adam"
    if type(optimizer).__module__.startswith("torchao.optim"):
        return "adamw" if getattr(optimizer, "is_adamw", False) else "adam"
    return None


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _groups(optimizer: torch.optim.Optimizer, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The optimizer's own group dicts (shared with whatever holds them: an LR scheduler), with the hyperparameters
    ``keys`` as plain numbers; the keys the new optimizer does not take stay in the dict and are ignored by it."""
    for group in optimizer.param_groups:
        for key in keys:
            if key in group:
                group[key] = _scalar(group[key])
    return optimizer.param_groups


def _check_fresh(optimizer: torch.optim.Optimizer, what: str) -> None:
    if any(optimizer.state.values()):
        raise DtypelabError(f"{what} replaces the optimizer with its own, before the first step; this "
                            f"{type(optimizer).__name__} has stepped already (its state would be lost)")


def lr_as_tensor(optimizer: torch.optim.Optimizer) -> None:
    """torchao's Adam keeps each group's lr as a tensor; a script that assigns a number each step (nanoGPT's
    schedule) would make it refuse to step: the number goes into the tensor instead."""
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if lr is not None and not isinstance(lr, torch.Tensor):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32)


def _torchao_adam(optimizer: torch.optim.Optimizer, bits: str | None, stochastic: bool, what: str,
                  ) -> torch.optim.Optimizer:
    family = _adam_family(optimizer)
    if family is None:
        raise Unsupported(f"{what}: no {'low-bit' if bits else 'stochastic-rounding'} variant of "
                          f"{type(optimizer).__name__} (torchao has Adam and AdamW)")
    _check_fresh(optimizer, what)
    from dtypelab.core.backends import torchao_module

    optim = torchao_module("optim")
    name = {None: "_AdamW", "8bit": "{}8bit", "4bit": "{}4bit", "fp8": "{}Fp8"}[bits]
    cls = getattr(optim, name.format("AdamW" if family == "adamw" else "Adam"))
    groups = _groups(optimizer, _ADAM_KEYS)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in _ADAM_KEYS}
    defaults["lr"] = _scalar(defaults.get("lr", 1e-3))
    if bits is None and family == "adam" and any(g.get("weight_decay", 0) for g in groups):
        raise Unsupported(f"{what}: torchao's stochastic-rounding Adam decouples weight decay (AdamW); this "
                          "Adam couples it (L2), and a different algorithm would be measured")
    with quiet():  # torchao's subclass warns about AOT caching on every new state
        return cls(groups, **defaults, bf16_stochastic_round=stochastic)


def _optimi(optimizer: torch.optim.Optimizer, what: str) -> torch.optim.Optimizer:
    """torch-optimi's version of a torch optimizer, with Kahan-compensated updates of low-precision weights."""
    try:
        import optimi
    except ImportError as exc:
        raise DtypelabError(f"{what} needs torch-optimi ({exc}); pip install torch-optimi") from None
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    missing = [k for k in ("maximize", "nesterov", "amsgrad") if any(g.get(k) for g in groups)]
    if missing:  # dropping one would measure another algorithm
        raise Unsupported(f"{what}: torch-optimi's {name} has no {missing[0]}")
    family = _adam_family(optimizer)
    if family == "adamw":
        cls, keys = optimi.AdamW, ("lr", "betas", "eps", "weight_decay")
    elif family == "adam":
        cls, keys = optimi.Adam, ("lr", "betas", "eps", "weight_decay")
    elif type(optimizer) is torch.optim.SGD:
        # torch's dampening is a factor; torch-optimi's is "dampen by (1 - momentum)" or not at all
        for g in groups:
            if g.get("dampening", 0) not in (0, g.get("momentum", 0)):
                raise Unsupported(f"{what}: torch-optimi's SGD dampens by 1 - momentum or not at all; this SGD "
                                  f"dampens by {g['dampening']}")
            g["dampening"] = bool(g.get("dampening", 0)) and bool(g.get("momentum", 0))
        cls, keys = optimi.SGD, ("lr", "momentum", "weight_decay", "dampening")
    elif type(optimizer) is torch.optim.RAdam:
        cls, keys = optimi.RAdam, ("lr", "betas", "eps", "weight_decay")
    else:
        raise Unsupported(f"{what}: no Kahan-summation variant of {name} (torch-optimi has Adam, AdamW, SGD and "
                          "RAdam of torch's)")
    _check_fresh(optimizer, what)
    _groups(optimizer, keys)
    defaults = {k: _scalar(v) for k, v in optimizer.defaults.items() if k in keys}
    if cls is optimi.SGD:
        defaults["dampening"] = bool(defaults.get("dampening")) and bool(defaults.get("momentum"))
        defaults["torch_init"] = True  # momentum starts at the first gradient, as torch's SGD does
    return cls(groups, **defaults, kahan_sum=True, foreach=False)


@dataclass(frozen=True)
class BF16Update(Config):
    """bfloat16 weights (and activations, gradients, optimizer state), with updates that survive the rounding:
    ``stochastic-round`` rounds each updated weight up or down at random, in proportion (torchao), so small updates
    are kept on average; ``kahan`` keeps each weight's rounding error in a bfloat16 buffer and adds it back at the
    next step (torch-optimi)."""

    kind: ClassVar[str] = "bf16-update"
    method: str = "stochastic-round"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise DtypelabError(f"bf16-update: unknown method {self.method!r}; use {' or '.join(METHODS)}")

    @property
    def label(self) -> str:
        return METHODS[self.method]

    @property
    def facts(self) -> Facts:
        return Facts(modes=("train",), storage_dtype="bfloat16", compute_dtype="bfloat16", keeps_updates=True,
                     backend="torchao" if self.method == "stochastic-round" else "torch-optimi")

    def describe(self) -> str:
        how = ("updates stochastically rounded (torchao _AdamW, bf16_stochastic_round)" if self.method ==
               "stochastic-round" else "Kahan-compensated updates (torch-optimi kahan_sum)")
        return f"bfloat16 weights, activations, gradients and optimizer state; {how}"

    def supported(self, hw: HardwareInfo) -> str | None:
        return bf16_missing(hw, self.label)

    def region(self, parent: Config, outer: torch.dtype) -> Config | None:
        if outer == torch.bfloat16 and parent.facts.autocast_dtype is None:
            return None  # inside a bfloat16 model already: only the optimizer differs
        return self

    def convert_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        if self.method == "kahan":
            return _optimi(optimizer, self.label)
        if type(optimizer).__module__.startswith("torchao.optim"):
            optimizer.bf16_stochastic_round = True  # already torchao's (a low-bit state): it rounds the same way
            return optimizer
        return _torchao_adam(optimizer, None, True, self.label)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        if self.method == "stochastic-round":
            lr_as_tensor(optimizer)
        return step()

    def master_tensors(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        # Kahan's compensation buffers hold each weight's low bits: the part of a master copy this method keeps
        return [s["kahan_comp"] for s in optimizer.state.values() if isinstance(s.get("kahan_comp"), torch.Tensor)]


@dataclass(frozen=True)
class LowBitState(Config):
    """Adam's two moments stored in 8 or 4 bits (block-wise scaled) or float8: torchao's low-bit Adam, for any
    plan whose optimizer is Adam or AdamW. torchao leaves tensors under 4096 elements in full precision."""

    kind: ClassVar[str] = "optimizer-state"
    bits: str = "8bit"

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise DtypelabError(f"optimizer-state: unknown bits {self.bits!r}; use one of {', '.join(BITS)}")

    @property
    def label(self) -> str:
        return f"adam{self.bits}"

    @property
    def facts(self) -> Facts:
        return Facts(modes=("train",), backend="torchao", gpu_only=self.bits == "fp8")

    def describe(self) -> str:
        return f"Adam state in {BITS[self.bits]} (torchao {'AdamWFp8' if self.bits == 'fp8' else self.label})"

    def supported(self, hw: HardwareInfo) -> str | None:
        return cuda_missing(hw, "float8 Adam state (AdamWFp8)", (8, 9)) if self.bits == "fp8" else None

    def plan_error(self, plan: Any) -> str | None:
        if any(isinstance(c, BF16Update) and c.method == "kahan" for c in plan.configs):
            return ("Kahan summation is torch-optimi's optimizer and low-bit state is torchao's: they do not "
                    "combine (bf16-sr+adam8bit does)")
        if self in (plan.default, *(c for _, c in plan.rules)):
            return f"{self.label} is a modifier of the optimizer (POLICY+{self.label}), not a module's config"
        return None

    def region(self, parent: Config, outer: torch.dtype) -> Config | None:
        return None

    def convert_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        stochastic = bool(getattr(optimizer, "bf16_stochastic_round", False))
        return _torchao_adam(optimizer, self.bits, stochastic, self.label)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        lr_as_tensor(optimizer)
        with warnings.catch_warnings():  # torchao's state subclass warns about AOT caching when its step compiles
            warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")
            return step()


# bfloat16 weights whose small updates survive: a question of their own (see the bench note when pure bf16 loses
# them), named, not in a training sweep
register("bf16-sr", BF16Update("stochastic-round"), sweeps=frozenset({"cpu-infer", "gpu-infer"}), rank=23)
register("bf16-kahan", BF16Update("kahan"), sweeps=frozenset({"cpu-infer", "gpu-infer"}), rank=24)
# POLICY+adam8bit, a modifier of any policy that trains with Adam or AdamW: the optimizer's moments in fewer bits
for _state in (LowBitState("8bit"), LowBitState("4bit"), LowBitState("fp8")):
    register_state_modifier(_state)
in_default("forecast-train", "bf16-kahan", 4)
in_default("forecast-train", "bf16-sr+adam8bit", 5)
