"""Audit records: per-layer value ranges against candidate formats."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from typing_extensions import TypedDict

from dtypelab.core.results.store import Record
from dtypelab.core.results.training_state import UpdateLoss

AUDIT_SCHEMA = "dtypelab.audit"
AUDIT_VERSION = 3  # 3: typed verdicts (risk and severity), the formats' limits in the config


class Risk(str, Enum):
    """What a format would do to one tensor family, worst first by ``severity``."""

    SAFE = "safe"
    LITTLE_HEADROOM = "little headroom"
    MINOR_UNDERFLOW = "minor underflow"
    PRECISION_LOSS = "precision loss"
    UNDERFLOW = "underflow"
    GRADIENT_UNDERFLOW = "gradient underflow"
    OVERFLOW = "overflow risk"
    NONFINITE = "non-finite already"

    @property
    def severity(self) -> int:
        """0 safe, 1 a warning, 2 values lost (underflow), 3 values destroyed (overflow, non-finite)."""
        return _SEVERITY[self]


_SEVERITY = {Risk.SAFE: 0, Risk.LITTLE_HEADROOM: 1, Risk.MINOR_UNDERFLOW: 1, Risk.PRECISION_LOSS: 1,
             Risk.UNDERFLOW: 2, Risk.GRADIENT_UNDERFLOW: 2, Risk.OVERFLOW: 3, Risk.NONFINITE: 3}


@dataclass(frozen=True)
class FormatVerdict:
    risk: Risk
    text: str  # "overflow risk: 3.2% beyond ±65504": the risk and its measured detail

    @property
    def severity(self) -> int:
        return self.risk.severity


class FormatLimits(TypedDict):
    """The range a format's verdicts were judged against."""

    max: float
    smallest_normal: float
    smallest_subnormal: float


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
    limits: dict[str, FormatLimits] = field(default_factory=dict)  # each audited format's range


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
    verdicts: dict[str, FormatVerdict]  # per format


@dataclass(frozen=True)
class AuditReport(Record):
    config: AuditConfig
    environment: dict[str, Any]
    layers: tuple[LayerAudit, ...] = ()  # sorted by risk, worst first
    loss_scale: LossScale = field(default_factory=dict)
    updates: tuple[UpdateLoss, ...] = ()  # --updates: which updates round away, per parameter and format
    losses: tuple[float, ...] = ()
    status: str = "ok"
    reason: str = ""
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = AUDIT_VERSION

    schema = AUDIT_SCHEMA
    version = AUDIT_VERSION
    migrations: ClassVar[dict[int, Any]] = {}


def format_limits(name: str) -> FormatLimits | None:
    """A floating format's range by name (torch's and ml_dtypes' names), for records written before they kept it."""
    import ml_dtypes
    import numpy as np

    dtype = getattr(ml_dtypes, name, None) or getattr(np, name, None)
    try:
        info = ml_dtypes.finfo(dtype)
    except (TypeError, ValueError):
        return None
    return {"max": float(info.max), "smallest_normal": float(info.smallest_normal),
            "smallest_subnormal": float(info.smallest_subnormal)}


def _risk_of(text: str) -> Risk:
    return next((r for r in sorted(Risk, key=lambda r: -len(r.value)) if text.startswith(r.value)), Risk.SAFE)


def _migrate_v2(d: dict[str, Any]) -> dict[str, Any]:
    """Verdicts were text (their risk parsed back from it by every reader); formats' ranges were looked up."""
    config = dict(d.get("config") or {})
    config.setdefault("limits", {f: lim for f in config.get("formats", ()) if (lim := format_limits(f))})
    layers = [{**layer, "verdicts": {f: {"risk": _risk_of(v).value, "text": v} if isinstance(v, str) else v
                                     for f, v in layer.get("verdicts", {}).items()}}
              for layer in d.get("layers", ())]
    return {**d, "config": config, "layers": layers}


AuditReport.migrations = {2: _migrate_v2}
