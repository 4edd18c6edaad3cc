"""A policy's speed against the baseline (fp32 unless the run named another), as a number and in words."""

from __future__ import annotations

from dtypelab.core.results import BASELINE, PolicyResult


def speedup(result: PolicyResult, base: PolicyResult) -> float | None:
    """From paired rounds when they ran (their geometric mean), else the ratio of the runs' medians."""
    if result.speedup_ci is not None:
        return result.speedup_ci.point
    if result is base or result.policy == base.policy:
        return 1.0 if base.timing else None
    t, b = result.timing, base.timing
    return b.median / t.median if t and b and t.median > 0 else None


def speed_text(sp: float, baseline: str = BASELINE) -> str:
    """'2.52x faster than fp32', or '2.17x slower than fp32 (0.46x its speed)': a ratio below 1 never
    reads as 'x slower'."""
    if sp >= 1:
        return f"{sp:.2f}x faster than {baseline}"
    return f"{1 / sp:.2f}x slower than {baseline} ({sp:.2f}x its speed)"
