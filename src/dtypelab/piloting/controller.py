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

from dtypelab.core.results import Rules
from dtypelab.piloting.monitor import Reading


def rules_of(settings: dict) -> Rules:
    """The rules from ``AutopilotOptions``' fields (horizon 0: two readings, whatever their interval becomes); a field
    not given keeps ``Rules``' default (the one place the defaults are written)."""
    return Rules(float(settings.get("headroom", Rules.headroom)), int(settings.get("horizon") or 0),
                 float(settings.get("trend_from", Rules.trend_from)),
                 float(settings.get("trend_keep", Rules.trend_keep)))


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
    """The rules applied to every layer's readings; ``horizon``: the trend's look-ahead in steps, the rules' own or
    (0 there) two readings, which whoever reads keeps up to date as the interval between readings changes."""

    rules: Rules
    horizon: int = 0
    layers: dict[str, _Layer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.horizon = self.horizon or self.rules.horizon or 20

    def decide(self, step: int, readings: dict[str, Reading]) -> dict[str, Warning_]:
        """The layers to move now, each with why."""
        moves: dict[str, Warning_] = {}
        rules = self.rules
        for name, r in readings.items():
            state = self.layers.setdefault(name, _Layer())
            limit = torch.finfo(r.dtype).max
            fmt = str(r.dtype).removeprefix("torch.")
            if math.isfinite(r.amax) and r.amax > 0:
                state.history = [*state.history[-(rules.trend_points - 1):], (step, r.amax)]
            seen = set()
            share = r.amax / limit if math.isfinite(r.amax) else math.inf
            if share >= rules.headroom:
                seen.add("headroom")
            crossing = crossing_step(state.history, limit, rules.trend_keep)
            if crossing is not None and crossing - step <= self.horizon:
                seen.add("trend")
            if r.underflow is not None and r.underflow > rules.underflow_share:
                seen.add("underflow")
            for cause in ("headroom", "trend", "underflow"):
                state.counts[cause] = state.counts.get(cause, 0) + 1 if cause in seen else 0
            if share >= rules.at_once or state.counts["headroom"] >= rules.confirm:
                held = f" on {_row(rules.confirm)}" if share < rules.at_once else ""
                moves[name] = Warning_("headroom", f"largest |value| {r.amax:.4g} is {share:.0%} of {fmt}'s limit "
                                                   f"{limit:.5g}{held}", r.amax, limit)
            elif state.counts["trend"] >= rules.confirm and share >= rules.trend_from:
                when = f"at about step {crossing}" if crossing is not None and crossing > step else "already"
                moves[name] = Warning_("trend", f"largest |value| {r.amax:.4g} ({share:.0%} of {fmt}'s limit "
                                                f"{limit:.5g}) rising: its trend line crosses the limit {when}",
                                       r.amax, limit)
            elif state.counts["underflow"] >= rules.confirm:
                moves[name] = Warning_("underflow", f"{r.underflow:.0%} of its weight gradient at or below {fmt}'s "
                                                    f"smallest normal {torch.finfo(r.dtype).tiny:.3g} (flushed to "
                                                    f"zero) on {_row(rules.confirm)}", r.amax, limit)
        for name in moves:
            self.layers.pop(name, None)  # a moved layer starts its history anew in its new format
        return moves


def _row(n: int) -> str:
    return f"{'two' if n == 2 else n} readings in a row"


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
