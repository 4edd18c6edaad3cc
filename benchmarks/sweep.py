"""Wall time of a full `dtypelab bench digits` sweep, and measured speedups vs fp32 on built-in tasks.

    python benchmarks/sweep.py [--tasks digits,charlm]

Runs the real command line (a fresh process, every applicable policy) and reads its JSON record.
Goal: the digits sweep in <= 60 s wall on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="digits,charlm")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            out = os.path.join(tmp, f"{task}.json")
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "dtypelab.cli", "bench", task, "--json", out],
                           check=True, capture_output=True)
            wall = time.perf_counter() - start
            with open(out) as f:
                report = json.load(f)
            by = {r["policy"]: r for r in report["results"]}

            def median(r):
                t = sorted(r["step_times_s"][r["warmup"]:])
                return t[len(t) // 2] if t else None

            base = median(by["fp32"])
            metric = report["config"]["metric"]
            print(f"{task}: full sweep {wall:.1f} s wall; fp32 step {base * 1e3:.2f} ms, "
                  f"{metric} {by['fp32']['metrics'][metric]:.4f}")
            for name, r in by.items():
                m = median(r)
                if m and name != "fp32":
                    print(f"  {name:9s} {base / m:5.2f}x vs fp32   {metric} {r['metrics'][metric]:.4f}")
                elif r["status"] == "skipped":
                    print(f"  {name:9s} skipped: {r['reason']}")


if __name__ == "__main__":
    main()
