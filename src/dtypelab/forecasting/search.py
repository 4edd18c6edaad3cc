"""The largest batch size whose traced peak fits a memory limit, with few traces.

The peak is non-decreasing in the batch size and, phase by phase, close to affine in it (every tensor is either
independent of the batch or proportional to it). So: from the traces at two sizes, the affine estimate of the
largest size that fits; then traces at that estimate and its neighbour decide, and a bisection between the sizes
known to fit and not to fit finishes when the estimate was off (a peak that moves between phases, the allocator's
rounding). Every answer rests on a traced size that fits and the next size traced not to fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

CAP = 1 << 20  # the largest batch size looked at: past it the answer is "at least CAP"


@dataclass
class Search:
    """What the search found: ``largest`` fits (None: not even ``step`` fits), ``capped`` when ``largest`` is the
    cap and more might fit; ``traced`` maps each size traced to its peak."""

    largest: int | None
    capped: bool = False
    traced: dict[int, int] = field(default_factory=dict)


def largest_batch(peak_at: Callable[[int], int], limit: int, start: int, step: int = 1, cap: int = CAP,
                  known: dict[int, int] | None = None, per_sample: float | None = None) -> Search:
    """The largest multiple of ``step`` (>= ``step``) whose ``peak_at`` is at most ``limit``; ``start`` is a size
    already traced or worth tracing first (the task's own), ``known`` sizes traced already. ``per_sample``: what
    the start's trace says each sample adds (the activations and temporaries at a forward or backward peak): the
    first jump goes where that line meets the limit, so that when it is right two traces (that size and the next)
    settle it."""
    traced: dict[int, int] = dict(known or {})
    cap = max(step, cap // step * step)

    def peak(b: int) -> int:
        if b not in traced:
            traced[b] = peak_at(b)
        return traced[b]

    def fits(b: int) -> bool:
        return peak(b) <= limit

    def down(x: float) -> int:
        return int(x) // step * step

    start = max(step, min(cap, down(start) or step))
    if not fits(start):
        if start == step:
            return Search(None, traced=traced)
        lo, hi = 0, start  # lo: nothing traced, fits trivially; hi does not fit
    else:
        lo, hi, before = start, 0, 0
        if per_sample and per_sample > 0:  # the estimate's answer and the size after it, traced
            guess = min(cap, max(start, down(start + (limit - peak(start)) / per_sample)))
            if guess > start and not fits(guess):
                hi = guess
            elif guess + step <= cap and not fits(guess + step):
                return Search(guess, traced=traced)
            elif guess > start:
                before, lo = start, guess
        while not hi:  # bracket the answer: double, then jump along the line through the last two that fit
            if lo == cap:
                return Search(lo, capped=True, traced=traced)
            if before:
                slope = (peak(lo) - peak(before)) / (lo - before)
                probe = cap if slope <= 0 else down(lo + (limit - peak(lo)) / slope)
            else:
                probe = 2 * lo
            probe = min(cap, max(lo + step, probe))
            if fits(probe):
                before, lo = lo, probe
            else:
                hi = probe
    bisect = lo == 0
    while hi - lo > step:  # false position through the bracket, the size after it, bisection when that stalls
        width = hi - lo
        guess = down((lo + hi) / 2) if bisect else down(lo + (limit - peak(lo)) * (hi - lo) / (peak(hi) - peak(lo)))
        guess = min(hi - step, max(lo + step, guess))
        if fits(guess):
            lo = guess
            if lo + step < hi and not bisect:
                if fits(lo + step):
                    lo += step
                else:
                    hi = lo + step
        else:
            hi = guess
        bisect = lo == 0 or hi - lo > width // 2  # the bracket did not halve: halve it next
    return Search(lo if lo >= step else None, traced=traced)
