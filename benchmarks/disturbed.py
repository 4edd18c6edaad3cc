"""Does the recommendation survive a busy machine? `dtypelab bench TASK -p POLICIES` run N times alone and N times
with a CPU-bound process started when the interleaved timing begins.

    python benchmarks/disturbed.py [--task digits] [--policies fp32,fp64,amp-bf16] [--runs 5] [--burn 6]

The burner is a separate Python process spinning for --burn seconds and then ending by itself (it is also
killed when the run ends). Prints, per run, the decision (the policy recommended, or "fp32" for keep), each
policy's paired speedup with its interval, and the disturbance the run reported. Goal: every disturbed run
decides as the undisturbed ones do, and names the disturbance. Run it alone: nothing else may use the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from dtypelab import recommend
from dtypelab.core.records import load_report

BURN = "import sys, time\nt = time.time()\nwhile time.time() - t < float(sys.argv[1]): pass\n"


def one(task: str, policies: str, burn: float | None, out: str) -> tuple[str, float, str, list[str]]:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "dtypelab", "bench", task, "-p", policies, "--json", out]
    env = {**os.environ, "DTYPELAB_HEARTBEAT_S": "3600"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    burner = None
    for line in proc.stderr:
        if burn and burner is None and "interleaved rounds" in line:
            burner = subprocess.Popen([sys.executable, "-c", BURN, str(burn)])
    proc.wait()
    if burner is not None:
        burner.kill()
        burner.wait()
    wall = time.perf_counter() - start
    report = load_report(out)
    rec = recommend(report)
    speeds = [f"{r.policy} {r.speedup_ci.point:.2f}x ({r.speedup_ci.low:.2f}-{r.speedup_ci.high:.2f}, "
              f"{r.speedup_ci.dropped} dropped)" for r in report.results if r.speedup_ci]
    said = [s for s in rec.sentences if re.match(r"(Disturbance|Caution|Other processes|No recommendation)", s)]
    return rec.best or "undecided", wall, "; ".join(speeds), said


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits")
    ap.add_argument("--policies", default="fp32,fp64,amp-bf16")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--burn", type=float, default=6.0, help="seconds the background process spins")
    args = ap.parse_args()
    decisions: dict[str, list[str]] = {"alone": [], "disturbed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for kind, burn in (("alone", None), ("disturbed", args.burn)):
                best, wall, speeds, said = one(args.task, args.policies, burn, os.path.join(tmp, f"{kind}{i}.json"))
                decisions[kind].append(best)
                print(f"run {i + 1} {kind:9s} {wall:5.0f} s  decision: {best:10s} {speeds}")
                for s in said:
                    print(f"    {s[:200]}")
    same = sum(d == decisions["alone"][0] for d in decisions["disturbed"])
    print(json.dumps(decisions))
    print(f"disturbed runs deciding as the first undisturbed one: {same} of {args.runs}; undisturbed runs agreeing "
          f"among themselves: {len(set(decisions['alone'])) == 1}")


if __name__ == "__main__":
    main()
