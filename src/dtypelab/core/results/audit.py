"""Audit records: per-layer value ranges against candidate formats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from typing_extensions import TypedDict

from dtypelab.core.results.store import SCHEMA_VERSION, Record

AUDIT_SCHEMA = "dtypelab.audit"


@dataclass(frozen=True)
class AuditConfig:
    task: str
    policy: str
    steps: int
    every: int
    layers: str  # regular expression on module paths / parameter names; "" = all
    formats: tuple[str, ...]
    batch_size: int
    seed: int
    device: str
    task_name: str = ""  # Task.name (``task`` is how it was given)


class RangeStatsDict(TypedDict):
    """numerics.rangestats.RangeStats.to_dict(): typed so that inf / NaN round-trip."""

    formats: list[str]
    numel: int
    zeros: int
    nonfinite: int
    max_abs: float
    min_nonzero: float
    binades: dict[str, int]
    counts: dict[str, dict[str, int]]


class LossScale(TypedDict, total=False):
    log2_scale: int
    scale: float
    max_grad: float
    min_grad: float
    flushed_unscaled: float | None
    flushed_at_scale: float
    gradscaler_default_overflows: bool


@dataclass(frozen=True)
class LayerAudit:
    name: str  # module path (with [i] / ['key'] for parts of a structured output) or parameter name
    module: str  # module class, or "parameter"
    kind: str  # "activation", "grad" (flowing into the module output) or "param_grad"
    calls: int  # captures merged: steps x calls per step (shared modules are called more than once)
    stats: RangeStatsDict
    severity: int  # 0 safe .. 3 overflow / non-finite, the worst over formats
    verdicts: dict[str, str]  # format -> verdict text


@dataclass(frozen=True)
class AuditReport(Record):
    config: AuditConfig
    environment: dict[str, Any]
    layers: tuple[LayerAudit, ...] = ()  # sorted by risk, worst first
    loss_scale: LossScale = field(default_factory=dict)
    losses: tuple[float, ...] = ()
    status: str = "ok"
    reason: str = ""
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    schema = AUDIT_SCHEMA
