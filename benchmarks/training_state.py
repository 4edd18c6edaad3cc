"""The precision of the training state, measured: on each task, every state policy against fp32 in metric, speed and
where the memory goes; and the ways of keeping small bfloat16 updates side by side on the lost-updates case.

    python benchmarks/training_state.py [--tasks gpt2,charlm] [--out DIR]

Per task it runs one ``dtypelab bench`` (each policy in its own process, paired rounds for the speed) and prints, per
policy: the metric's change vs fp32 and its verdict, the speedup, and the weights / optimizer state / training memory
as ratios of fp32's, counted from the tensors (exact bytes), beside the measured process peak. Then, on
``examples/lost_updates.py`` (every Adam update below half a bfloat16 spacing), the alternatives for keeping them:
stochastic rounding (torchao), Kahan summation (torch-optimi) and a float32 master copy (the example kind), against
pure bf16 and fp32. The records go to --out. Run it alone: nothing else may use the CPU. Say which CPU
(``dtypelab hardware``) with every figure.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import dtypelab

ROOT = Path(__file__).resolve().parents[1]
POLICIES = "fp32,bf16,amp-bf16,bf16-sr,bf16-kahan,amp-bf16+adam8bit,amp-bf16+adam4bit,bf16-sr+adam8bit"
LOST = f"{ROOT / 'examples' / 'lost_updates.py'}:make_task"
MASTER = f"{ROOT / 'examples' / 'custom_precision.py'}:bf16-master"


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "—"


def table(report: dtypelab.Report) -> str:
    cfg, rec = report.config, report.recommendation
    base = report.result("fp32")
    rows = [f"### {cfg.task_name} ({cfg.steps} steps × batch {cfg.batch_size})", "",
            f"| policy | {cfg.metric} | Δ | verdict | speedup | weights | optimizer state | master | training "
            "memory | process peak MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.results:
        v = rec.verdict(r.policy)
        mem, bmem = r.memory or {}, (base.memory if base else None) or {}
        peak = f"{r.peak_memory_bytes / 2**20:.1f}" if r.peak_memory_bytes is not None else "—"
        value = f"{r.metric(cfg.metric):.4g}" if r.ran and r.metric(cfg.metric) is not None else r.status
        rows.append(f"| {r.policy} | {value} | {v.delta if v else ''} | "
                    f"{v.text if v else r.reason} | {f'{v.speedup:.2f}x' if v and v.speedup else '—'} | "
                    f"{_ratio(mem.get('parameters'), bmem.get('parameters'))} | "
                    f"{_ratio(mem.get('optimizer_state'), bmem.get('optimizer_state'))} | "
                    f"{mem.get('master_weights', 0) / 2**20:.2f} MB | {_ratio(mem.get('total'), bmem.get('total'))} | "
                    f"{peak} |")
    rows += ["", *(f"- {s}" for s in rec.sentences[:1]),
             *(f"- {n}" for n in rec.notes if "rounded their small updates away" in n)]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="gpt2,charlm")
    parser.add_argument("--out", default="state-bench")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hw = dtypelab.probe(budget_s=0.05)
    print(f"machine: {hw.device_name} ({' '.join(hw.cpu_flags or [])}), torch {torch.__version__}\n")
    for task in [t for t in args.tasks.split(",") if t]:
        report = dtypelab.bench(task, POLICIES, json_path=str(out / f"{task}.json"))
        print(table(report), "\n", flush=True)
    report = dtypelab.bench(LOST, f"fp32,amp-bf16,bf16,bf16-sr,bf16-kahan,{MASTER}",
                            json_path=str(out / "lost-updates.json"))
    print(table(report))
    print(f"\nrecords: {os.path.abspath(out)}")


if __name__ == "__main__":
    main()
