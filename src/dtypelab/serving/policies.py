"""Serving policies: a weight format (any registered policy that serves: fp32, bf16, fp16, int8-wo, int4-wo, fp8-wo,
int8-dyn, fp8-dyn-row/tensor, NAME+compile...) and, as a modifier, the KV cache's format: ``int4-wo+kv-fp8``.
Without one, the cache holds what the model's attention produces (its compute dtype)."""

from __future__ import annotations

from dataclasses import dataclass

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import Plan, defaults, get_policy, split_kv
from dtypelab.core.policies.kinds import NATIVE, KVFormat

# measured here by default: the baseline, the casts, the weight formats that run on a CPU, the KV formats over
# float32 weights, and the smallest of both; forecast for a GPU by default: bf16 (the baseline there), the weight
# formats, and the KV formats over bf16 (each kind's module puts its policies in these lists)
DEFAULT_MEASURED = defaults("serve-measured")
DEFAULT_FORECAST = defaults("serve-forecast")
DEFAULT_FORECAST_CPU = defaults("serve-forecast-cpu")


@dataclass(frozen=True)
class ServePolicy:
    name: str  # as written: PLAN[+KV]
    plan: Plan
    kv: KVFormat

    def describe(self) -> str:
        words = self.plan.describe()
        return words if self.kv is NATIVE else f"{words}; {self.kv.words}"


def serve_policy(spec: str) -> ServePolicy:
    """``NAME[+kv-FORMAT]``: a registered policy that serves, with the cache's format (the registry's modifier)."""
    spec = spec.strip()
    head, fmt = split_kv(spec)
    kv = fmt or NATIVE
    if not head:
        raise DtypelabError(f"policy {spec}: a KV format modifies a weight format: NAME+{kv.label} (fp32+{kv.label})")
    plan = get_policy(head)
    if plan.program and kv is not NATIVE:
        raise DtypelabError(f"policy {spec}: a {plan.program} program holds its own cache, in its compute dtype; "
                            f"{kv.label} modifies a PyTorch model's (drop +{kv.label})")
    if "infer" not in plan.modes:
        raise DtypelabError(f"policy {head} is a training policy; --mode generate serves weight formats (fp32, bf16, "
                            "int8-wo, int4-wo, fp8-wo, int8-dyn, fp8-dyn-row ...)")
    if plan.distributed is not None:
        raise DtypelabError(f"policy {head}: distributed modifiers are for training")
    return ServePolicy(spec, plan, kv)


def serve_policies(spec: str | None, defaults: tuple[str, ...]) -> list[ServePolicy]:
    names = [n for n in (spec.split(",") if spec else defaults) if n.strip()]
    out = [serve_policy(n) for n in names]
    seen: set[str] = set()
    for p in out:
        if p.name in seen:
            raise DtypelabError(f"policy {p.name} is named twice")
        seen.add(p.name)
    return out


__all__ = ["DEFAULT_FORECAST", "DEFAULT_FORECAST_CPU", "DEFAULT_MEASURED", "ServePolicy", "serve_policies",
           "serve_policy"]
