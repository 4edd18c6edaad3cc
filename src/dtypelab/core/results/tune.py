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
    budget: int  # the most full evaluations allowed: L + 2·log2(L)
    task_name: str = ""


@dataclass(frozen=True)
class LayerChoice:
    """One layer: each candidate's measured sensitivity (1 − worst output cosine, converted alone) and gain
    (seconds per call saved alone), the candidate ranked for it, and whether the chosen plan converts it."""

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
    fidelity: float  # worst per-sample output cosine vs fp32
    feasible: bool
    why: str = ""


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
    base_s: float = 0.0  # fp32's median forward
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    schema = TUNE_SCHEMA
