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


@dataclass
class _Sizes:
    """The sizes traced so far and the questions asked of them: the search's state."""

    peak_at: Callable[[int], int]
    limit: int
    step: int
    cap: int
    traced: dict[int, int]

    def peak(self, b: int) -> int:
        if b not in self.traced:
            self.traced[b] = self.peak_at(b)
        return self.traced[b]

    def fits(self, b: int) -> bool:
        return self.peak(b) <= self.limit

    def down(self, x: float) -> int:
        return int(x) // self.step * self.step

    def first_jump(self, start: int, per_sample: float) -> tuple[int, int, int] | Search:
        """(before, lo, hi) after tracing the size the per-sample estimate points at and the size after it; a Search
        when those two settle it."""
        guess = min(self.cap, max(start, self.down(start + (self.limit - self.peak(start)) / per_sample)))
        if guess > start and not self.fits(guess):
            return 0, start, guess
        if guess + self.step <= self.cap and not self.fits(guess + self.step):
            return Search(guess, traced=self.traced)
        return (start, guess, 0) if guess > start else (0, start, 0)

    def bracket(self, before: int, lo: int) -> tuple[int, int] | Search:
        """(lo, hi): a size that fits and a larger one that does not; doubling, then jumping along the line through
        the last two that fit. A Search when the cap fits."""
        while True:
            if lo == self.cap:
                return Search(lo, capped=True, traced=self.traced)
            if before:
                slope = (self.peak(lo) - self.peak(before)) / (lo - before)
                probe = self.cap if slope <= 0 else self.down(lo + (self.limit - self.peak(lo)) / slope)
            else:
                probe = 2 * lo
            probe = min(self.cap, max(lo + self.step, probe))
            if not self.fits(probe):
                return lo, probe
            before, lo = lo, probe

    def narrow(self, lo: int, hi: int) -> int:
        """The largest size that fits between ``lo`` (fits, or 0) and ``hi`` (does not): false position through the
        bracket, the size after it, bisection when that stalls."""
        step, bisect = self.step, lo == 0
        while hi - lo > step:
            width = hi - lo
            guess = self.down((lo + hi) / 2) if bisect else self.down(
                lo + (self.limit - self.peak(lo)) * (hi - lo) / (self.peak(hi) - self.peak(lo)))
            guess = min(hi - step, max(lo + step, guess))
            if self.fits(guess):
                lo = guess
                if lo + step < hi and not bisect:
                    if self.fits(lo + step):
                        lo += step
                    else:
                        hi = lo + step
            else:
                hi = guess
            bisect = lo == 0 or hi - lo > width // 2  # the bracket did not halve: halve it next
        return lo


def largest_batch(peak_at: Callable[[int], int], limit: int, start: int, step: int = 1, cap: int = CAP,
                  known: dict[int, int] | None = None, per_sample: float | None = None) -> Search:
    """The largest multiple of ``step`` (>= ``step``) whose ``peak_at`` is at most ``limit``; ``start`` is a size
    already traced or worth tracing first (the task's own), ``known`` sizes traced already. ``per_sample``: what
    the start's trace says each sample adds (the activations and temporaries at a forward or backward peak): the
    first jump goes where that line meets the limit, so that when it is right two traces (that size and the next)
    settle it."""
    sizes = _Sizes(peak_at, limit, step, max(step, cap // step * step), dict(known or {}))
    start = max(step, min(sizes.cap, sizes.down(start) or step))
    if not sizes.fits(start):
        if start == step:
            return Search(None, traced=sizes.traced)
        lo, hi = 0, start  # lo: nothing traced, fits trivially; hi does not fit
    else:
        jump = sizes.first_jump(start, per_sample) if per_sample and per_sample > 0 else (0, start, 0)
        if isinstance(jump, Search):
            return jump
        before, lo, hi = jump
        if not hi:
            found = sizes.bracket(before, lo)
            if isinstance(found, Search):
                return found
            lo, hi = found
    lo = sizes.narrow(lo, hi)
    return Search(lo if lo >= step else None, traced=sizes.traced)
