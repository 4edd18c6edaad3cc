"""Distributed modifiers: where precision enters multi-process training besides the model's own numerics.

``Distributed(strategy, hook, rank, param_dtype, reduce_dtype)`` rides on a plan (``Plan.distributed``) and is
written after the precision policy with ``+``::

    fp32+ddp                            DDP, gradients all-reduced in float32 (what --nproc runs by default)
    fp32+ddp-fp16 / fp32+ddp-bf16       DDP, gradients cast to float16 / bfloat16 for the all-reduce
    fp32+ddp-powersgd / +ddp-powersgd-r4   DDP with PowerSGD low-rank compression (rank 1 / 4, error feedback)
    fp32+fsdp                           FSDP2 (fully_shard), float32 all-gathers and reduce-scatters
    fp32+fsdp-bf16-params-fp32-reduce   FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
    amp-bf16+ddp-bf16, plan.json+fsdp   any precision policy or plan file composes with any modifier

Plan files say the same as ``"distributed": {"strategy": "ddp", "hook": "fp16"}``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies.configs import from_fields

STRATEGIES = ("ddp", "fsdp")
HOOKS = ("none", "fp16", "bf16", "powersgd")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32",
           "bfloat16": "bfloat16", "float16": "float16"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Distributed:
    """How gradients (and, under FSDP, parameters) travel between ranks."""

    strategy: str = "ddp"
    hook: str = "none"  # ddp: the communication hook
    rank: int = 1  # powersgd: matrix approximation rank
    start_iter: int = 2  # powersgd: plain all-reduce before this step (error feedback needs it > 1)
    param_dtype: str | None = None  # fsdp: the dtype parameters are all-gathered and computed in
    reduce_dtype: str | None = None  # fsdp: the dtype gradients are reduce-scattered in

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise DtypelabError(f"unknown distributed strategy {self.strategy!r}: use {' or '.join(STRATEGIES)}")
        if self.hook not in HOOKS:
            raise DtypelabError(f"unknown DDP communication hook {self.hook!r}: use one of {', '.join(HOOKS)}")
        if self.strategy == "fsdp" and self.hook != "none":
            raise DtypelabError("communication hooks are for DDP; FSDP's wire dtypes are its param/reduce dtypes")
        if self.strategy == "ddp" and (self.param_dtype or self.reduce_dtype):
            raise DtypelabError("param/reduce dtypes are FSDP's mixed-precision policy; DDP uses a hook (ddp-bf16)")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None:
                if value not in _DTYPES:
                    raise DtypelabError(f"fsdp {name}: unknown dtype {value!r}; use fp32, bf16 or fp16")
                object.__setattr__(self, name, _DTYPES[value])
        if self.rank < 1 or self.start_iter < 2:
            raise DtypelabError("powersgd: the rank must be >= 1 and start_iter >= 2 (error feedback needs it)")

    @property
    def label(self) -> str:
        if self.strategy == "fsdp":
            parts = ["fsdp"]
            if self.param_dtype:
                parts.append(f"{_SHORT[self.param_dtype]}-params")
            if self.reduce_dtype:
                parts.append(f"{_SHORT[self.reduce_dtype]}-reduce")
            return "-".join(parts)
        if self.hook == "none":
            return "ddp"
        if self.hook == "powersgd":
            return "ddp-powersgd" + (f"-r{self.rank}" if self.rank != 1 else "")
        return f"ddp-{self.hook}"

    @property
    def compute_dtype(self) -> str | None:
        """The dtype FSDP computes in (None: the precision policy's own)."""
        return self.param_dtype

    def describe(self) -> str:
        if self.strategy == "fsdp":
            mp = "" if not (self.param_dtype or self.reduce_dtype) else (
                f", parameters in {self.param_dtype or 'their dtype'}, gradients reduced in "
                f"{self.reduce_dtype or self.param_dtype or 'their dtype'}")
            return f"FSDP2 (fully_shard){mp}"
        return {"none": "DDP, gradients all-reduced as they are",
                "fp16": "DDP, gradients cast to float16 for the all-reduce (fp16_compress_hook)",
                "bf16": "DDP, gradients cast to bfloat16 for the all-reduce",
                "powersgd": f"DDP, PowerSGD rank-{self.rank} gradient compression with error feedback "
                            f"(plain all-reduce for the first {self.start_iter} steps)"}[self.hook]

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Distributed:
        return from_fields(cls, d, "distributed")

    @classmethod
    def parse(cls, text: str) -> Distributed:
        """``ddp``, ``ddp-fp16``, ``ddp-bf16``, ``ddp-powersgd[-rN]``, ``fsdp[-X-params][-Y-reduce]``
        (``fsdp-bf16`` is ``fsdp-bf16-params-fp32-reduce``)."""
        t = text.strip().lower()
        if t == "ddp":
            return cls()
        m = re.fullmatch(r"ddp-(fp16|bf16)", t)
        if m:
            return cls(hook=m.group(1))
        m = re.fullmatch(r"ddp-powersgd(?:-r(\d+))?", t)
        if m:
            return cls(hook="powersgd", rank=int(m.group(1) or 1))
        if t == "fsdp-bf16":
            return cls("fsdp", param_dtype="bfloat16", reduce_dtype="float32")
        m = re.fullmatch(r"fsdp(?:-(\w+?)-params)?(?:-(\w+?)-reduce)?", t)
        if m:
            return cls("fsdp", param_dtype=m.group(1), reduce_dtype=m.group(2))
        raise DtypelabError(f"unknown distributed modifier {text!r}: use ddp, ddp-fp16, ddp-bf16, ddp-powersgd[-rN], "
                            "fsdp or fsdp-bf16-params-fp32-reduce")


MODIFIER = re.compile(r"\+((?:ddp|fsdp)[\w-]*)$")


def split_modifier(spec: str) -> tuple[str, Distributed | None]:
    """'fp32+ddp-fp16' -> ('fp32', Distributed(hook='fp16')); a spec without a modifier comes back whole."""
    m = MODIFIER.search(spec)
    if m is None:
        return spec, None
    return spec[:m.start()], Distributed.parse(m.group(1))
