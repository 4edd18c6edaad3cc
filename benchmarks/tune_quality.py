"""How good is the tuner's plan? On a model small enough to measure every plan, compare it with the best plan.

    python benchmarks/tune_quality.py [--layers 5] [--width 1024] [--batch 64] [--candidates int8-dyn,bf16]
                                      [--min-cosine 0.9995] [--repeat 5]

An MLP of ``--layers`` Linear layers (random weights, seeded) on a batch of ``--batch``. Every assignment of
{fp32, *candidates} to every layer is evaluated the way the tuner evaluates plans (end-to-end latency interleaved
with fp32's, worst per-sample output cosine vs fp32); the best feasible one is the reference. Then the tuner runs
(per-layer scores, search with at most L + 2·log2 L full evaluations) and its plan is measured again beside the
reference in the same process. Prints the machine, both plans, both speedups, their ratio (goal ≥ 0.98) and the
evaluation count. Never run it beside another torch process: two of them on 2 cores slow each other 10-30x.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch import nn

import dtypelab
from dtypelab.core.policies import get_policy, parse_policies
from dtypelab.tuning.infer import InferenceBench, alternatives, chosen_configs, evaluator, layer_plan
from dtypelab.tuning.search import budget_for, search


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--candidates", default="int8-dyn,bf16")
    ap.add_argument("--min-cosine", type=float, default=0.9995)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5, help="re-measurements of the two plans at the end (median)")
    args = ap.parse_args()
    hw = dtypelab.probe(budget_s=0.02)
    print(f"{args}")
    print(f"{hw.cpu_name}; flags {' '.join(hw.cpu_flags)}; torch {torch.__version__}")

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        mods: list[nn.Module] = []
        for _ in range(args.layers):
            mods += [nn.Linear(args.width, args.width), nn.GELU()]
        return nn.Sequential(*mods)

    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    bench = InferenceBench(make_model, x, torch.device("cpu"))
    names = [n for n, m in bench.base_model.named_modules() if isinstance(m, nn.Linear)]
    cands = parse_policies(args.candidates)
    start = time.perf_counter()
    feasible = []
    for combo in itertools.product([None, *cands], repeat=len(names)):
        plan = layer_plan({n: c for n, c in zip(names, combo, strict=True) if c is not None})
        sp, cos = bench.evaluate(plan)
        if cos >= args.min_cosine:
            feasible.append((sp, plan))
    brute_s = time.perf_counter() - start
    best_sp, best_plan = max(feasible, key=lambda t: t[0])
    print(f"brute force: {len(list(itertools.product(range(len(cands) + 1), repeat=len(names))))} plans in "
          f"{brute_s:.0f} s; best feasible {best_sp:.3f}x: {best_plan.name}")
    start = time.perf_counter()
    scored = bench.score(names, cands, max_sensitivity=1 - args.min_cosine)
    choice = {s.name: get_policy(s.config) for s, _ in scored}
    result = search([s for s, _ in scored], evaluator(bench, choice, args.min_cosine), None, alternatives(scored))
    tuned = layer_plan(chosen_configs(result.best.layers, choice) if result.best else {})
    tune_s = time.perf_counter() - start
    # both plans measured again, side by side, so the ratio compares like with like
    # (alternated and repeated: one paired measurement of a few-ms model moves by ±5% on this machine)
    pairs = [(bench.evaluate(best_plan), bench.evaluate(tuned)) for _ in range(args.repeat)]
    again_best = statistics.median(b[0] for b, _ in pairs)
    again_tuned = statistics.median(t[0] for _, t in pairs)
    cos = min(t[1] for _, t in pairs)
    print(f"tuner: {len(result.evaluations)} full evaluations (budget {budget_for(len(names))}) in {tune_s:.0f} s; "
          f"plan {tuned.name}")
    print(f"measured again: best {again_best:.3f}x, tuned {again_tuned:.3f}x (worst cosine {cos:.5f}); "
          f"tuned / best = {again_tuned / again_best:.3f} (goal >= 0.98)")


if __name__ == "__main__":
    main()
