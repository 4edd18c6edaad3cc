"""Each policy of a bench record judged on its own, as data: run or not (``not_run``), and for those that ran, its
metric against the baseline's within the tolerance, its output fidelity in inference, whether it is emulated, and
whether it fits the memory budget (``judged_runs``). ``recommend`` decides among them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtypelab.core.judging.memory import over
from dtypelab.core.judging.speed import speed_text, speedup
from dtypelab.core.results import PolicyResult, PolicyVerdict, Report, Verdict
from dtypelab.core.tolerance import BASELINE, Tolerance, delta_text, judge


def metric_text(x: float) -> str:
    """A metric's value as the verdicts and the decision write it."""
    return f"{x:.4g}"


_NOT_RUN = {"skipped": {"slow": (Verdict.SKIPPED_SLOW, "too slow here"),
                        "budget": (Verdict.SKIPPED_BUDGET, "over budget"),
                        "inapplicable": (Verdict.SKIPPED_INAPPLICABLE, "does not apply"),
                        "baseline": (Verdict.SKIPPED_BASELINE, "not run: {baseline} failed")},
            "failed": Verdict.FAILED, "timeout": Verdict.TIMEOUT, "oom": Verdict.OOM,
            "interrupted": Verdict.INTERRUPTED}


def not_run(r: PolicyResult, baseline: str) -> PolicyVerdict:
    if r.status == "skipped":
        verdict, text = _NOT_RUN["skipped"].get(r.skip, (Verdict.SKIPPED_UNSUPPORTED, "not on this hardware"))
        text = text.format(baseline=baseline)
    else:
        verdict = _NOT_RUN.get(r.status, Verdict.FAILED)
        text = r.reason if len(r.reason) <= 60 else r.reason[:57] + "..."
        text = text if r.status in ("failed", "timeout", "oom") else r.status
    return PolicyVerdict(r.policy, verdict, text)


@dataclass(frozen=True)
class _Judging:
    """What every policy is judged against: the record, its baseline's result and metric, the tolerance."""

    report: Report
    base: PolicyResult
    base_metric: float
    tol: Tolerance


def _unfinished(r: PolicyResult, j: _Judging, value: float | None, speed: str, common: dict[str, Any]
                ) -> tuple[PolicyVerdict, str] | None:
    """A run with no metric to judge: diverged, a non-finite loss, no (finite) metric; None otherwise."""
    if r.status == "diverged":
        return (PolicyVerdict(r.policy, Verdict.DIVERGED, f"diverged at step {r.first_nonfinite_step}", **common),
                f"{r.policy}: {speed} but diverged ({r.reason}).")
    if r.first_nonfinite_step is not None:
        return (PolicyVerdict(r.policy, Verdict.NONFINITE, f"non-finite loss at step {r.first_nonfinite_step}",
                              **common),
                f"{r.policy}: {speed} but the loss went non-finite at step {r.first_nonfinite_step}.")
    if value is None or not math.isfinite(value):
        return (PolicyVerdict(r.policy, Verdict.NO_METRIC, "no metric", **common),
                f"{r.policy}: {speed} but its {j.report.config.metric} is {value}.")
    return None


def _vetoed(r: PolicyResult, j: _Judging, value: float, speed: str, where: str, numerics: bool,
            common: dict[str, Any]) -> tuple[PolicyVerdict, str] | None:
    """A policy within the tolerance that is still not accepted: its outputs drift (cosine), it is emulated (numerics
    only) or it does not fit the memory budget; None when nothing vetoes it."""
    cfg = j.report.config
    metric, delta = cfg.metric, delta_text(value, j.base_metric, j.tol)
    cos = r.fidelity.get("cos_min") if cfg.mode == "infer" else None
    if cos is not None and cos < cfg.min_cosine:  # the metric can hide drift the outputs show
        return (PolicyVerdict(r.policy, Verdict.COSINE, f"cosine {cos:.4f} < {cfg.min_cosine:g}", **common),
                f"{r.policy}: {speed}, {metric} {metric_text(value)} ({delta}) but its worst output cosine vs "
                f"{BASELINE} is {cos:.4f}, below {cfg.min_cosine:g}.")  # the fp32 reference run's outputs
    if numerics:  # its metric, never its speed
        if r.conversion and not r.conversion.get("converted"):  # the filter took nothing: say so
            return (PolicyVerdict(r.policy, Verdict.NUMERICS_ONLY, "numerics only: no layer converted", **common),
                    f"{r.policy}: converts no layer of this model (its filter, as on a GPU, left every Linear out), "
                    "so it ran as its float part alone; the -all variant emulates every layer whose shape the format "
                    "takes.")
        needs = (r.info.speed_needs if r.info else "") or "hardware that runs its format"
        return (PolicyVerdict(r.policy, Verdict.NUMERICS_ONLY, f"numerics only: {where}", **common),
                f"{r.policy}: numerically {where} on {metric} ({metric_text(value)}, {delta}) on this model, "
                f"emulated; its speed needs {needs}.")
    too_big = over(r, cfg.memory_budget_bytes)
    if too_big:  # the fastest policy within tolerance that fits is the answer, not the fastest
        return (PolicyVerdict(r.policy, Verdict.OVER_MEMORY, too_big, **common),
                f"{r.policy}: {speed}, {metric} {metric_text(value)} ({delta}, {where}), but it {too_big}.")
    return None


def _judged(r: PolicyResult, j: _Judging) -> tuple[PolicyVerdict, str | None, bool]:
    """One policy that ran: (its verdict, its sentence or None, whether it is accepted)."""
    cfg, baseline = j.report.config, j.report.baseline
    value = r.metric(cfg.metric)
    numerics = r.info is not None and r.info.numerics_only  # emulated: its steps' time is not its format's
    sp = None if numerics else speedup(r, j.base)
    ci = None if numerics else r.speedup_ci
    finite = value is not None and math.isfinite(value) and r.policy != baseline
    common = {"speedup": sp, "speedup_low": ci.low if ci else None, "speedup_high": ci.high if ci else None,
              "metric": value, "delta": delta_text(value, j.base_metric, j.tol) if finite else ""}
    speed = "emulated (numerics only)" if numerics else speed_text(sp, baseline) if sp else "no timing"
    failed = _unfinished(r, j, value, speed, common)
    if failed is not None:
        return failed[0], failed[1], False
    assert value is not None
    ok, where = judge(value, j.base_metric, j.tol, cfg.higher_is_better, baseline)
    if r.policy == baseline:
        return PolicyVerdict(r.policy, Verdict.BASELINE, "baseline", **common), None, True
    kind = Verdict.BETTER if where.startswith("better") else Verdict.EQUAL if where.startswith("equal") \
        else Verdict.WITHIN if ok else Verdict.OUTSIDE
    delta = delta_text(value, j.base_metric, j.tol)
    note = f"{r.policy}: {speed}, {cfg.metric} {metric_text(value)} ({delta}, {where})."
    vetoed = _vetoed(r, j, value, speed, where, numerics, common) if ok else None
    if vetoed is not None:
        return vetoed[0], vetoed[1], False
    return PolicyVerdict(r.policy, kind, where, **common), note, ok


def judged_runs(report: Report, base: PolicyResult, base_metric: float, tol: Tolerance
                ) -> tuple[dict[str, PolicyVerdict], list[PolicyResult], dict[str, str]]:
    """Each policy that ran, judged on its own: (verdicts, the accepted results, a sentence per policy)."""
    j = _Judging(report, base, base_metric, tol)
    verdicts: dict[str, PolicyVerdict] = {}
    accepted: list[PolicyResult] = []
    notes: dict[str, str] = {}
    for r in report.results:
        if not r.ran:
            continue
        verdict, note, ok = _judged(r, j)
        verdicts[r.policy] = verdict
        if note is not None:
            notes[r.policy] = note
        if ok:
            accepted.append(r)
    return verdicts, accepted, notes
