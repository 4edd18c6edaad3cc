"""Audit records: per-layer value ranges against candidate formats."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.results.store import SCHEMA_VERSION, check_schema, from_json_safe, json_safe, save_text

AUDIT_SCHEMA = "dtypelab.numerics.audit"


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


@dataclass(frozen=True)
class LayerAudit:
    name: str  # module path (with [i] / ['key'] for parts of a structured output) or parameter name
    module: str  # module class, or "parameter"
    kind: str  # "activation", "grad" (flowing into the module output) or "param_grad"
    calls: int  # captures merged: steps x calls per step (shared modules are called more than once)
    stats: dict[str, Any]  # RangeStats.to_dict()
    severity: int  # 0 safe .. 3 overflow / non-finite, the worst over formats
    verdicts: dict[str, str]  # format -> verdict text


@dataclass(frozen=True)
class AuditReport:
    config: AuditConfig
    environment: dict[str, Any]
    layers: tuple[LayerAudit, ...] = ()  # sorted by risk, worst first
    loss_scale: dict[str, Any] = field(default_factory=dict)
    losses: tuple[float, ...] = ()
    status: str = "ok"
    reason: str = ""
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps({"schema": AUDIT_SCHEMA, **json_safe(asdict(self))}, indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditReport:
        check_schema(d, AUDIT_SCHEMA)
        d = from_json_safe(d)
        try:
            cfg = d["config"]
            return cls(config=AuditConfig(**{**cfg, "formats": tuple(cfg["formats"])}),
                       environment=d["environment"], layers=tuple(LayerAudit(**x) for x in d["layers"]),
                       loss_scale=d.get("loss_scale", {}), losses=tuple(d.get("losses", ())),
                       status=d.get("status", "ok"), reason=d.get("reason", ""), wall_s=d.get("wall_s", 0.0),
                       created=d.get("created", ""), schema_version=d["schema_version"])
        except (KeyError, TypeError) as exc:
            raise DtypelabError(f"audit file is malformed: {exc}") from exc

    def save(self, path: str) -> None:
        save_text(path, self.to_json())
