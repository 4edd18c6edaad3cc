"""Does the recommendation survive a busy machine? `dtypelab bench TASK -p POLICIES` run N times alone and N times
with a CPU-bound process beside it.

    python benchmarks/disturbed.py [--task digits] [--policies fp32,fp64,amp-bf16] [--runs 5] [--burn 6]
    python benchmarks/disturbed.py --task examples/train_loop.py --args="--epochs 1" --policies all --hog bursty

--hog rounds (the default): a separate Python process spins for --burn seconds once the interleaved timing begins,
then ends by itself. --hog bursty: a torch process multiplies matrices on every core for 3 s, rests 2 s, and so on
from the start of the run to its end (another user's training job, as outside testers saw it). --policies all: the
default sweep. Either hog is killed when the run ends. Prints, per run, the decision (the policy recommended, or
"fp32" for keep), each policy's paired speedup with its interval, the wall time of each policy, and the
disturbance the run reported. Goal: every disturbed run decides as the undisturbed ones do, and names the
disturbance. Run it alone: nothing else may use the CPU.
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
BURSTY = ("import time, torch\na = torch.randn(1024, 1024)\nwhile True:\n    t = time.time()\n"
          "    while time.time() - t < 3: a @ a\n    time.sleep(2)\n")


def one(task: str, policies: str, burn: float | None, out: str, hog: str = "rounds",
        script_args: str = "") -> tuple[str, float, str, list[str]]:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "dtypelab", "bench", task, "--json", out]
    cmd += [] if policies == "all" else ["-p", policies]
    cmd += ["--", *script_args.split()] if script_args else []
    env = {**os.environ, "DTYPELAB_HEARTBEAT_S": "3600"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    burner = None
    if burn and hog == "bursty":
        burner = subprocess.Popen([sys.executable, "-c", BURSTY])
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
    walls = ", ".join(f"{r.policy} {r.wall_s:.0f} s" + ("" if r.status == "ok" else f" ({r.status})")
                      for r in report.results if r.status != "skipped")
    speeds = f"{'; '.join(speeds)}\n    per policy: {walls}"
    said = [s for s in rec.sentences if re.match(r"(Disturbance|Caution|Other processes|No recommendation)", s)]
    return rec.best or "undecided", wall, speeds, said


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits")
    ap.add_argument("--policies", default="fp32,fp64,amp-bf16")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--burn", type=float, default=6.0, help="seconds the background process spins (--hog rounds)")
    ap.add_argument("--hog", choices=("rounds", "bursty"), default="rounds")
    ap.add_argument("--args", default="", help="the script's own arguments, when --task is a script")
    args = ap.parse_args()
    decisions: dict[str, list[str]] = {"alone": [], "disturbed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for kind, burn in (("alone", None), ("disturbed", args.burn)):
                best, wall, speeds, said = one(args.task, args.policies, burn, os.path.join(tmp, f"{kind}{i}.json"),
                                            args.hog, args.args)
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
