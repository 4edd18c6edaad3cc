"""How much one training step's fastest time moves between fresh processes on this machine, with no forecast involved:
the float32 step a CPU forecast's --check measures, in N fresh interpreters, with glibc's malloc thresholds as they are
and fixed (so page faults from large allocations are ruled in or out).

    python benchmarks/step_spread.py [--task charlm] [--policy fp32] [--runs 3] [--steps 60]

Run it alone: another torch process on the same cores distorts every figure."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ONE = """
import statistics, sys, time, torch
from dtypelab.core.loop import build_model, build_trainable, to_device, train_step
from dtypelab.core.policies import Precision, get_policy
from dtypelab.core.task import load_task
task, dev = load_task(sys.argv[1]), torch.device("cpu")
precision = Precision(get_policy(sys.argv[2]), dev)
model, opt = build_trainable(task, precision, dev, model=build_model(task, 0), train=True)
times = []
with precision.session():
    for step in range(int(sys.argv[3])):
        x, y = to_device(task.batch(step, task.batch_size), dev)
        start = time.perf_counter()
        train_step(task, model, precision, opt, x, y)
        times.append(time.perf_counter() - start)
times = times[3:]
print(f"fastest {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms")
"""
FIXED = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="charlm")
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    hw = subprocess.run([sys.executable, "-m", "dtypelab", "hardware"], capture_output=True, text=True)
    print((hw.stdout.strip().splitlines() or ["?"])[0])
    for i in range(args.runs):
        for label, env in (("glibc as is", {}), ("thresholds fixed", FIXED)):
            out = subprocess.run([sys.executable, "-c", ONE, args.task, args.policy, str(args.steps)],
                                 capture_output=True, text=True, env={**os.environ, **env})
            print(f"process {i + 1}, {label}: {out.stdout.strip() or out.stderr.strip()[-300:]}")


if __name__ == "__main__":
    main()
