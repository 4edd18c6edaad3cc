"""The tune record in words and parts: each evaluation as recorded, why a layer was or was not converted, why no
plan was chosen (in measured terms), the record's decision, and the answer when nothing could be searched."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import KERNEL_LABELS, HardwareInfo, environment
from dtypelab.core.policies import Config, Plan, config_from_dict, config_to_dict, get_policy
from dtypelab.core.results import PlanEvaluation, TuneConfig, TuneReport, default_label, tune_recommendation
from dtypelab.core.task import Task
from dtypelab.core.tolerance import Tolerance
from dtypelab.tuning.infer import FP32
from dtypelab.tuning.search import Evaluation, LayerScore
from dtypelab.tuning.timing import RETRIES

NOTHING_CHOSEN = "float32 everywhere: no plan measured was faster than fp32 within the constraint"

def finish(report: TuneReport, wall_s: float, searched: bool) -> TuneReport:
    """The record's time, and its decision: use the plan, or keep fp32 (and why)."""
    plan = report.plan
    default = _default(plan.get("default") or config_to_dict(FP32))
    # the plan's kinds say whether it converts anything (rules, or a default that is not fp32) and how it is called
    # (bf16-kahan, not its kind's name); a kind this process does not know (a user's, gone) is not fp32's
    converts = default is None or bool(plan.get("rules")) or default != FP32
    rec = tune_recommendation(plan, report.speedup, report.explanation, searched, converts)
    label = default.label if default is not None else default_label(plan.get("default", {}))
    return replace(report, wall_s=wall_s, created=time.strftime("%Y-%m-%dT%H:%M:%S"), recommendation=rec,
                   plan_default=label)


def _default(config: dict) -> Config | None:
    try:
        return config_from_dict(config)
    except DtypelabError:
        return None


def nothing_to_search(spec: str, task_obj: Task, mode: str, slow: dict[str, str], hw: HardwareInfo,
                       min_cosine: float, tol: Tolerance, steps: int | None, batch_size: int | None) -> TuneReport:
    """Every candidate was measured pathologically slow here: that is the answer (keep fp32), not an error."""
    plan = Plan(FP32, name=f"{task_obj.name}-tuned", summary=NOTHING_CHOSEN)
    train = mode == "train"
    config = TuneConfig(task=spec, mode=mode, candidates=tuple(slow), min_cosine=0.0 if train else min_cosine,
                        batch_size=batch_size or task_obj.batch_size, device=hw.device, budget=0,
                        task_name=task_obj.name, metric=task_obj.metric if train else "",
                        higher_is_better=task_obj.higher_is_better, tolerance=tol if train else None,
                        steps=(steps or task_obj.steps) if train else 0)
    why = "; ".join(f"{name}: {reason}" for name, reason in slow.items())
    return TuneReport(config=config, environment=environment(hw), plan=plan.to_dict(), speedup=1.0,
                      fidelity=1.0 if not train else math.nan,
                      explanation=f"Keep fp32: every candidate is measured pathologically slow here ({why}); "
                                  "nothing was searched. --force searches anyway.")


def evaluation_record(e: Evaluation, sign: float = 1.0, candidate: str = "") -> PlanEvaluation:
    fidelity = sign * e.fidelity if math.isfinite(e.fidelity) else math.nan
    finite = not math.isnan(e.low)
    return PlanEvaluation(tuple(sorted(e.layers)), e.speedup, fidelity, e.feasible, e.why, candidate,
                          low=e.low if finite else None, high=e.high if finite else None, disturbed=e.disturbed)


def disturbance_note(evaluations: tuple[PlanEvaluation, ...]) -> tuple[str, ...]:
    """Which evaluations other processes disturbed even after re-measuring, in words; () when none was."""
    hit = [e for e in evaluations if e.disturbed]
    if not hit:
        return ()
    return (f"Disturbance: other processes used the CPU during {len(hit)} of {len(evaluations)} evaluations' timings "
            f"even after {RETRIES} re-measurements each (e.g. {hit[0].disturbed}); their intervals are wide, and a "
            "plan is chosen only when its whole interval lies above 1.02x, so the choice may keep fp32 where a quiet "
            "machine would convert: re-run on a quiet machine.",)

def layer_why(s: LayerScore, chosen: bool, found: bool, units: str, kept: str = "kept fp32", extra: str = "") -> str:
    alone = f"alone {s.gain * 1e6:+.1f} µs {units} {s.sensitivity:.2e}{extra}"
    if chosen:
        return f"converted ({alone}); the plan was measured end to end"
    if not found:
        return f"{kept} ({alone}): no plan measured was both faster than fp32 and within the constraint"
    return f"{kept} ({alone}): the plans that converted it were slower or broke the constraint"

def none_found(uniform: tuple[PlanEvaluation, ...], evaluations: tuple[PlanEvaluation, ...], hw: HardwareInfo,
                constraint: str, measure: str) -> str:
    """Why no plan was chosen, in measured terms: the uniform candidates, the fastest plan that kept the
    constraint, and the hardware probe's matmul ratio for each candidate's dtype."""
    parts = [f"No plan measured was both measurably faster than fp32 (its whole 95% interval above 1.02x) and kept "
             f"{constraint}."]
    for u in uniform:
        value = f"{u.fidelity:.5f}" if measure == "worst cosine" else f"{u.fidelity:.4g}"
        parts.append(f"{u.why}: {u.speedup:.2f}x fp32's speed, {measure} {value}"
                     f"{'' if u.feasible else ' (outside the constraint)'}.")
    kept = [e for e in evaluations if e.feasible]
    if kept:
        top = max(kept, key=lambda e: e.speedup)
        parts.append(f"The fastest plan that kept it ran at {top.speedup:.2f}x ({top.why}).")
    base = hw.gflops.get("float32")
    # each candidate's own kernel (fbgemm's int8 linear is not torchao's int8 matmul)
    configs = [c for u in uniform if u.candidate for c in get_policy(u.candidate).configs]
    for key in dict.fromkeys(c.facts.probe_key for c in configs):
        if base and hw.gflops.get(key) and key != "float32":
            what = KERNEL_LABELS.get(key, f"{key} matmuls")
            parts.append(f"The hardware probe measures {what} at {hw.gflops[key] / base:.2f}x "
                         f"float32's on this {hw.device_name}.")
    return " ".join(parts)
