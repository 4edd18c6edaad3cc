"""The per-layer search: which layers to convert so the model is as fast as it can be while it keeps the
constraint (output fidelity, metric). Independent of torch: layers come with a measured sensitivity and a
measured gain, and ``evaluate(chosen)`` runs one full evaluation of a plan.

1. Rank the layers by harm per unit of speed: sensitivity / gain, smallest first; layers that gain nothing alone
   come last, by sensitivity. AIMET and INC rank by sensitivity alone; the ratio puts cheap, fast layers first.
2. Evaluate the whole ranked set: if it keeps the constraint, that is the answer.
3. Binary-search the longest ranked prefix that keeps the constraint (log2 L evaluations; feasibility is assumed
   to fall with the prefix length, which holds when errors add up).
4. With the evaluations left of the budget (L + 2·log2 L in all), refine greedily: try each layer after the
   prefix on top of the best plan so far, keep it when the plan stays feasible and gets faster; when it does
   not, try the layer's alternatives (other candidates for it) that could fix what failed: less harmful ones
   (most faithful first) when it broke the constraint, faster ones when it kept it but did not pay.

Every plan reported was evaluated for real; the best is the fastest feasible one measured to be faster than the
unconverted model (its whole interval above the no-gain band, as ``bench`` decides), not a prediction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from dtypelab.core.stats import measurably_faster


@dataclass(frozen=True)
class LayerScore:
    """One layer's measured sensitivity (harm of converting it alone, e.g. 1 − worst cosine) and gain (seconds
    per call saved by converting it alone), for its best candidate config."""

    name: str
    sensitivity: float
    gain: float
    config: str = ""

    @property
    def ratio(self) -> float:
        return self.sensitivity / self.gain if self.gain > 0 else math.inf


@dataclass(frozen=True)
class Evaluation:
    """One full evaluation of a plan: the layers it converts, its measured speedup over the unconverted model
    (with its 95% interval where the timing gave one), its fidelity (higher is better) and whether it keeps the
    constraint."""

    layers: frozenset[str]
    speedup: float
    fidelity: float
    feasible: bool
    why: str = ""  # the search step that asked for it
    low: float = math.nan
    high: float = math.nan
    disturbed: str = ""  # what other processes did during its timing, when they disturbed it

    @property
    def faster(self) -> bool:
        """Measurably faster than the unconverted model: its whole interval above the no-gain band (without an
        interval, its speedup above 1)."""
        return measurably_faster(self.low) if not math.isnan(self.low) else self.speedup > 1.0


@dataclass(frozen=True)
class SearchResult:
    best: Evaluation | None  # the fastest feasible plan measured (None: not even the first one was feasible)
    order: tuple[str, ...]  # the ranking
    evaluations: tuple[Evaluation, ...]
    budget: int
    out_of_time: bool = False  # the search stopped at its time budget, before its count budget

    @property
    def front(self) -> tuple[Evaluation, ...]:
        return pareto(self.evaluations)


def pareto(evaluations: Sequence[Evaluation]) -> tuple[Evaluation, ...]:
    """The Pareto front of what was measured: no other evaluation is both faster and of higher fidelity."""
    pts = sorted(evaluations, key=lambda e: (-e.speedup, -e.fidelity))
    out, best_fid = [], -math.inf
    for e in pts:
        if e.fidelity > best_fid:
            out.append(e)
            best_fid = e.fidelity
    return tuple(out)


def budget_for(n_layers: int) -> int:
    """The most full evaluations the search may make: L + 2·log2(L) (at least 1)."""
    return max(1, n_layers + math.floor(2 * math.log2(n_layers))) if n_layers > 1 else 1


@dataclass
class Limit:
    """``--budget``: the whole command's time, from when it began. The search starts no full evaluation expected
    to end past its share of what is left, keeping time for the evaluations that must follow it (each estimated
    as the mean of those measured so far); the first evaluation of each search is always made."""

    budget_s: float | None
    began: float = field(default_factory=time.monotonic)
    took: list[float] = field(default_factory=list)  # seconds of each full evaluation so far
    hit: list[int] = field(default_factory=list)  # per search stopped by it: the evaluations it had made

    def timed(self, evaluate: Callable[[frozenset[str]], Evaluation]) -> Callable[[frozenset[str]], Evaluation]:
        def run(chosen: frozenset[str]) -> Evaluation:
            t0 = time.monotonic()
            try:
                return evaluate(chosen)
            finally:
                self.took.append(time.monotonic() - t0)

        return run

    def stop(self, share: float = 1.0, after: int = 0) -> Callable[[], bool] | None:
        """For ``search``: a search starting now may use ``share`` of the time left and must leave room for
        ``after`` more full evaluations once it ends."""
        if self.budget_s is None:
            return None
        now = time.monotonic()
        end = now + max(0.0, self.began + self.budget_s - now) * share

        def late() -> bool:
            est = sum(self.took) / len(self.took) if self.took else 0.0
            return time.monotonic() + est * (1 + after) > end

        return late

    def saw(self, result: SearchResult) -> None:
        if result.out_of_time:
            self.hit.append(len(result.evaluations))

    def notes(self, budget: int) -> tuple[str, ...]:
        if not self.hit or self.budget_s is None:
            return ()
        made = " and ".join(str(n) for n in self.hit)
        return (f"The search stopped at the time budget ({self.budget_s:g} s for the whole command) after {made} of "
                f"at most {budget} full evaluations: the plan is the best measured by then; --budget 0 lifts the "
                "limit.",)


@dataclass
class _State:
    """The evaluations made so far, within the budget, and the best plan among them."""

    evaluate: Callable[[frozenset[str]], Evaluation]
    budget: int
    stop: Callable[[], bool] | None
    done: dict[frozenset[str], Evaluation] = field(default_factory=dict)
    best: Evaluation | None = None
    late: bool = False

    def run(self, chosen: frozenset[str], why: str) -> Evaluation | None:
        """``chosen`` evaluated (once); None when the budget or the time is spent."""
        if chosen in self.done:
            return self.done[chosen]
        if len(self.done) >= self.budget:
            return None
        if self.done and self.stop is not None and self.stop():
            self.late = True
            return None
        e = replace(self.evaluate(chosen), why=why)
        self.done[chosen] = e
        return self.consider(e)

    def consider(self, e: Evaluation) -> Evaluation:
        # only a plan measurably faster than the unconverted model is worth choosing
        if e.feasible and e.faster and (self.best is None or e.speedup > self.best.speedup):
            self.best = e
        return e

    def longest_feasible_prefix(self, order: tuple[str, ...]) -> int:
        """Binary search over [0, len - 1] for the longest prefix of the ranking that keeps the constraints."""
        lo, hi = 0, len(order) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            e = self.run(frozenset(order[:mid]), f"binary search: the first {mid} of the ranking")
            if e is None:
                break
            if e.feasible:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def refine(self, names: Sequence[str], by_name: Mapping[str, LayerScore],
               alternatives: Mapping[str, Sequence[LayerScore]]) -> None:
        """Greedy: add each layer to the best plan so far (or, with none yet, to nothing), trying its alternatives
        where its first choice did not pay."""
        current = self.best.layers if self.best is not None else frozenset()
        for name in names:
            if name in current:
                continue
            e = self.run(current | {name}, f"refine: add {name}")
            if e is None:
                return
            if self.best is not None and self.best.layers == e.layers:
                current = e.layers
                continue
            first = by_name[name]
            # an alternative is worth a full evaluation only where it could fix what failed: less harm when the
            # first choice broke the constraint, more gain when it kept it but did not pay
            options = [a for a in alternatives.get(name, ())
                       if (a.sensitivity < first.sensitivity if not e.feasible else a.gain > first.gain)]
            for alt in sorted(options, key=lambda a, e=e: a.sensitivity if not e.feasible else -a.gain):
                tried = self.run(current | {alt.name}, f"refine: {name} as {alt.config or alt.name}")
                if tried is None:
                    return
                if self.best is not None and self.best.layers == tried.layers:
                    current = tried.layers
                    break


def search(layers: Sequence[LayerScore], evaluate: Callable[[frozenset[str]], Evaluation],
           budget: int | None = None, alternatives: Mapping[str, Sequence[LayerScore]] | None = None,
           stop: Callable[[], bool] | None = None) -> SearchResult:
    """Find the fastest feasible subset of ``layers`` to convert with at most ``budget`` evaluations; ``stop()`` is
    asked before each one after the first, and True ends the search (a time budget: see ``Limit.stop``).
    ``alternatives[name]``: other ways to convert that layer, each under its own unique name (which ``evaluate``
    then receives in place of ``name``), tried in refinement where the layer's first choice did not pay."""
    # Layers that gain nothing alone still take part, last (by sensitivity): timed alone, a small layer's
    # conversion overhead can hide what it saves inside the whole model, and only full evaluations decide.
    ranked = sorted(layers, key=lambda s: (s.gain <= 0, s.ratio if s.gain > 0 else s.sensitivity, -s.gain))
    order = tuple(s.name for s in ranked)
    state = _State(evaluate, budget if budget is not None else budget_for(len(layers)), stop)
    if not order:
        return SearchResult(None, order, (), state.budget)
    whole = state.run(frozenset(order), "every layer")
    k = len(order) if state.best is not None else 0
    if whole is not None and not whole.feasible:
        k = state.longest_feasible_prefix(order)
    # greedy refinement on top of the best plan so far; with none faster than fp32 yet, from nothing, over every
    # layer (a feasible prefix may still be slower than fp32 as a whole while some of its layers pay)
    state.refine(order[k:] if state.best is not None else order, {s.name: s for s in layers}, alternatives or {})
    return SearchResult(state.best, order, tuple(state.done.values()), state.budget, state.late)
