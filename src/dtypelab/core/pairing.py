"""Paired speedups: the baseline's timing over a policy's, replicate by replicate (a round of blocks in one process,
or a whole run in a process of its own), as a geometric mean with a Student-t interval on the log ratios; and the
same for energy, from the joules the counter read over each block's window."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dtypelab.core.objectives import Objective
from dtypelab.core.results import Energy, RoundBlock, SpeedupInterval
from dtypelab.core.stats import MIN_QUIET, mean_interval, ratio_interval

T = TypeVar("T")


def _quiet(items: list[T], disturbed: Callable[[T], bool]) -> list[T]:
    """``items`` without the disturbed ones while MIN_QUIET quiet ones remain; all of them otherwise."""
    quiet = [x for x in items if not disturbed(x)]
    return quiet if len(quiet) >= MIN_QUIET else items


def _paired(base: tuple[RoundBlock, ...], blocks: tuple[RoundBlock, ...], value: str) -> SpeedupInterval | None:
    """The baseline's ``value`` per step over this policy's, round by round (a policy decided early has fewer rounds
    than the baseline: paired by round), as a geometric mean with a Student-t interval on the log ratios; rounds where
    either block was disturbed are left out while MIN_QUIET quiet ones remain."""
    by_round = {b.round: b for b in base}
    pairs = [(by_round[p.round], p) for p in blocks
             if p.round in by_round and (getattr(by_round[p.round], value) or 0) > 0 and (getattr(p, value) or 0) > 0]
    used = _quiet(pairs, lambda bp: bp[0].disturbed or bp[1].disturbed)
    def per_step(b: RoundBlock) -> float:
        return b.median_s if value == "median_s" else float(getattr(b, value)) / b.n

    ci = ratio_interval([(per_step(b), per_step(p)) for b, p in used])
    if ci is None:
        return None
    return SpeedupInterval(point=ci.point, low=ci.low, high=ci.high, rounds=ci.n, dropped=len(pairs) - len(used),
                           disturbed=sum(b.disturbed or p.disturbed for b, p in pairs))


def paired_gain(objective: Objective, base: tuple[RoundBlock, ...], blocks: tuple[RoundBlock, ...]
                ) -> SpeedupInterval | None:
    """The baseline's blocks over this policy's by what ``objective`` pairs them by (``Objective.paired_by``)."""
    return _paired(base, blocks, objective.paired_by)


def paired_speedup(base: tuple[RoundBlock, ...], blocks: tuple[RoundBlock, ...]) -> SpeedupInterval | None:
    """fp32's block median over this policy's (``_paired``)."""
    return _paired(base, blocks, "median_s")


def paired_energy(base: tuple[RoundBlock, ...], blocks: tuple[RoundBlock, ...]) -> SpeedupInterval | None:
    """The baseline's joules per step over this policy's (above 1: it uses less), as ``paired_speedup``: the
    interleaved rounds that time speed give energy the same evidence."""
    return _paired(base, blocks, "joules")


def block_energy(blocks: tuple[RoundBlock, ...], batch_size: int, tokens: int | None, counter: str,
                 idle_watts: float | None) -> Energy | None:
    """A policy's energy from its measured windows (quiet ones, while MIN_QUIET remain): all joules over all steps,
    with a Student-t interval on each window's joules per step; None when no window was measured."""
    used = _quiet([b for b in blocks if b.joules is not None and b.n and b.window_s], lambda b: b.disturbed)
    if not used:
        return None
    joules, steps = sum(b.joules for b in used), sum(b.n for b in used)  # type: ignore[misc]
    per_step = joules / steps
    mean = mean_interval([b.joules / b.n for b in used])  # type: ignore[operator]
    half = (mean[1] - mean[0]) / 2 if mean else None
    low, high = (per_step - half, per_step + half) if half is not None else (None, None)
    return Energy(per_step, per_step / batch_size, "measured", counter,
                  joules_per_token=per_step / tokens if tokens else None,
                  watts=joules / sum(b.window_s for b in used),  # type: ignore[misc]
                  low=low, high=high, windows=len(used), idle_watts=idle_watts)


__all__ = ["block_energy", "paired_energy", "paired_gain", "paired_speedup"]
