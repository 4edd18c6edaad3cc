"""The sweep's time budget: each policy's run estimated from the fp32 run and the hardware probe, so that a
policy that would take ten minutes is skipped with its estimate instead of silently eating them."""

from __future__ import annotations

from dataclasses import dataclass

from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.options import parse_duration
from dtypelab.core.policies import BASELINE, COMPILED_BASELINE, Plan

DEFAULT_BUDGET_S = 900.0
# A compiled policy's first call: inductor's compile of a small transformer took 32 s on 2 cores with an
# empty cache (minilm, int8-dyn-compile); allowed for up front, since nothing measures it before it runs.
COMPILE_ALLOWANCE_S = 60.0


def parse_budget(text: str | float | None) -> float | None:
    """'15m', '900', '90s', '1.5h' -> seconds; '0' or 'none' -> None (no budget)."""
    return parse_duration(text, "budget")


def budget_text(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:.0f} s"


@dataclass(frozen=True)
class Estimate:
    seconds: float
    why: str  # how it was reached, for the skip reason


def estimate(plan: Plan, hw: HardwareInfo, baseline_wall_s: float) -> Estimate:
    """The policy's wall time: fp32's, scaled by how much slower the probe measured its slowest kernel than
    float32's matmul (never below fp32's own: start-up, loading and evaluation do not get faster), plus a
    compile allowance for compiled policies. An upper bound for compute-bound models; small models are
    dominated by overheads and run closer to fp32's time."""
    ref = None if hw.disturbed else hw.gflops.get("float32")  # a disturbed probe's ratios estimate nothing
    ratios = [ref / hw.gflops[c.facts.probe_key] for c in plan.configs if ref and hw.gflops.get(c.facts.probe_key)]
    ratio = max(ratios, default=1.0)
    seconds = baseline_wall_s * max(1.0, ratio)
    why = f"fp32 took {baseline_wall_s:.0f} s" + (f"; its kernel measured {ratio:.1f}x slower" if ratio > 1 else "")
    if plan.compiles:
        seconds += COMPILE_ALLOWANCE_S
        why += f"; {COMPILE_ALLOWANCE_S:.0f} s allowed for compiling"
    return Estimate(seconds, why)


def over_budget(plan: Plan, hw: HardwareInfo, base_wall: float | None, budget_s: float | None,
                elapsed: float) -> str:
    """Why this policy would not fit in what is left of the budget, or ""."""
    if budget_s is None or base_wall is None or plan.name == BASELINE:
        return ""
    est, left = estimate(plan, hw, base_wall), budget_s - elapsed
    if est.seconds <= left:
        return ""
    return (f"over the time budget: estimated {est.seconds:.0f} s ({est.why}), {max(0.0, left):.0f} s left of "
            f"{budget_text(budget_s)}")


def _in_order(plans: list[Plan], hw: HardwareInfo, base_wall: float, left: float
              ) -> tuple[list[str], list[str], float]:
    """Taken in order at their estimates: (the names that fit in ``left`` seconds, "NAME (~N s)" of those that do
    not, the seconds of those that fit)."""
    total, kept, dropped = 0.0, [], []
    for plan in plans:
        seconds = estimate(plan, hw, base_wall).seconds
        if total + seconds > left:
            dropped.append(f"{plan.name} (~{seconds:.0f} s)")
        else:
            total += seconds
            kept.append(plan.name)
    return kept, dropped, total


def budget_plan(plans: list[Plan], hw: HardwareInfo, base_wall: float, budget_s: float, elapsed: float) -> str:
    """One line, after the fp32 run: what the rest of the sweep is estimated to take and, at those estimates,
    which policies will not fit (each is judged again, on the time really left, when its turn comes)."""
    left = budget_s - elapsed
    _, dropped, total = _in_order(plans, hw, base_wall, left)
    text = (f"time budget {budget_text(budget_s)}: the {len(plans)} remaining polic{'ies' if len(plans) > 1 else 'y'} "
            f"{'are' if len(plans) > 1 else 'is'} estimated at ~{total:.0f} s, {max(0.0, left):.0f} s left")
    return text + (f"; at those estimates these will be skipped: {', '.join(dropped)}" if dropped else "")


def baseline_unneeded(pending: list[Plan], hw: HardwareInfo, base_wall: float | None, budget_s: float | None,
                      elapsed: float) -> str:
    """Why the compiled baseline (``pending[0]``) is not worth its run, or "": it is there only to time compiled
    policies against, and at the estimates none of them would fit in the budget after it (its run would be spent on
    a comparison that is never made)."""
    if budget_s is None or base_wall is None or not pending or pending[0].name != COMPILED_BASELINE:
        return ""
    dependents = [p.name for p in pending[1:] if p.compiles]
    if not dependents:
        return ""
    left = budget_s - elapsed
    kept, _, _ = _in_order(pending, hw, base_wall, left)
    if kept[:1] != [COMPILED_BASELINE] or set(dependents) & set(kept):
        return ""
    return (f"over the time budget: it is the baseline of {', '.join(dependents)} alone, and none of them is "
            f"estimated to fit in the {max(0.0, left):.0f} s left of {budget_text(budget_s)} after it")
