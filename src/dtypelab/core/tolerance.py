"""How far a metric may move from fp32's, and whether a measured value keeps within it. A leaf of the core:
records store a ``Tolerance`` (typed, not a string every reader parses again) and judging applies it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtypelab.core.errors import DtypelabError

BASELINE = "fp32"  # the policy every other is judged against; records name it, the registry registers it
COMPILED_BASELINE = "fp32+compile"  # a compiled policy's fair speed baseline


@dataclass(frozen=True)
class Tolerance:
    """How far the primary metric may move from fp32: relative (``value`` 0.01 for "1%") or absolute (0.005). One
    sided: a metric that moved the good way always passes."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str | float | Tolerance) -> Tolerance:
        """'1%' (relative), '0.005' (absolute), or a Tolerance."""
        if isinstance(text, Tolerance):
            return text
        raw = str(text).strip()
        relative = raw.endswith("%")
        try:
            value = float(raw[:-1] if relative else raw)
        except ValueError:
            raise DtypelabError(
                f"bad tolerance {raw!r}: use a percentage like 1% or an absolute value like 0.005") from None
        if not math.isfinite(value) or value < 0:
            raise DtypelabError(f"bad tolerance {raw!r}: must be a finite number >= 0")
        return cls(value / 100 if relative else value, relative)

    def allowed(self, baseline: float) -> float:
        return abs(baseline) * self.value if self.relative else self.value

    def __str__(self) -> str:
        return f"{self.value * 100:g}%" if self.relative else f"{self.value:g}"


def delta_text(value: float, base: float, tol: Tolerance) -> str:
    """Change of the metric vs the baseline, in the terms the tolerance is given in."""
    delta = value - base
    rel = f"{delta / abs(base) * 100:+.2f}%" if base else "n/a"
    return f"{rel}" if tol.relative else f"{delta:+.4g} ({rel})"


def judge(value: float, base: float, tol: Tolerance, higher: bool, baseline: str = BASELINE) -> tuple[bool, str]:
    """(accepted, how it compares with ``baseline``'s ``base``): the tolerance is one-sided, so a metric that moved
    the good way always passes and reads 'better than fp32', never 'within 1%'."""
    gain = value - base if higher else base - value
    if gain > 0:
        return True, f"better than {baseline}"
    if gain == 0:
        return True, f"equal to {baseline}"
    ok = -gain <= tol.allowed(base)
    return ok, f"{'within' if ok else 'outside'} {tol}"


def tolerance_sentence(metric: str, tol: Tolerance, higher: bool, baseline: str = BASELINE) -> str:
    worse = "lower" if higher else "higher"
    return (f"Tolerance {tol} is one-sided: a policy's {metric} may be up to {tol} {worse} than {baseline}'s; "
            f"a better {metric} always passes.")
