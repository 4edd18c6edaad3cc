"""Autopilot records: a training run that moved layers out of its start precision while it ran, and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtypelab.core.results.parts import ScalerStats
from dtypelab.core.results.store import Record
from dtypelab.core.results.trace import Finding

AUTOPILOT_SCHEMA = "dtypelab.autopilot"
AUTOPILOT_VERSION = 2  # 2: the rules' thresholds in one Rules object (1: flat fields of the config)


@dataclass(frozen=True)
class Rules:
    """When the autopilot moves a layer (``piloting.controller`` applies them; the record keeps them as they ran):
    its largest |value| past ``headroom`` of its format's limit on ``confirm`` readings in a row (at once past
    ``at_once``); its trend line crossing the limit within ``horizon`` steps (0: two readings), fitted on the last
    ``trend_points`` readings, only past ``trend_from`` of the limit and while its latest log-growth keeps
    ``trend_keep`` of the line's slope; more than ``underflow_share`` of its weight gradient flushed to zero."""

    headroom: float = 0.5
    horizon: int = 0
    trend_from: float = 0.1
    trend_keep: float = 0.5
    at_once: float = 0.9
    underflow_share: float = 0.5
    confirm: int = 2
    trend_points: int = 4


@dataclass(frozen=True)
class Move:
    """One layer moved to another precision, at a step, on this evidence."""

    step: int
    layer: str
    from_: str  # config labels, e.g. "amp-fp16" -> "fp32"
    to: str
    cause: str  # "headroom" (amax near the limit), "trend" (amax predicted to cross it), "underflow", "non-finite"
    evidence: str  # one sentence: amax vs limit, trend, scaler events, or the trace's diagnosis
    amax: float | None = None  # the layer's largest |value| in the running format when it was moved
    limit: float | None = None  # that format's largest finite value


@dataclass(frozen=True)
class Rollback:
    """A non-finite step: training went back to the checkpoint and went on from there."""

    step: int  # the step that went non-finite
    to_step: int  # the checkpoint it went back to
    trigger: str  # what the guard saw ("loss is nan", "GradScaler's scale collapsed to …")
    origin: str  # "aten.mm in fc2 (forward)": where the trace found the first non-finite value
    layer: str  # the layer moved because of it ("" when none could be)


@dataclass(frozen=True)
class AutopilotConfig:
    task: str
    start: str  # the start policy or plan's name
    steps: int
    batch_size: int
    seed: int
    device: str
    sample_every: int  # steps between two readings of every layer's ranges; 0: automatic (see the report's)
    promote_to: str  # the config a moved layer gets ("fp32", "bf16", "amp-bf16")
    max_rollbacks: int
    task_name: str = ""
    rules: Rules = field(default_factory=Rules)  # when a layer moves


@dataclass(frozen=True)
class AutopilotReport(Record):
    config: AutopilotConfig
    environment: dict[str, Any]
    status: str  # "ok" (trained to the end), "stopped" (rollbacks could not fix it), "failed", "interrupted"
    reason: str = ""
    moves: tuple[Move, ...] = ()
    rollbacks: tuple[Rollback, ...] = ()
    final_plan: dict[str, Any] = field(default_factory=dict)  # Plan.to_dict(): bench --policies / apply_plan take it
    losses: tuple[float, ...] = ()  # every step that counts (rolled-back steps are not in it)
    metrics: dict[str, float] = field(default_factory=dict)
    steps_rolled_back: int = 0  # steps trained again after a rollback
    steps_skipped: int = 0  # steps GradScaler skipped (inf/NaN gradients)
    samples: int = 0  # range readings taken
    sample_every: int = 0  # the interval between readings at the end (chosen from their cost when automatic)
    sample_s: float = 0.0  # their cost, seconds in all
    checkpoint_every: int = 0
    checkpoint_s: float = 0.0
    step_s: float = 0.0  # median step time (without readings)
    finding: Finding | None = None  # status "stopped": the trace's diagnosis of the last non-finite step
    scaler: ScalerStats = field(default_factory=dict)
    train_s: float = 0.0  # the training loop alone (readings, checkpoints and rollbacks included)
    wall_s: float = 0.0
    created: str = ""
    live: bool = False  # a script's own loop: rolled-back steps were dropped (its data cannot rewind), not retrained
    schema_version: int = AUTOPILOT_VERSION

    schema = AUTOPILOT_SCHEMA
    version = AUTOPILOT_VERSION


def _rules_in_one(d: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept the thresholds as the config's own fields."""
    config = dict(d.get("config") or {})
    config["rules"] = {k: config.pop(k) for k in ("headroom", "horizon", "trend_from", "trend_keep") if k in config}
    return {**d, "config": config}


AutopilotReport.migrations = {1: _rules_in_one}
