"""Paired speedups: the baseline's timing over a policy's, replicate by replicate (a round of blocks in one process,
or a whole run in a process of its own), as a geometric mean with a Student-t interval on the log ratios."""

from __future__ import annotations

from dtypelab.core.results import RoundBlock, SpeedupInterval
from dtypelab.core.stats import MIN_QUIET, ratio_interval


def paired_speedup(base: tuple[RoundBlock, ...], blocks: tuple[RoundBlock, ...]) -> SpeedupInterval | None:
    """fp32's block median over this policy's, round by round; their geometric mean and a Student-t interval
    on the log ratios. Rounds where either block was disturbed are left out while MIN_QUIET quiet ones remain."""
    by_round = {b.round: b for b in base}  # a policy decided early has fewer rounds than fp32: pair by round
    pairs = [(by_round[p.round], p) for p in blocks
             if p.round in by_round and by_round[p.round].median_s > 0 and p.median_s > 0]
    quiet = [(b, p) for b, p in pairs if not (b.disturbed or p.disturbed)]
    used = quiet if len(quiet) >= MIN_QUIET else pairs
    ci = ratio_interval([(b.median_s, p.median_s) for b, p in used])
    if ci is None:
        return None
    return SpeedupInterval(point=ci.point, low=ci.low, high=ci.high, rounds=ci.n, dropped=len(pairs) - len(used),
                           disturbed=len(pairs) - len(quiet))


__all__ = ["paired_speedup"]
