"""An A/A check of the run-level rule for scripts (run by hand, alone: another torch process distorts timings).

A training script is benched under fp32 and under the very same policy by another name: nothing can truly be faster.
Each sweep reports what the old rule (a one-sided Mann-Whitney test over the two first runs' steps) would have said,
and what the run-level rule decided after its ABBA repeats. Any "faster" is a false positive.

    python benchmarks/run_level.py [--sweeps 4] [--script examples/train_loop.py] [-- script args]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import dtypelab
from dtypelab.core.machine.hardware import probe
from dtypelab.core.stats import unpaired_faster

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--script", default=os.path.join(ROOT, "examples", "train_loop.py"))
    ap.add_argument("script_args", nargs="*", default=["--epochs", "1"])
    args = ap.parse_args()
    hw = probe("cpu", budget_s=0.05)
    print(f"machine: {hw.device_name}; bf16 native: {hw.native('bfloat16')}; script: {args.script} "
          f"{' '.join(args.script_args)}")
    with tempfile.TemporaryDirectory() as tmp:
        same = os.path.join(tmp, "fp32-again.json")
        with open(same, "w") as f:
            json.dump({"name": "fp32-again", "default": "fp32"}, f)
        old_faster = new_faster = 0
        for i in range(args.sweeps):
            report = dtypelab.bench(args.script, f"fp32,{same}", runs=args.runs, script_args=tuple(args.script_args))
            base, again = report.result("fp32"), report.result("fp32-again")
            if base.status != "ok" or again.status != "ok":
                sys.exit(f"sweep {i + 1}: a run failed: {base.reason or again.reason}")
            old = unpaired_faster(base.step_times_s[base.warmup:], again.step_times_s[again.warmup:])
            new = report.recommendation.chosen == "fp32-again"
            old_faster += old
            new_faster += new
            ci = again.speedup_ci
            print(f"sweep {i + 1}: first runs' medians {base.timing.median * 1e3:.2f} vs "
                  f"{again.timing.median * 1e3:.2f} ms; old rule: {'faster' if old else 'not faster'}; runs each: "
                  f"{len(base.rounds) or 1}; run-level interval: "
                  f"{f'{ci.point:.3f}x ({ci.low:.3f}-{ci.high:.3f})' if ci else 'none (not a contender)'}; "
                  f"decision: {report.recommendation.decision.value} {report.recommendation.chosen}")
    print(f"false 'faster' verdicts over {args.sweeps} sweeps: old rule {old_faster}, run-level rule {new_faster}")


if __name__ == "__main__":
    main()
