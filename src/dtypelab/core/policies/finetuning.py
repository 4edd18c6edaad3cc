"""A command's fine-tuning settings (``--lora-rank``, ``--lora-alpha``, ``--lora-targets``, ``--kbit-upcast``: the
fields of ``core.options.FineTuneOptions``) applied to the LoRA policies it runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies.kinds.lora import QUANTIZED, LoRA


def tuned(plans: Iterable[Any], options: Any) -> list[Any]:
    """``plans`` with the LoRA settings a command was given (``FineTuneOptions``: --lora-rank, --lora-alpha,
    --lora-targets, --kbit-upcast) in each LoRA policy, named as before; a one-line error when settings are given and
    no policy is LoRA's."""
    targets = tuple(t.strip() for t in (options.lora_targets or "").split(",") if t.strip()) or None
    if options.lora_targets is not None and targets is None:
        raise DtypelabError("--lora-targets is empty: give the Linear layers to adapt (names, globs or re: patterns, "
                            "comma-separated), or leave it out for every Linear but the output head")
    given = {k: v for k, v in (("rank", options.lora_rank), ("alpha", options.lora_alpha), ("targets", targets),
                               ("upcast", options.kbit_upcast or None)) if v is not None}
    plans = list(plans)
    if not given:
        return plans
    lora = [p for p in plans if isinstance(p.default, LoRA)]
    if not lora:
        flag = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets",
                "upcast": "--kbit-upcast"}[next(iter(given))]
        raise DtypelabError(f"{flag} sets the LoRA policies (lora-bf16, qlora-nf4, …), and none is named")
    if given.get("upcast") and not any(p.default.base in QUANTIZED for p in lora):
        raise DtypelabError(f"--kbit-upcast upcasts the weights a quantized base leaves in bfloat16 (qlora-nf4, "
                            f"lora-int8, lora-fp8); {', '.join(p.name for p in lora)} quantize nothing")
    return [dataclasses.replace(p, default=dataclasses.replace(p.default, **_for(p.default, given)))
            if isinstance(p.default, LoRA) else p for p in plans]


def _for(config: LoRA, given: dict[str, Any]) -> dict[str, Any]:
    """The settings that apply to ``config``: --kbit-upcast to a quantized base only (peft's
    prepare_model_for_kbit_training would upcast a bfloat16 base whole)."""
    return {k: v for k, v in given.items() if k != "upcast" or config.base in QUANTIZED}


__all__ = ["tuned"]
