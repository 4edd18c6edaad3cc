"""A deep model's step from two shallow ones: a transformer repeats one block, so each of its step's quantities (the
peak and its breakdown, each phase's peak, the state, the ops' times) is a + b·L in its number of blocks L. A task
that can build its model with any number of blocks (``Task.with_blocks``: an ``hf:`` language model) is traced with
two blocks and with three, and the line through them is read at L: the same numbers a trace of all L blocks gives
(the blocks are identical), in a fraction of its time (the 32 blocks of an 8B model: traces of two and three).

Each phase of the step (batch, forward, backward, update) peaks at the same moment of it at every depth (the end of
the forward, the start of the backward, the update), so each phase's peak is read off its own line, and the step's
peak is the highest of them at L (a shallow model may peak in its update and the deep one in its backward). Traces
without the same phases are not joined (``linear`` is None), and a checkpointed step is traced whole: its backward
peaks while some block is recomputed, and which one moves as the stack deepens (checked against whole traces: a
line through two and three blocks of an 8B model was 0.3-4% under the whole trace)."""

from __future__ import annotations

import re
from dataclasses import replace

from dtypelab.core.results import TimeForecast
from dtypelab.forecasting.ledger import Peak
from dtypelab.forecasting.trace import Traced, after

SHALLOW = (2, 3)  # the depths traced (two at least: a single block is no repeated one for +ckpt)
DEEP_ENOUGH = 4  # a model with fewer blocks is traced whole: little to gain


def _at(a: float, b: float, depth: int) -> float:
    return a + (b - a) * (depth - SHALLOW[0]) / (SHALLOW[1] - SHALLOW[0])


def _ints(a: dict[str, int], b: dict[str, int], depth: int) -> dict[str, int]:
    return {k: round(_at(a.get(k, 0), b.get(k, 0), depth)) for k in {*a, *b}}


def _module(name: str, depth: int) -> str:
    """The module the deeper trace peaked in, as the deep model names it: its last block is the deep one's last."""
    last = SHALLOW[1] - 1
    return re.sub(rf"(^|\.){last}(\.|$)", rf"\g<1>{depth - 1}\g<2>", name, count=1) if name else name


def _peak(a: Peak, b: Peak, depth: int) -> Peak:
    breakdown = _ints(a.breakdown, b.breakdown, depth)
    return Peak(sum(breakdown.values()), breakdown, b.phase, _module(b.module, depth))


def linear(one: Traced, two: Traced, depth: int, extras: tuple[int, int] = (0, 0),
           train: bool = True) -> Traced | None:
    """The step of ``depth`` blocks from its traces with two and three blocks (``extras``: the bytes each holds
    beyond its trace, a stand-in's layout; None: they have not the same phases)."""
    a, b = _moments(one, train), _moments(two, train)
    if set(a) != set(b) or not b:
        return None
    # each phase's peak (in a training step: as every step after the first has it) on its own line: which phase
    # peaks highest can change with depth (the update in a shallow model, the backward in a deep one)
    peak = max((_peak(a[k], b[k], depth) for k in b), key=lambda p: p.total)
    extra = round(_at(*extras, depth))
    if extra:
        peak = Peak(peak.total + extra, {**peak.breakdown, "parameters": peak.breakdown["parameters"] + extra},
                    peak.phase, peak.module)
    most = _ints(one.most, two.most, depth)
    most["parameters"] = most.get("parameters", 0) + extra
    phases = {k: _peak(one.phases[k], two.phases[k], depth) for k in two.phases}
    return Traced(peak, most, round(_at(one.parameter_bytes, two.parameter_bytes, depth)) + extra, phases,
                  _ints(one.state, two.state, depth), round(_at(one.gradients, two.gradients, depth)), (),
                  _ints(one.held, two.held, depth), shallow=(one.ops, two.ops, depth))


def _moments(traced: Traced, train: bool) -> dict[str, Peak]:
    """Each phase's peak, as every step after the first has it in a training step."""
    return {k: after(k, p, traced.state, traced.gradients) if train else p for k, p in traced.phases.items()}


def linear_time(one: TimeForecast, two: TimeForecast, depth: int) -> TimeForecast:
    """A step's predicted time at ``depth`` blocks from its times with two and three."""
    if one.step_s is None or two.step_s is None:
        return two
    bounds = {k: max(0.0, _at(one.bounds.get(k, 0.0), two.bounds.get(k, 0.0), depth)) for k in two.bounds}
    return replace(two, step_s=_at(one.step_s, two.step_s, depth),
                   breakdown={k: max(0.0, _at(one.breakdown.get(k, 0.0), two.breakdown.get(k, 0.0), depth))
                              for k in two.breakdown},
                   bounds=bounds, bound=max(bounds, key=bounds.get) if bounds else two.bound,
                   kernels=round(_at(one.kernels, two.kernels, depth)))


__all__ = ["DEEP_ENOUGH", "SHALLOW", "linear", "linear_time"]
