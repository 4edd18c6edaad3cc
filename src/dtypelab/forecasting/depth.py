"""A deep model's step from two shallow ones: a transformer repeats one block, so each of its step's quantities (the
peak and its breakdown, each phase's peak, the state, the ops' times) is a + b·L in its number of blocks L. A task
that can build its model with any number of blocks (``Task.with_blocks``: an ``hf:`` language model) is traced with
three blocks and with four, and the line through them is read at L: the same numbers a trace of all L blocks gives
(the blocks are identical), in a fraction of its time (the 32 blocks of an 8B model: traces of three and four). One
exception, in time alone: an op over every block's parameters at once (the update's multi-tensor kernels) can sit at
the per-kernel floor in a shallow stack and above it in the whole one (0.02% of a tiny model's step).

A phase's peak can fall at a different moment as the stack deepens (a checkpointed backward peaks while the last
blocks are recomputed beside every block's kept input, or in the first beside every block's gradient, which one
depending on the depth), so the ledger keeps each phase's peak by where in the stack it fell (``Ledger.moments``:
before the blocks, at the stack's low end (its first two blocks), at its high end (its last two)). Each moment's
bytes are a + b·L, so each is read off its own line, and the step's peak is the highest of them at L (a shallow
model may peak in its update and the deep one in its backward). A block between two others holds bytes linear in its
index, so none between peaks above both ends' (those moments are not kept); the first block (in a LoRA step its
input needs no gradient) and the last (beside the head) differ from their neighbours by what no depth changes, so
each end holds two. Three blocks are the fewest with one between two others. Traces without the same moments are not
joined (``linear`` is None)"""

from __future__ import annotations

import re
from dataclasses import replace

from dtypelab.core.results import TimeForecast
from dtypelab.forecasting.fake_step import Traced, after
from dtypelab.forecasting.ledger import Peak

SHALLOW = (3, 4)  # the depths traced: the least at which a block sits between two others (Ledger.moments)
DEEP_ENOUGH = 10  # a model with fewer blocks is traced whole: little to gain


def read_off(blocks: int, shallow: tuple[int, int] = SHALLOW) -> bool:
    """Whether a stack of ``blocks`` is read off its traces at ``shallow`` rather than traced whole (training and
    serving forecasts alike)."""
    return blocks >= max(DEEP_ENOUGH, shallow[1] + 1)


def shallow_depths(kinds: list[int | None], blocks: int) -> tuple[int, int]:
    """The two depths a deep stack is read off: blocks repeat a pattern of attention kinds (Gemma-2 alternates a
    sliding-window layer and a full one; most models have one kind: ``SHALLOW``), so the shallower trace has at least
    three blocks and ends where the whole stack's pattern does, and the deeper one adds one period (the line then adds
    whole periods, each block at its own kind)."""
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    first = next(d for d in range(SHALLOW[0], SHALLOW[0] + period) if (blocks - d) % period == 0)
    return first, first + period


def along(a: float, b: float, periods: float) -> float:
    """A quantity traced as ``a`` and, one period of blocks deeper, ``b``: its value ``periods`` periods past ``a``."""
    return a + (b - a) * periods


def _at(a: float, b: float, depth: int) -> float:
    return along(a, b, (depth - SHALLOW[0]) / (SHALLOW[1] - SHALLOW[0]))


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
    """The step of ``depth`` blocks from its traces with three and four blocks (``extras``: the bytes each holds
    beyond its trace, a stand-in's layout; None: they have not the same phases)."""
    a, b = _moments(one, train), _moments(two, train)
    if set(a) != set(b) or not b:
        return None
    # each moment's peak (in a training step: as every step after the first has it) on its own line: which one
    # peaks highest can change with depth (the update in a shallow model, the backward in a deep one; in a
    # checkpointed backward, the last block recomputed beside every block's kept input, or the first beside every
    # block's gradient)
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
    """Each moment's peak: a pass's by where in the stack it fell (``Ledger.moments``), where those were kept, and
    every other phase's own; in a training step as every step after the first has it."""
    kept = traced.phases
    if traced.moments:
        kept = {**{k: p for k, p in traced.phases.items() if k not in ("forward", "backward")}, **traced.moments}
    return {k: after(k.partition("@")[0], p, traced.state, traced.gradients) if train else p for k, p in kept.items()}


def linear_time(one: TimeForecast, two: TimeForecast, depth: int) -> TimeForecast:
    """A step's predicted time at ``depth`` blocks from its times with three and four."""
    if one.step_s is None or two.step_s is None:
        return two
    bounds = {k: max(0.0, _at(one.bounds.get(k, 0.0), two.bounds.get(k, 0.0), depth)) for k in two.bounds}
    return replace(two, step_s=_at(one.step_s, two.step_s, depth),
                   breakdown={k: max(0.0, _at(one.breakdown.get(k, 0.0), two.breakdown.get(k, 0.0), depth))
                              for k in two.breakdown},
                   bounds=bounds, bound=max(bounds, key=bounds.get) if bounds else two.bound,
                   kernels=round(_at(one.kernels, two.kernels, depth)))


__all__ = ["DEEP_ENOUGH", "SHALLOW", "along", "linear", "linear_time", "read_off", "shallow_depths"]
