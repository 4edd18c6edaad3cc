"""Bench records: one run of several policies on one task."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.measure import Summary, summarize
from dtypelab.core.results.store import SCHEMA_VERSION, check_schema, from_json_safe, json_safe, save_text

SCHEMA = "dtypelab.report"

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
    per_layer: bool = False
    min_cosine: float = 0.99  # infer: a policy whose worst per-sample cosine vs fp32 is lower is not accepted


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
        check_schema(d, SCHEMA)
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


def _policy_result(d: dict[str, Any]) -> PolicyResult:
    names = {f.name for f in fields(PolicyResult)}
    d = {k: v for k, v in d.items() if k in names}
    for key in ("step_times_s", "losses"):
        d[key] = tuple(d.get(key, ()))
    return PolicyResult(**d)
