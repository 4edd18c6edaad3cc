"""When to move a layer: from its readings over time, with hysteresis so one spike moves nothing. The rules and
their thresholds are a frozen ``Rules`` object, stored in the record (``AutopilotConfig``).

- headroom: its largest |value| passed ``headroom`` of the format's limit on two readings in a row (at once when it
  passed 90%: one more reading may be too late);
- trend: the drift a fixed threshold sees too late when values double between readings. A least-squares line
  through log(amax) of its last readings crosses the limit within ``horizon`` steps, on two readings in a row —
  and only for a layer already past ``trend_from`` of the limit whose growth keeps up (the log-growth of its latest
  readings at least ``trend_keep`` of the fitted line's slope). Early training's fast growth that then levels off, or
  grows linearly (its log-growth falls), is not extrapolated as if it were exponential forever;
- underflow: more than half of its weight gradient at or below the format's smallest normal on two readings in a
  row (flushed to zero: that layer stops learning).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from dtypelab.piloting.monitor import Reading

AT_ONCE = 0.9  # share of the limit past which a layer moves on one reading
UNDERFLOW_SHARE = 0.5
TREND_POINTS = 4  # readings the trend is fitted on (at least 3)
CONFIRM = 2  # readings in a row a warning must hold


@dataclass(frozen=True)
class Rules:
    """The autopilot's thresholds (``AutopilotOptions``; kept in the record's config)."""

    headroom: float = 0.5
    horizon: int = 20
    trend_from: float = 0.1
    trend_keep: float = 0.5


def rules_of(settings: dict, every: int) -> Rules:
    """The rules from ``AutopilotOptions``' fields; the horizon defaults to two readings."""
    return Rules(float(settings.get("headroom", 0.5)), int(settings.get("horizon") or 2 * every),
                 float(settings.get("trend_from", 0.1)), float(settings.get("trend_keep", 0.5)))


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
    rules: Rules
    layers: dict[str, _Layer] = field(default_factory=dict)

    @property
    def horizon(self) -> int:
        return self.rules.horizon

    @horizon.setter
    def horizon(self, steps: int) -> None:  # the sampling interval widened: the default horizon follows it
        self.rules = Rules(self.rules.headroom, steps, self.rules.trend_from, self.rules.trend_keep)

    def decide(self, step: int, readings: dict[str, Reading]) -> dict[str, Warning_]:
        """The layers to move now, each with why."""
        moves: dict[str, Warning_] = {}
        rules = self.rules
        for name, r in readings.items():
            state = self.layers.setdefault(name, _Layer())
            limit = torch.finfo(r.dtype).max
            fmt = str(r.dtype).removeprefix("torch.")
            if math.isfinite(r.amax) and r.amax > 0:
                state.history = [*state.history[-(TREND_POINTS - 1):], (step, r.amax)]
            seen = set()
            share = r.amax / limit if math.isfinite(r.amax) else math.inf
            if share >= rules.headroom:
                seen.add("headroom")
            crossing = crossing_step(state.history, limit, rules.trend_keep)
            if crossing is not None and crossing - step <= rules.horizon:
                seen.add("trend")
            if r.underflow is not None and r.underflow > UNDERFLOW_SHARE:
                seen.add("underflow")
            for cause in ("headroom", "trend", "underflow"):
                state.counts[cause] = state.counts.get(cause, 0) + 1 if cause in seen else 0
            if share >= AT_ONCE or state.counts["headroom"] >= CONFIRM:
                moves[name] = Warning_("headroom", f"largest |value| {r.amax:.4g} is {share:.0%} of {fmt}'s limit "
                                                   f"{limit:.5g}" + (" on two readings in a row" if share < AT_ONCE
                                                                     else ""), r.amax, limit)
            elif state.counts["trend"] >= CONFIRM and share >= rules.trend_from:
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


def crossing_step(history: list[tuple[int, float]], limit: float, keep: float = 0.5) -> int | None:
    """The step at which a least-squares line through (step, log amax) reaches log(limit); None when the readings
    are too few, do not rise, or rise ever slower: the log-growth between the last two readings below ``keep`` of
    the line's slope (values that level off, or grow linearly, never reach the limit at the rate a line through
    their earlier, faster growth says)."""
    if len(history) < 3:
        return None
    xs = [float(s) for s, _ in history]
    ys = [math.log(a) for _, a in history]
    if len(set(xs)) < 2:
        return None
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope <= 0:
        return None
    late = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    if late < keep * slope:  # slowing down: the line through all the readings overstates what comes next
        return None
    return math.ceil((math.log(limit) - intercept) / slope - 1e-9)  # a crossing at step 30 is 30, not 30.0000001
