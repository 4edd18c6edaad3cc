"""Registry of precision policies by name."""

from __future__ import annotations

import difflib

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies.amp_bf16 import AmpBF16
from dtypelab.core.policies.amp_fp16 import AmpFP16
from dtypelab.core.policies.base import AutocastPolicy, Availability, CastPolicy, Policy
from dtypelab.core.policies.bf16 import BF16
from dtypelab.core.policies.fp8_wo import FP8WeightOnly
from dtypelab.core.policies.fp16 import FP16
from dtypelab.core.policies.fp32 import FP32
from dtypelab.core.policies.fp64 import FP64
from dtypelab.core.policies.int8_dyn import Int8Dyn, Int8DynCompile
from dtypelab.core.policies.int8_legacy import Int8DynLegacy, Int8DynLegacyPerChannel
from dtypelab.core.policies.int8_wo import Int8WeightOnly
from dtypelab.core.policies.tf32 import TF32

BASELINE = "fp32"
REGISTRY: dict[str, type[Policy]] = {p.name: p for p in (
    FP64, FP32, TF32, BF16, FP16, AmpBF16, AmpFP16,
    Int8Dyn, Int8DynCompile, Int8WeightOnly, FP8WeightOnly, Int8DynLegacy, Int8DynLegacyPerChannel,
)}


def policies_for(mode: str) -> list[str]:
    """Every registered policy that can run in ``mode`` (train or infer), in registry order."""
    return [name for name, cls in REGISTRY.items() if mode in cls.modes]


def policy_class(name: str) -> type[Policy]:
    """Look a policy up by name; an unknown name gets the closest match as a suggestion."""
    try:
        return REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, REGISTRY, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DtypelabError(f"unknown policy {name!r}{hint}; known: {', '.join(REGISTRY)}") from None


def parse_policies(text: str | None) -> list[str]:
    """'fp32,bf16' -> ['fp32', 'bf16'], validated; None -> every registered policy."""
    if text is None:
        return list(REGISTRY)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise DtypelabError("--policies is empty: give names such as fp32,amp-bf16")
    for n in names:
        policy_class(n)
    return list(dict.fromkeys(names))


__all__ = ["BASELINE", "REGISTRY", "AutocastPolicy", "Availability", "CastPolicy", "Policy",
           "parse_policies", "policies_for", "policy_class"]
