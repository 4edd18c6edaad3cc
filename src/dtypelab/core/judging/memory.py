"""``--memory-budget``: what a policy needs and whether it fits. Training: the tensors of its state and activations
as counted (``PolicyResult.memory``); otherwise, or without that count, the run's measured peak."""

from __future__ import annotations

from dataclasses import replace

from dtypelab.core.judging.speed import speed_text, speedup
from dtypelab.core.results import Decision, PolicyResult, PolicyVerdict, Report, Verdict
from dtypelab.core.text import MIB

MB = MIB


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
    return f"needs {n / MB:,.1f} MiB > {budget / MB:,.1f} MiB budget"


def mb(n: int | None) -> str:
    return f"{n / MB:,.1f} MiB" if n is not None else "unknown"


def within_budget(report: Report, accepted: list[PolicyResult], verdicts: dict[str, PolicyVerdict],
                   sentences: list[str]) -> tuple[Decision, str | None]:
    """fp32 itself does not fit --memory-budget: the fastest accepted policy that does (by each run's own median,
    or the paired speedup), or none. Rewrites the first sentence accordingly."""
    cfg, baseline = report.config, report.baseline
    base = report.result(baseline)
    budget = cfg.memory_budget_bytes
    fits = [r for r in accepted if r.policy != baseline and r.timing and not over(r, budget)]
    verdicts[baseline] = replace(verdicts[baseline], text=f"baseline; {over(base, budget)}")
    if not fits:
        kept = accepted + [r for r in report.results if r.policy in verdicts
                           and verdicts[r.policy].verdict == Verdict.OVER_MEMORY]
        smallest = min((r for r in kept if need(r) is not None), key=need, default=None)
        least = f"; the least within tolerance: {smallest.policy} at {mb(need(smallest))}" if smallest else ""
        sentences[0] = (f"No recommendation: nothing within {cfg.tolerance} on {cfg.metric} fits the "
                        f"{mb(budget)} memory budget ({baseline} {over(base, budget)}{least}).")
        return Decision.NOTHING_FITS, None
    best = max(fits, key=lambda r: r.speedup_ci.point if r.speedup_ci else speedup(r, base) or 0.0)
    sp = best.speedup_ci.point if best.speedup_ci else speedup(best, base)
    sentences[0] = (f"Use {best.policy}: {baseline} {over(base, budget)}, and {best.policy} is the fastest policy "
                    f"within {cfg.tolerance} on {cfg.metric} that fits ({mb(need(best))}; {speed_text(sp, baseline)}).")
    verdicts[best.policy] = replace(verdicts[best.policy], verdict=Verdict.RECOMMENDED, text="recommended (fits)")
    return Decision.USE, best.policy
