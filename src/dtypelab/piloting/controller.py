"""When to move a layer: from its readings over time, with hysteresis so one spike moves nothing.

- headroom: its largest |value| passed ``headroom`` of the format's limit on two readings in a row (at once when it
  passed 90%: one more reading may be too late);
- trend: a straight line through log(amax) of its last readings crosses the limit within ``horizon`` steps, on two
  readings in a row (the drift a fixed threshold sees too late when values double between readings);
- underflow: more than half of its weight gradient at or below the format's smallest normal on two readings in a
  row (flushed to zero: that layer stops learning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dtypelab.piloting.monitor import Reading

AT_ONCE = 0.9  # share of the limit past which a layer moves on one reading
UNDERFLOW_SHARE = 0.5
TREND_POINTS = 4  # readings the trend is fitted on (at least 3)
CONFIRM = 2  # readings in a row a warning must hold


@dataclass
class Warning_:
    cause: str
    evidence: str
    amax: float | None
    limit: float | None


@dataclass
class _Layer:
    history: list[tuple[int, float]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Controller:
    headroom: float
    horizon: int
    layers: dict[str, _Layer] = field(default_factory=dict)

    def decide(self, step: int, readings: dict[str, Reading]) -> dict[str, Warning_]:
        """The layers to move now, each with why."""
        moves: dict[str, Warning_] = {}
        for name, r in readings.items():
            state = self.layers.setdefault(name, _Layer())
            limit = torch.finfo(r.dtype).max
            fmt = str(r.dtype).removeprefix("torch.")
            if math.isfinite(r.amax) and r.amax > 0:
                state.history = [*state.history[-(TREND_POINTS - 1):], (step, r.amax)]
            seen = set()
            share = r.amax / limit if math.isfinite(r.amax) else math.inf
            if share >= self.headroom:
                seen.add("headroom")
            crossing = _crossing(state.history, limit)
            if crossing is not None and crossing - step <= self.horizon:
                seen.add("trend")
            if r.underflow is not None and r.underflow > UNDERFLOW_SHARE:
                seen.add("underflow")
            for cause in ("headroom", "trend", "underflow"):
                state.counts[cause] = state.counts.get(cause, 0) + 1 if cause in seen else 0
            if share >= AT_ONCE or state.counts["headroom"] >= CONFIRM:
                moves[name] = Warning_("headroom", f"largest |value| {r.amax:.4g} is {share:.0%} of {fmt}'s limit "
                                                   f"{limit:.5g}" + (" on two readings in a row" if share < AT_ONCE
                                                                     else ""), r.amax, limit)
            elif state.counts["trend"] >= CONFIRM:
                when = f"at about step {crossing}" if crossing is not None and crossing > step else "already"
                moves[name] = Warning_("trend", f"largest |value| {r.amax:.4g} ({share:.0%} of {fmt}'s limit "
                                                f"{limit:.5g}) rising: its trend line crosses the limit {when}",
                                       r.amax, limit)
            elif state.counts["underflow"] >= CONFIRM:
                moves[name] = Warning_("underflow", f"{r.underflow:.0%} of its weight gradient at or below {fmt}'s "
                                                    f"smallest normal {torch.finfo(r.dtype).tiny:.3g} (flushed to "
                                                    "zero) on two readings in a row", r.amax, limit)
        for name in moves:
            self.layers.pop(name, None)  # a moved layer starts its history anew in its new format
        return moves


def _crossing(history: list[tuple[int, float]], limit: float) -> int | None:
    """The step at which a least-squares line through (step, log amax) reaches log(limit); None when the last
    readings do not rise (or are too few)."""
    if len(history) < 3:
        return None
    xs = [float(s) for s, _ in history]
    ys = [math.log(a) for _, a in history]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    if slope <= 0:
        return None
    return math.ceil(xs[-1] + (math.log(limit) - (my + slope * (xs[-1] - mx))) / slope)
