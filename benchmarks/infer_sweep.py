"""Wall time of the default inference sweep, `dtypelab bench minilm --mode infer`, with a cold inductor cache,
and what the hardware probe says of the quantized kernels.

    python benchmarks/infer_sweep.py [--task minilm] [--runs 1]

Runs the real command line in a fresh process with its stderr redirected (so the plain progress lines are
what a log would show) and TORCHINDUCTOR_CACHE_DIR pointed at an empty folder (the compile of
int8-dyn-compile counts in full). Prints the wall time, each policy's status and time, and the probe's
int8 kernel twice: as it is, and with oneDNN switched off, which is the plain loop torch._int_mm runs on a
CPU without VNNI/AMX (the AVX2 EPYC this project also meets). Goal: <= 180 s wall on 2 cores.
Never run it beside another torch process: two of them on 2 cores slow each other 10-30x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from dtypelab.core.machine.hardware import _cpu_info, _kernel, _timed_gflops, probe


def kernel_figures() -> None:
    hw = probe("cpu")
    print(f"cpu: {hw.cpu_name}; flags {' '.join(hw.cpu_flags)}; torch {torch.__version__}")
    ref = hw.gflops["float32"]
    for key in ("float32", "bfloat16", "float16", "int8", "int8-fbgemm", "int8-weight-only", "fp8-weight-only"):
        if key in hw.gflops:
            print(f"  {key:17s} {hw.gflops[key]:8.1f} GFLOP/s  {hw.gflops[key] / ref:6.2f}x fp32")
    fn = _kernel("int8", torch.device("cpu"), 256, _cpu_info()[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.backends.mkldnn.flags(enabled=False):
            off = _timed_gflops(fn, 256, lambda: None, 0.3)
    print(f"  int8 with oneDNN off (the no-VNNI loop): {off:.1f} GFLOP/s, {off / ref:.3f}x fp32 "
          f"-> {'skipped as slow' if off < 0.1 * ref else 'runs'}")


def sweep(task: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out, log = os.path.join(tmp, "r.json"), os.path.join(tmp, "progress.log")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
        start = time.perf_counter()
        with open(log, "w") as err:
            subprocess.run([sys.executable, "-m", "dtypelab", "bench", task, "--mode", "infer", "--json", out],
                           check=True, stdout=subprocess.DEVNULL, stderr=err, env=env)
        wall = time.perf_counter() - start
        with open(out) as f:
            report = json.load(f)
        with open(log) as f:
            lines = f.read().splitlines()
    print(f"\n{task} --mode infer: {wall:.0f} s wall ({'meets' if wall <= 180 else 'misses'} the 180 s goal)")
    for r in report["results"]:
        t = sorted(r["step_times_s"][r["warmup"]:])
        med = f"{t[len(t) // 2] * 1e3:7.0f} ms x {len(r['step_times_s'])}" if t else " " * 16
        first = f", first call {r['first_call_s']:.1f} s" if r.get("info", {}).get("compiles") and r.get(
            "first_call_s") else ""
        print(f"  {r['policy']:19s} {r['status']:8s} {r['wall_s']:6.1f} s  {med}{first}  {r['reason'][:90]}")
    print(f"  progress log: {len(lines)} lines, e.g. {lines[0]!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="minilm")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    kernel_figures()
    for _ in range(args.runs):
        sweep(args.task)


if __name__ == "__main__":
    main()
