"""Tune records: the plan a per-layer search chose, every evaluation it made, and why each layer got its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dtypelab.core.results.decision import Decision, Recommendation
from dtypelab.core.results.store import Record
from dtypelab.core.tolerance import BASELINE, Tolerance

TUNE_SCHEMA = "dtypelab.tune"
TUNE_VERSION = 3  # 3: the typed tolerance, the recommendation, the plan's default config by name


@dataclass(frozen=True)
class TuneConfig:
    task: str
    mode: str
    candidates: tuple[str, ...]
    min_cosine: float
    batch_size: int
    device: str
    budget: int  # the most full evaluations allowed: L + 2·log2(L), per candidate in train mode
    task_name: str = ""
    metric: str = ""  # train: the task's metric, the constraint
    higher_is_better: bool = True
    tolerance: Tolerance | None = None  # train: how far the metric may fall from fp32's (None in inference)
    steps: int = 0  # train: steps of each full evaluation
    probe_steps: int = 0  # train: steps of each layer's sensitivity probe
    base_metric: float = 0.0  # train: fp32's metric after the same training

    def __post_init__(self) -> None:
        if isinstance(self.tolerance, str | float):  # "1%" from Python callers; "" for none
            object.__setattr__(self, "tolerance", Tolerance.parse(self.tolerance) if self.tolerance != "" else None)


@dataclass(frozen=True)
class LayerChoice:
    """One layer: each candidate's measured sensitivity and gain (seconds per call saved converted alone), the
    candidate ranked for it, and whether the chosen plan converts it. Sensitivity: infer 1 − worst output cosine;
    train the loss curve's relative deviation from fp32's in a short probe, plus the range audit's penalty."""

    name: str
    candidate: str
    sensitivity: float
    gain_s: float
    chosen: bool
    why: str
    tried: tuple[tuple[str, float, float], ...] = ()  # (candidate, sensitivity, gain_s)


@dataclass(frozen=True)
class PlanEvaluation:
    layers: tuple[str, ...]
    speedup: float
    fidelity: float  # infer: worst per-sample output cosine vs fp32; train: the task's metric after training
    feasible: bool
    why: str = ""
    candidate: str = ""  # train: the config the plan runs in outside its fp32 islands
    low: float | None = None  # the speedup's 95% interval over the paired timings (None: no interval)
    high: float | None = None
    disturbed: str = ""  # what other processes did during its timing, when they disturbed even its re-measurements


@dataclass(frozen=True)
class TuneReport(Record):
    config: TuneConfig
    environment: dict[str, Any]
    plan: dict[str, Any]  # Plan.to_dict() of the chosen plan (fp32 with no rules when nothing was feasible)
    speedup: float  # the chosen plan's measured end-to-end speedup over fp32
    fidelity: float
    layers: tuple[LayerChoice, ...] = ()
    evaluations: tuple[PlanEvaluation, ...] = ()
    uniform: tuple[PlanEvaluation, ...] = ()  # each candidate on every layer it applies to, measured alike
    front: tuple[PlanEvaluation, ...] = ()  # the Pareto front of the evaluations: none both faster and better
    base_s: float = 0.0  # fp32's median forward (train: training step)
    explanation: str = ""  # when no plan beat fp32 within the constraint: what was measured instead
    notes: tuple[str, ...] = ()  # candidates left out and why, disturbed timings
    plan_default: str = "fp32"  # the chosen plan's config outside its rules, by name ("bf16", "amp-bf16", "fp32")
    recommendation: Recommendation | None = None  # use the plan, or keep fp32, and why
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = TUNE_VERSION

    schema = TUNE_SCHEMA
    version = TUNE_VERSION
    migrations: ClassVar[dict[int, Any]] = {}


_SHORT = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def default_label(config: dict[str, Any]) -> str:
    """A plan file's default config by name, from its JSON (casts and autocast: what training plans use)."""
    dtype = _SHORT.get(str(config.get("dtype")), str(config.get("dtype")))
    return f"amp-{dtype}" if config.get("kind") == "autocast" else dtype if config.get("kind") == "cast" else \
        str(config.get("kind", "?"))


def tune_recommendation(plan: dict[str, Any], speedup: float, explanation: str, searched: bool,
                        converts: bool) -> Recommendation:
    """The tune record's decision: use the plan (it converts something and was measured faster), or keep fp32.
    ``converts``: the plan's own answer (tune asks its kinds; a record written before, its migration)."""
    if converts:
        name = plan.get("name") or "the plan"
        return Recommendation(Decision.USE, name, f"Use {name}: {speedup:.2f}x fp32's speed, measured end to end.")
    decision = Decision.KEEP_BASELINE if searched else Decision.NOTHING_TO_SEARCH
    return Recommendation(decision, BASELINE, explanation or f"Keep {BASELINE}.")


def _migrate_v2(d: dict[str, Any]) -> dict[str, Any]:
    config = dict(d.get("config") or {})
    tol = config.get("tolerance")
    if isinstance(tol, str):
        parsed = Tolerance.parse(tol) if tol else None
        config["tolerance"] = {"value": parsed.value, "relative": parsed.relative} if parsed else None
    plan = d.get("plan") or {}
    # a version-2 record kept no answer of its kinds: read from its JSON as the built-in kinds wrote it then
    converts = bool(plan.get("rules")) or default_label(plan.get("default", {})) != BASELINE
    rec = tune_recommendation(plan, float(d.get("speedup", 1.0)), d.get("explanation", ""), True, converts)
    return {**d, "config": config, "plan_default": default_label(plan.get("default", {})),
            "recommendation": {"decision": rec.decision.value, "chosen": rec.chosen, "reason": rec.reason}}


TuneReport.migrations = {2: _migrate_v2}
