"""A command's fine-tuning settings (``--lora-rank``, ``--lora-alpha``, ``--lora-targets``, ``--kbit-upcast``: the
fields of ``core.options.FineTuneOptions``) applied to the LoRA policies it runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies.kinds.lora import LoRA


def tuned(plans: Iterable[Any], options: Any) -> list[Any]:
    """``plans`` with the LoRA settings a command was given (``FineTuneOptions``: --lora-rank, --lora-alpha,
    --lora-targets, --kbit-upcast) in each LoRA policy, named as before; a one-line error when settings are given and
    no policy is LoRA's."""
    targets = tuple(t.strip() for t in (options.lora_targets or "").split(",") if t.strip()) or None
    given = {k: v for k, v in (("rank", options.lora_rank), ("alpha", options.lora_alpha), ("targets", targets),
                               ("upcast", options.kbit_upcast or None)) if v is not None}
    plans = list(plans)
    if not given:
        return plans
    if not any(isinstance(p.default, LoRA) for p in plans):
        flag = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets",
                "upcast": "--kbit-upcast"}[next(iter(given))]
        raise DtypelabError(f"{flag} sets the LoRA policies (lora-bf16, qlora-nf4, …), and none is named")
    return [dataclasses.replace(p, default=dataclasses.replace(p.default, **given)) if isinstance(p.default, LoRA)
            else p for p in plans]


__all__ = ["tuned"]
