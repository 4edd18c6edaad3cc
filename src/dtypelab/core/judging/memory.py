"""``--memory-budget``: what a policy needs and whether it fits. Training: the tensors of its state and activations
as counted (``PolicyResult.memory``); otherwise, or without that count, the run's measured peak."""

from __future__ import annotations

from dataclasses import replace

from dtypelab.core.judging.speed import speed_text, speedup
from dtypelab.core.results import Decision, PolicyResult, PolicyVerdict, Report, Verdict
from dtypelab.core.text import size_text


def need(r: PolicyResult) -> int | None:
    """The bytes ``r`` needs, as the budget is judged: its counted training memory, else its measured peak."""
    if r.memory and r.memory.get("total"):
        return r.memory["total"]
    return r.peak_memory_bytes


def over(r: PolicyResult, budget: int | None) -> str:
    """Why ``r`` does not fit ``budget`` ('needs 12.3 MiB > 8.0 MiB'), or '' when it does (or nothing is known)."""
    n = need(r)
    if budget is None or n is None or n <= budget:
        return ""
    return f"needs {size_text(n)} > {size_text(budget)} budget"


def within_budget(report: Report, accepted: list[PolicyResult], verdicts: dict[str, PolicyVerdict],
                  ) -> tuple[Decision, str | None, str]:
    """The baseline itself does not fit --memory-budget: the fastest accepted policy that does (by each run's own
    median, or the paired speedup), or none; (the decision, the policy, the sentence that says it)."""
    cfg, baseline = report.config, report.baseline
    base = report.result(baseline)
    budget = cfg.memory_budget_bytes
    fits = [r for r in accepted if r.policy != baseline and r.timing and not over(r, budget)]
    if not fits:
        kept = accepted + [r for r in report.results if r.policy in verdicts
                           and verdicts[r.policy].verdict == Verdict.OVER_MEMORY]
        smallest = min((r for r in kept if need(r) is not None), key=need, default=None)
        least = f"; the least within tolerance: {smallest.policy} at {size_text(need(smallest))}" if smallest else ""
        return Decision.NOTHING_FITS, None, (
            f"No recommendation: nothing within {cfg.tolerance} on {cfg.metric} fits the {size_text(budget)} memory "
            f"budget ({baseline} {over(base, budget)}{least}).")
    best = max(fits, key=lambda r: r.speedup_ci.point if r.speedup_ci else speedup(r, base) or 0.0)
    sp = best.speedup_ci.point if best.speedup_ci else speedup(best, base)
    return Decision.USE, best.policy, (
        f"Use {best.policy}: {baseline} {over(base, budget)}, and {best.policy} is the fastest policy within "
        f"{cfg.tolerance} on {cfg.metric} that fits ({size_text(need(best))}; {speed_text(sp, baseline)}).")


def budget_verdicts(report: Report, best: str | None, verdicts: dict[str, PolicyVerdict]
                    ) -> dict[str, PolicyVerdict]:
    """The verdicts a budget decision changes: the baseline's says what it needs; the chosen policy's, that it fits."""
    base = report.result(report.baseline)
    out = {report.baseline: replace(verdicts[report.baseline],
                                    text=f"baseline; {over(base, report.config.memory_budget_bytes)}")}
    if best is not None:
        out[best] = replace(verdicts[best], verdict=Verdict.RECOMMENDED, text="recommended (fits)")
    return out
