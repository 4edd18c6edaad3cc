"""The per-layer search on synthetic layers whose sensitivities and gains are known: it finds the optimum within
L + 2·log2(L) evaluations."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dtypelab.tuning.search import Evaluation, LayerScore, budget_for, search


def _model(layers: list[LayerScore], threshold: float):
    """Errors and savings add up: fidelity 1 - Σ sensitivity, time 1 - Σ gain."""
    by = {s.name: s for s in layers}
    calls: list[frozenset[str]] = []

    def evaluate(chosen: frozenset[str]) -> Evaluation:
        calls.append(chosen)
        harm = sum(by[n].sensitivity for n in chosen)
        saved = sum(by[n].gain for n in chosen)
        return Evaluation(chosen, 1 / (1 - saved), 1 - harm, harm <= threshold + 1e-12)

    return evaluate, calls


def _optimum(layers: list[LayerScore], threshold: float) -> float:
    best = 1.0
    for r in range(len(layers) + 1):
        for combo in itertools.combinations(layers, r):
            if sum(s.sensitivity for s in combo) <= threshold + 1e-12:
                best = max(best, 1 / (1 - sum(s.gain for s in combo)))
    return best


def test_known_optimum_within_the_promised_evaluations():
    # two sensitive layers (attention outputs) among eight; the rest are cheap to convert
    layers = [LayerScore(f"l{i}", 0.001, 0.08) for i in range(6)]
    layers += [LayerScore("attn.out", 0.02, 0.05), LayerScore("head", 0.03, 0.02)]
    evaluate, calls = _model(layers, threshold=0.01)
    result = search(layers, evaluate)
    assert result.best is not None and result.best.layers == frozenset(f"l{i}" for i in range(6))
    assert result.best.speedup == pytest.approx(_optimum(layers, 0.01))
    assert len(calls) == len(set(calls)) <= 8 + 2 * math.log2(8)
    assert result.order[-2:] == ("attn.out", "head")  # most harm per unit of speed last


def test_everything_feasible_takes_one_evaluation_and_nothing_gaining_takes_none():
    layers = [LayerScore(f"l{i}", 0.0001, 0.05) for i in range(5)]
    evaluate, calls = _model(layers, threshold=1.0)
    assert search(layers, evaluate).best.layers == frozenset(s.name for s in layers) and len(calls) == 1
    idle = [LayerScore("a", 0.1, 0.0), LayerScore("b", 0.1, -0.01)]  # nothing faster: no plan is chosen
    evaluate, calls = _model(idle, threshold=1.0)
    assert search(idle, evaluate).best is None and len(calls) <= budget_for(2)


@pytest.mark.parametrize("seed", range(20))
def test_random_additive_instances_stay_in_budget_and_near_the_optimum(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    layers = [LayerScore(f"l{i}", rng.uniform(0, 0.01), rng.uniform(0.005, 0.1)) for i in range(n)]
    threshold = rng.uniform(0, 0.02)
    evaluate, calls = _model(layers, threshold)
    result = search(layers, evaluate)
    assert len(calls) <= budget_for(n) and len(calls) == len(set(calls))
    got = result.best.speedup if result.best else 1.0
    assert got >= 0.9 * _optimum(layers, threshold)  # a heuristic: the benchmark reports how close it gets
    assert all(e.feasible for e in [result.best] if e) and result.front


def test_a_layer_whose_fast_choice_breaks_the_constraint_takes_its_faithful_alternative():
    """Per-tensor int8 is faster on 'head' but too lossy; per-channel is slower and fine: the refinement takes
    the alternative rather than leaving the layer in fp32."""
    layers = [LayerScore(f"l{i}", 0.001, 0.08) for i in range(4)] + [LayerScore("head", 0.05, 0.1)]
    alt = LayerScore("head@per-channel", 0.002, 0.06)
    by = {s.name: s for s in [*layers, alt]}

    def evaluate(chosen: frozenset[str]) -> Evaluation:
        assert not {"head", "head@per-channel"} <= chosen  # one config per layer
        harm, saved = sum(by[n].sensitivity for n in chosen), sum(by[n].gain for n in chosen)
        return Evaluation(chosen, 1 / (1 - saved), 1 - harm, harm <= 0.01)

    result = search(layers, evaluate, alternatives={"head": [alt]})
    assert result.best.layers == frozenset({"l0", "l1", "l2", "l3", "head@per-channel"})
    assert len(result.evaluations) <= budget_for(len(layers))
