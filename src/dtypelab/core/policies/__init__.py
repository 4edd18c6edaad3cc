"""Precision policies: the kinds (``configs.Config`` and one module per kind in ``kinds/``), plans that map module
names to configs (``plan``), the runtime that combines a plan's kinds on a model (``precision``), the registry of
names (``registry``) and a user's own kinds and policies (``plugins``)."""

from __future__ import annotations

from dtypelab.core.policies.configs import (
    KINDS,
    SOURCES,
    ActivationPart,
    Config,
    Facts,
    config_from_dict,
    config_to_dict,
)
from dtypelab.core.policies.distributed import Distributed
from dtypelab.core.policies.finetuning import tuned
from dtypelab.core.policies.kinds import TF32, Autocast, Cast, Float8Train, LoRA, Quantize, WeightQuant, import_all
from dtypelab.core.policies.plan import PLAN_SCHEMA, Availability, Plan, single
from dtypelab.core.policies.precision import Precision
from dtypelab.core.policies.regions import regions
from dtypelab.core.policies.registry import (
    KV_FORMATS,
    REGISTRY,
    STATE_MODIFIERS,
    baseline_policy,
    default_policies,
    defaults,
    emulated_version,
    get_policy,
    gpu_only_policies,
    load_plan,
    numerics_twin,
    order_builtins,
    parse_policies,
    plan_from_dict,
    policies_for,
    register,
    split_kv,
)
from dtypelab.core.results import PolicyInfo
from dtypelab.core.tolerance import BASELINE, COMPILED_BASELINE


def policy_info(plan: Plan) -> PolicyInfo:
    """A plan's description for the record: what it was when measured, whatever the registry says later."""
    return PolicyInfo(name=plan.name, summary=plan.describe(), plan=plan.to_dict(), compute_dtype=plan.compute_dtype,
                      backend=" + ".join(dict.fromkeys(c.facts.backend for c in plan.configs)),
                      arithmetic="; ".join(c.facts.arithmetic for c in plan.configs if c.facts.arithmetic),
                      emulated=plan.emulated, compiles=plan.compiles, modes=plan.modes,
                      keeps_updates=all(c.facts.keeps_updates or c.facts.storage_dtype in ("float32", "float64")
                                        for c in plan.configs), numerics_only=plan.numerics_only,
                      fp32_weights=plan.default.facts.storage_dtype in ("float32", "float64"),
                      speed_needs="; ".join(dict.fromkeys(c.facts.speed_needs for c in plan.configs
                                                          if c.facts.speed_needs)))


import_all()  # a kind dropped into kinds/ as one file: its module registers its kind and policies, the registry exists
order_builtins()

__all__ = ["BASELINE", "COMPILED_BASELINE", "KINDS", "KV_FORMATS", "PLAN_SCHEMA", "REGISTRY", "SOURCES",
           "STATE_MODIFIERS", "TF32", "ActivationPart", "Autocast", "Availability", "Cast", "Config", "Distributed",
           "Facts", "Float8Train", "LoRA", "Plan", "Precision", "Quantize", "WeightQuant", "baseline_policy",
           "config_from_dict", "config_to_dict", "default_policies", "defaults", "emulated_version", "get_policy",
           "gpu_only_policies", "load_plan", "numerics_twin", "parse_policies", "plan_from_dict", "policies_for",
           "policy_info", "regions", "register", "single", "split_kv", "tuned"]
