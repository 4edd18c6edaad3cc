"""Frozen, versioned result records with a JSON round trip. Renderers read only these."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from .errors import DtypelabError
from .measure import Summary, summarize

SCHEMA = "dtypelab.report"
SCHEMA_VERSION = 1

# Outcome of one policy. "ok" and "diverged" ran to the end; the rest have a reason and maybe no numbers.
STATUSES = ("ok", "diverged", "failed", "timeout", "oom", "skipped", "interrupted")


@dataclass(frozen=True)
class RunConfig:
    task: str
    mode: str  # "train" or "infer"
    policies: tuple[str, ...]
    steps: int
    batch_size: int
    warmup: int
    seed: int
    tolerance: str
    device: str
    force: bool
    timeout_s: float
    metric: str
    higher_is_better: bool
    threads: int | None = None


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    status: str
    reason: str = ""
    batch_size: int = 0
    warmup: int = 0
    step_times_s: tuple[float, ...] = ()  # raw, warm-up included; train: whole step, infer: forward
    losses: tuple[float, ...] = ()  # every training step
    first_nonfinite_step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    fidelity: dict[str, float] = field(default_factory=dict)  # infer: error vs the fp32 outputs
    peak_memory_bytes: int | None = None
    memory_method: str = ""
    model_bytes: int | None = None
    init_fingerprint: str = ""  # hash of the initial weights: identical across policies
    extras: dict[str, Any] = field(default_factory=dict)  # policy stats, e.g. GradScaler history
    wall_s: float = 0.0

    @property
    def ran(self) -> bool:
        return self.status in ("ok", "diverged")

    @property
    def timing(self) -> Summary | None:
        return summarize(self.step_times_s[self.warmup:])

    @property
    def throughput(self) -> float | None:
        t = self.timing
        return self.batch_size / t.median if t and t.median > 0 else None

    @property
    def final_loss(self) -> float | None:
        """Mean loss over the last 5% of steps (at least one): less noisy than the last step alone."""
        if not self.losses:
            return None
        tail = self.losses[-max(1, len(self.losses) // 20):]
        return sum(tail) / len(tail)

    def metric(self, name: str) -> float | None:
        return self.metrics.get(name)


@dataclass(frozen=True)
class Report:
    config: RunConfig
    environment: dict[str, Any]
    results: tuple[PolicyResult, ...] = ()
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    def with_result(self, result: PolicyResult) -> Report:
        """A new report with ``result`` added (or replaced), kept in the config's policy order."""
        kept = [r for r in self.results if r.policy != result.policy] + [result]
        order = {name: i for i, name in enumerate(self.config.policies)}
        kept.sort(key=lambda r: order.get(r.policy, len(order)))
        return replace(self, results=tuple(kept))

    def result(self, policy: str) -> PolicyResult | None:
        return next((r for r in self.results if r.policy == policy), None)

    # --- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"schema": SCHEMA, **json_safe(d)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        _check_schema(d, SCHEMA)
        version = d["schema_version"]
        d = from_json_safe(d)
        try:
            cfg = d["config"]
            config = RunConfig(**{**cfg, "policies": tuple(cfg["policies"])})
            results = tuple(_policy_result(r) for r in d["results"])
            return cls(config=config, environment=d["environment"], results=results,
                       created=d.get("created", ""), schema_version=version)
        except (KeyError, TypeError) as exc:
            raise DtypelabError(f"result file is malformed: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Report:
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Write atomically: a crash mid-write leaves the previous complete file in place."""
        save_text(path, self.to_json())


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
        _check_schema(d, AUDIT_SCHEMA)
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


def _check_schema(d: dict[str, Any], schema: str) -> None:
    if d.get("schema") != schema:
        raise DtypelabError(f"not a dtypelab result file (no 'schema': {schema!r})")
    if d.get("schema_version") != SCHEMA_VERSION:
        raise DtypelabError(f"file has schema version {d.get('schema_version')}; this dtypelab reads "
                            f"{SCHEMA_VERSION}")


def load_record(path: str) -> Report | AuditReport:
    """A bench or audit record, whichever the file holds."""
    d = _read_json(path)
    return AuditReport.from_dict(d) if d.get("schema") == AUDIT_SCHEMA else Report.from_dict(d)


def load_report(path: str) -> Report:
    return Report.from_dict(_read_json(path))


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise DtypelabError(f"no such result file: {path}") from None
    except OSError as exc:
        raise DtypelabError(f"cannot read {path}: {exc.strerror}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DtypelabError(f"{path} is not valid JSON (line {exc.lineno}): {exc.msg}") from None
    if not isinstance(d, dict):
        raise DtypelabError(f"{path} is not a dtypelab result file")
    return d


def save_text(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _policy_result(d: dict[str, Any]) -> PolicyResult:
    names = {f.name for f in fields(PolicyResult)}
    d = {k: v for k, v in d.items() if k in names}
    for key in ("step_times_s", "losses"):
        d[key] = tuple(d.get(key, ()))
    return PolicyResult(**d)


# Strict JSON has no NaN/Infinity, yet a diverged loss curve is full of them: store them as strings.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def from_json_safe(obj: Any) -> Any:
    if isinstance(obj, str) and obj in _NONFINITE:
        return _NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: from_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json_safe(v) for v in obj]
    return obj
