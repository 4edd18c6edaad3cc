"""Each policy of a bench record judged on its own, as data: run or not (``not_run``), and for those that ran, its
metric against the baseline's within the tolerance, its output fidelity in inference, whether it is emulated, and
whether it fits the memory budget (``judged_runs``). ``recommend`` decides among them."""

from __future__ import annotations

import math
from dataclasses import replace

from dtypelab.core.judging.memory import over
from dtypelab.core.judging.speed import speed_text, speedup
from dtypelab.core.results import PolicyResult, PolicyVerdict, Report, Verdict
from dtypelab.core.tolerance import Tolerance, delta_text, judge


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


def judged_runs(report: Report, base: PolicyResult, base_metric: float, tol: Tolerance
                 ) -> tuple[dict[str, PolicyVerdict], list[PolicyResult], dict[str, str]]:
    """Each policy that ran, judged on its own: (verdicts, the accepted results, a sentence per policy)."""
    cfg, baseline = report.config, report.baseline
    metric, higher = cfg.metric, cfg.higher_is_better
    verdicts: dict[str, PolicyVerdict] = {}
    accepted: list[PolicyResult] = []
    notes: dict[str, str] = {}
    for r in report.results:
        if not r.ran:
            continue
        value = r.metric(metric)
        numerics = r.info is not None and r.info.numerics_only  # emulated: its steps' time is not its format's
        sp = None if numerics else speedup(r, base)
        ci = None if numerics else r.speedup_ci
        finite = value is not None and math.isfinite(value) and r.policy != baseline
        common = {"speedup": sp, "speedup_low": ci.low if ci else None, "speedup_high": ci.high if ci else None,
                  "metric": value, "delta": delta_text(value, base_metric, tol) if finite else ""}
        speed = "emulated (numerics only)" if numerics else speed_text(sp, baseline) if sp else "no timing"
        if r.status == "diverged":
            verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.DIVERGED, f"diverged at step {r.first_nonfinite_step}",
                                               **common)
            notes[r.policy] = f"{r.policy}: {speed} but diverged ({r.reason})."
        elif r.first_nonfinite_step is not None:
            verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.NONFINITE,
                                               f"non-finite loss at step {r.first_nonfinite_step}", **common)
            notes[r.policy] = f"{r.policy}: {speed} but the loss went non-finite at step {r.first_nonfinite_step}."
        elif value is None or not math.isfinite(value):
            verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.NO_METRIC, "no metric", **common)
            notes[r.policy] = f"{r.policy}: {speed} but its {metric} is {value}."
        else:
            ok, where = judge(value, base_metric, tol, higher, baseline)
            delta = delta_text(value, base_metric, tol)
            if r.policy == baseline:
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.BASELINE, "baseline", **common)
                accepted.append(r)
                continue
            kind = Verdict.BETTER if where.startswith("better") else Verdict.EQUAL if where.startswith("equal") \
                else Verdict.WITHIN if ok else Verdict.OUTSIDE
            verdicts[r.policy] = PolicyVerdict(r.policy, kind, where, **common)
            notes[r.policy] = f"{r.policy}: {speed}, {metric} {metric_text(value)} ({delta}, {where})."
            cos = r.fidelity.get("cos_min") if cfg.mode == "infer" else None
            if ok and cos is not None and cos < cfg.min_cosine:  # the metric can hide drift the outputs show
                ok = False
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.COSINE, f"cosine {cos:.4f} < {cfg.min_cosine:g}",
                                                   **common)
                notes[r.policy] = (f"{r.policy}: {speed}, {metric} {metric_text(value)} ({delta}) but its worst output "
                                   f"cosine vs {baseline} is {cos:.4f}, below {cfg.min_cosine:g}.")
            if ok and numerics:  # its metric, never its speed
                ok = False
                needs = r.info.speed_needs or "hardware that runs its format"
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.NUMERICS_ONLY, f"numerics only: {where}",
                                                   **common)
                notes[r.policy] = (f"{r.policy}: numerically {where} on {metric} ({metric_text(value)}, {delta}) on "
                                   f"this model, emulated; its speed needs {needs}.")
                if r.conversion and not r.conversion.get("converted"):  # the filter took nothing: say so
                    verdicts[r.policy] = replace(verdicts[r.policy], text="numerics only: no layer converted")
                    notes[r.policy] = (f"{r.policy}: converts no layer of this model (its filter, as on a GPU, left "
                                       "every Linear out), so it ran as its float part alone; the -all variant "
                                       "emulates every layer whose shape the format takes.")
            too_big = over(r, cfg.memory_budget_bytes) if ok else ""
            if too_big:  # the fastest policy within tolerance that fits is the answer, not the fastest
                ok = False
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.OVER_MEMORY, too_big, **common)
                notes[r.policy] = (f"{r.policy}: {speed}, {metric} {metric_text(value)} ({delta}, {where}), but it "
                                   f"{too_big}.")
            if ok:
                accepted.append(r)
    return verdicts, accepted, notes
