"""Formats this machine cannot run fast, by emulation: on each task, amp-bf16 against each float8 training recipe and
mxfp8 training with emulated numerics: the metric, each converted layer's SQNR against bfloat16 and the share of its
input flushed to zero, and the wall time of each run and of the sweep (emulation is slow: float32 matmuls around
a quantize-dequantize of every operand).

    python benchmarks/emulation.py [--tasks gpt2,charlm] [--steps N] [--out DIR]

The -all variants are used: on a CPU-sized model torchao's filter (sized for an H100) converts no layer, so the GPU
variants would say only that. The records go to --out. Say which CPU (``dtypelab hardware``) with every figure.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import dtypelab

POLICIES = "amp-bf16,fp8-tensorwise-all-emu,fp8-rowwise-all-emu,fp8-rowwise-gw-hp-all-emu,mxfp8-emu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="gpt2,charlm")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default="emulation-bench")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hw = dtypelab.probe(budget_s=0.05)
    print(f"machine: {hw.device_name} ({' '.join(hw.cpu_flags or [])}), torch {torch.__version__}\n")
    for task in [t for t in args.tasks.split(",") if t]:
        start = time.perf_counter()
        settings = {"steps": args.steps} if args.steps else {}
        report = dtypelab.bench(task, POLICIES, rounds=0, json_path=str(out / f"{task}.json"), **settings)
        wall = time.perf_counter() - start
        cfg, rec = report.config, report.recommendation
        print(f"### {cfg.task_name} ({cfg.steps} steps × batch {cfg.batch_size}); sweep {wall:.0f} s\n")
        print(f"| policy | {cfg.metric} | Δ vs fp32 | verdict | layers | SQNR dB vs bf16 (min / median) | "
              "input flushed (max) | run s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in report.results:
            v = rec.verdict(r.policy)
            sq = [e["sqnr_db"] for e in r.emulated_layers if e["sqnr_db"] is not None]
            flushed = max((e["input_underflow"] for e in r.emulated_layers), default=None)
            value = r.metric(cfg.metric)
            print(f"| {r.policy} | {value:.4g} | {v.delta if v else ''} | {v.text if v else r.reason} | "
                  f"{len(r.emulated_layers) or ''} | "
                  f"{f'{min(sq):.1f} / {statistics.median(sq):.1f}' if sq else ''} | "
                  f"{f'{flushed:.1e}' if flushed is not None else ''} | {r.wall_s:.0f} |" if value is not None
                  else f"| {r.policy} | {r.status} | | {r.reason} | | | | {r.wall_s:.0f} |")
        print()
        for s in rec.sentences:
            if "numerically" in s:
                print(f"- {s}")
        print()


if __name__ == "__main__":
    main()
