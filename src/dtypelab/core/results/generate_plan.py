"""The per-layer serving plan record (``tune --mode generate``): each unit's cost in each choice (the KL divergence
measured with it alone converted, the forecast seconds its weights take per decode token, its stored bytes), the
trade-off frontier, the chosen plan and its KL measured whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtypelab.core.results.store import Record

GENERATE_PLAN_SCHEMA = "dtypelab.generate-plan"


@dataclass(frozen=True)
class PlanChoice:
    choice: str  # bf16, or a weight format (w4a16-gptq)
    kl: float  # measured: the model's mean KL from bfloat16's with this unit alone in this choice
    seconds: float  # forecast: reading its weights per decode token at batch 1 on the GPU
    bytes: int  # its stored weight bytes


@dataclass(frozen=True)
class PlanUnit:
    name: str
    layers: tuple[str, ...]  # converted together (vLLM fuses them)
    choices: tuple[PlanChoice, ...]
    chosen: str


@dataclass(frozen=True)
class FrontierPoint:
    kl: float  # the sum of its units' KL (the additive estimate)
    speedup: float  # forecast decode speed of the weights over all-bfloat16's
    memory: float  # its weight bytes over all-bfloat16's
    chosen: bool


@dataclass(frozen=True)
class GeneratePlanReport(Record):
    task: str
    task_name: str
    device: str
    objective: str  # speed or memory
    budget: float  # the KL budget, nats
    units: tuple[PlanUnit, ...]
    frontier: tuple[FrontierPoint, ...]
    plan: dict[str, Any]  # the chosen plan (a plan file's contents)
    measured_kl: float | None  # the chosen plan's KL, measured with all its units converted
    tried: tuple[tuple[str, float], ...] = ()  # plans measured whole, in order: (their formats, their KL)
    calibration: str = ""
    seconds: float = 0.0
    created: str = ""
    schema_version: int = 1

    schema = GENERATE_PLAN_SCHEMA
    version = 1


__all__ = ["GENERATE_PLAN_SCHEMA", "FrontierPoint", "GeneratePlanReport", "PlanChoice", "PlanUnit"]
