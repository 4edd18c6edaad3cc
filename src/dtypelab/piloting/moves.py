"""What the autopilot does the same way on a task and on a script: where a moved layer goes, which layer a non-finite
step's origin lets it move, how often it reads, and the final plan."""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import Autocast, Cast, Config, Plan, Precision, plan_from_dict
from dtypelab.core.results import AutopilotReport, Finding, Move, save_text
from dtypelab.piloting.adapters import PROMOTABLE, PROMOTION
from dtypelab.piloting.controller import Controller
from dtypelab.piloting.monitor import Reading

WIDE = ("float32", "float64")
FIRST_EVERY, MAX_EVERY = 10, 100  # steps between readings: at first, and at most when they are costly
READING_BUDGET = 0.02  # the automatic interval keeps the readings' extra time near this share of training time
NO_SCALER = "; the start has no GradScaler, which would scale the gradients into range for every layer at once"
TARGETS = {"fp32": Cast("float32"), "bf16": Cast("bfloat16"), "amp-bf16": Autocast("bfloat16")}


def target_config(promote_to: str, precision: Precision, device: torch.device) -> Config:
    if promote_to != "auto":
        return TARGETS[promote_to]
    bf16_fast = device.type == "cuda" and torch.cuda.is_bf16_supported()  # bf16's range at fp16's speed class
    to = PROMOTION(precision.plan.default, bf16_fast) or TARGETS["fp32"]
    if not PROMOTABLE(to):
        raise DtypelabError(f"a layer can be moved to a cast or an autocast config, not {to.label}")
    return to


def label(precision: Precision, name: str, model: torch.nn.Module) -> str:
    """The config a layer runs in now (its rule, else the plan's default)."""
    return precision.plan.assign(model).get(name, precision.plan.default).label


def origin_text(f: Finding) -> str:
    o = f.origin
    if o is None:
        return "no origin found"
    return f"{o.op} in {o.module or 'no module'} ({o.phase}): {o.diagnosis}"


def interval(sampled_s: list[float], plain_s: list[float]) -> int:
    """Steps between readings so that they cost about READING_BUDGET of the time (as the checkpoints do)."""
    step = statistics.median(plain_s[-50:])
    extra = max(0.0, statistics.median(sampled_s[-5:]) - step)
    return max(FIRST_EVERY, min(MAX_EVERY, math.ceil(extra / (READING_BUDGET * step)) if step > 0 else FIRST_EVERY))


def final_plan(plan: Plan, start: str, moves: list[Move]) -> Plan:
    said = "; ".join(f"{m.layer} at step {m.step} ({m.cause})" for m in moves)
    return dataclasses.replace(plan, summary=f"autopilot from {start}: " + (f"moved {said}" if moves else
                                                                            "nothing moved"))


def movable(f: Finding, precision: Precision, model: torch.nn.Module, to: Config) -> str:
    """The layer a non-finite step's origin lies in, when moving it could help: a module (or its nearest enclosing
    one) that does not yet run in the target config."""
    if f.origin is None or not f.origin.module:
        return ""
    if f.origin.outputs and all(t.dtype.removeprefix("torch.") in WIDE for t in f.origin.outputs):
        return ""  # the op already ran in a wide format: a log of zero, not a range a move would fix
    names = dict(model.named_modules())
    name = f.origin.module
    while name and name not in names:
        name = name.rpartition(".")[0]
    if not name or label(precision, name, model) == to.label:
        return ""
    return name


def to_move(controller: Controller, step: int, readings: dict[str, Reading], precision: Precision,
            model: torch.nn.Module, to: Config, scaled: bool) -> list[tuple[str, str, str, float | None, float | None]]:
    """After a reading: (layer, cause, evidence, amax, limit) of each layer the controller warns about that does not
    run in ``to`` yet; flushed gradients without a GradScaler say that one would fix every layer at once."""
    return [(name, w.cause, w.evidence + (NO_SCALER if w.cause == "underflow" and not scaled else ""), w.amax, w.limit)
            for name, w in controller.decide(step, readings).items() if label(precision, name, model) != to.label]


def write_outputs(report: AutopilotReport, json_path: str | None, plan_out: str | None) -> None:
    """The record and the final plan file, where asked (a run that failed before training has no plan)."""
    if json_path:
        report.save(json_path)
    if plan_out and report.final_plan:
        save_text(plan_out, plan_from_dict(report.final_plan).to_json() + "\n")
