"""Tune records: the plan a per-layer search chose, every evaluation it made, and why each layer got its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtypelab.core.results.store import SCHEMA_VERSION, Record

TUNE_SCHEMA = "dtypelab.tune"


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
    tolerance: str = ""  # train: how far the metric may fall from fp32's (1% or an absolute 0.005)
    steps: int = 0  # train: steps of each full evaluation
    probe_steps: int = 0  # train: steps of each layer's sensitivity probe
    base_metric: float = 0.0  # train: fp32's metric after the same training


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
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    schema = TUNE_SCHEMA
