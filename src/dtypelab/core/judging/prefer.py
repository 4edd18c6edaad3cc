"""Among policies whose speeds cannot be told apart, the one to recommend: the safer numerics (the better metric,
then float32 weights). Part of the decision ``recommend`` makes."""

from __future__ import annotations

import math

from dtypelab.core.objectives import objective as objective_of
from dtypelab.core.results import PolicyResult, SpeedupInterval


def keeps_fp32_weights(r: PolicyResult) -> bool:
    """Whether the policy trains float32 (or wider) weights: autocast and tf32 do, a pure low-precision cast does
    not (every update is rounded into its weights). The kind's own answer, kept in the record (filled in when an
    older record is read)."""
    return bool(r.info is not None and r.info.fp32_weights)


def keeps_updates(r: PolicyResult) -> bool:
    """Whether every weight keeps its small updates: float32 weights, or low-precision ones with a master copy,
    compensation or stochastic rounding (as the record says)."""
    return bool(r.info is not None and r.info.keeps_updates)


def gain_ci(r: PolicyResult, objective: str) -> SpeedupInterval | None:
    """The paired interval the objective decides by: the speedup, or the energy saved (the baseline's joules per step
    over this policy's)."""
    interval: SpeedupInterval | None = getattr(r, objective_of(objective).interval)
    return interval


def _gain(r: PolicyResult, objective: str) -> SpeedupInterval:
    ci = gain_ci(r, objective)
    assert ci is not None  # only policies with the interval the objective decides by are compared
    return ci


def safest(faster: list[PolicyResult], metric: str, higher: bool, objective: str = "speed"
           ) -> tuple[PolicyResult, str]:
    """Among the measurably faster policies (or, for the energy objective, those using measurably less energy), the
    one to recommend and, when it is not simply the best, the sentence that says why: gains whose 95% intervals
    overlap the best's cannot be told apart, so among those the better metric wins, then float32 weights (autocast
    over a pure low-precision cast), then the gain."""
    fastest = max(faster, key=lambda r: _gain(r, objective).point)
    peers = [r for r in faster if _gain(r, objective).high >= _gain(fastest, objective).low]
    sign = 1 if higher else -1

    def rank(r: PolicyResult) -> tuple[float, bool, float]:
        value = r.metric(metric)
        return (sign * value if value is not None else -math.inf, keeps_fp32_weights(r), _gain(r, objective).point)

    chosen = max(peers, key=rank)
    if chosen is fastest:
        return chosen, ""
    a, b = _gain(chosen, objective), _gain(fastest, objective)
    cm, fm = chosen.metric(metric), fastest.metric(metric)
    why = (f"its {metric} is better ({cm:.4g} vs {fm:.4g})" if cm != fm else
           f"its {metric} is the same and it keeps float32 weights ({fastest.policy} rounds every update into "
           "low-precision weights)")
    return chosen, (f"{chosen.policy} ({a.point:.2f}x, {a.low:.2f}–{a.high:.2f}) and {fastest.policy} "
                    f"({b.point:.2f}x, {b.low:.2f}–{b.high:.2f}) cannot be told apart in "
                    f"{objective_of(objective).gain[0]} (their 95% intervals "
                    f"overlap): {chosen.policy} is preferred because {why}.")
