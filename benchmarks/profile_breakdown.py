"""Why a policy is (not) faster: `bench --profile` on digits and charlm under fp32, bf16 and amp-bf16.

    python benchmarks/profile_breakdown.py [--tasks digits,charlm] [--policies fp32,bf16,amp-bf16] [--device cpu]

For each task it runs the real sweep with --profile (each policy in its own process, interleaved timing
rounds for the speedups) and prints the machine, each policy's speedup, the breakdown of its profiled step
(phases, and matmul/conv / casts / other ops / outside ops), the achieved matmul GFLOP/s against the probe's
peak, the profiler's own cost, and the "Why" paragraph of the recommendation. Never run it beside another
torch process: two of them on 2 cores slow each other 10-30x.
"""

from __future__ import annotations

import argparse
import time

import dtypelab
from dtypelab.core.judging import recommend, speedup
from dtypelab.core.results import CATEGORIES, CATEGORY_LABELS, PHASES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="digits,charlm")
    ap.add_argument("--policies", default="fp32,bf16,amp-bf16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    for task in args.tasks.split(","):
        started = time.perf_counter()
        report = dtypelab.bench(task, args.policies, device=args.device, steps=args.steps, profile=True,
                                budget=0)
        hw = report.environment["hardware"]
        print(f"\n== {task} on {hw['device_name']} ({hw['cpu_name']}; flags {' '.join(hw['cpu_flags'])}), "
              f"torch {report.environment['torch']}, {time.perf_counter() - started:.0f} s")
        base = report.result("fp32")
        for r in report.results:
            p = r.profile
            if p is None or p.error:
                print(f"{r.policy}: {r.status} {r.reason} {p.error if p else 'no profile'}")
                continue
            sp = speedup(r, base)
            phases = " ".join(f"{k} {p.share(p.phases.get(k, 0)):.0%}" for k in PHASES)
            cats = " ".join(f"{CATEGORY_LABELS[c]} {p.share(p.categories.get(c, 0)):.0%}" for c in CATEGORIES)
            gflops = p.matmul_flops / p.categories["matmul"] / 1e9 if p.categories.get("matmul") else 0
            util = f"{p.utilisation:.0%}" if p.utilisation is not None else "n/a"
            print(f"{r.policy:9s} speedup {sp:.2f}x | profiled step {p.step_s * 1e3:.3g} ms (profiler cost "
                  f"{p.overhead:+.0%}) | {phases} | {cats} | matmul {gflops:.3g} GFLOP/s = {util} of peak | {p.bound}")
        for sentence in recommend(report).sentences:
            if sentence.startswith(("Why:", "Use ", "Keep ")):
                print("•", sentence)


if __name__ == "__main__":
    main()
