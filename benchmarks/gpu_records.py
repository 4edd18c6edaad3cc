"""The published GPU records: every run issue #29 asks for, on this machine's GPU, as raw JSON records under
``benchmarks/results/<gpu>/`` (committed; ``dtypelab show``/``report`` re-render them anywhere, CPU included).

    python benchmarks/gpu_records.py                 # every run not already recorded for this GPU
    python benchmarks/gpu_records.py --only train,infer --fresh
    python benchmarks/gpu_records.py --list          # what each run is, and whether its record exists

The runs (each the real command line in its own process, its output kept beside the record as ``NAME.log``):

- ``hardware``: the probe (TFLOP/s per dtype and kernel against the datasheet's peak);
- ``train``: the GPU training sweep on the gpt2 task (GPT-2-small shape): fp32, tf32, bf16, amp-bf16, amp-fp16,
  both float8 recipes, and the compiled float baselines;
- ``profile``: fp32, amp-bf16 and float8 tensorwise with ``--profile`` (where the step goes, MFU per policy);
- ``infer``: the default inference sweep on minilm (fp8 dynamic per row and per tensor, int4 weight-only included);
- ``tune-infer``, ``tune-train``: the per-layer search on gpt2;
- ``nproc1``: ``bench --nproc 1`` (torchrun, NCCL) on gpt2.

Needs a CUDA GPU (refused otherwise); nothing else may run on the GPU meanwhile. Each run is meant to take under
10 minutes on an H100, so that one can go per call where calls are time-limited (``--only train``); ``--steps N``
shortens the training runs where it does not.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TRAIN = "fp32,tf32,bf16,amp-bf16,amp-fp16,fp8-tensorwise,fp8-rowwise,fp32+compile,bf16+compile,amp-bf16+compile"
RUNS: dict[str, tuple[str, list[str]]] = {
    "hardware": ("the probe", ["hardware"]),
    "train": ("training sweep, gpt2", ["bench", "gpt2", "--policies", TRAIN]),
    "profile": ("--profile, gpt2", ["bench", "gpt2", "--policies", "fp32,amp-bf16,fp8-tensorwise", "--profile",
                                     "--rounds", "0"]),
    "infer": ("inference sweep, minilm", ["bench", "minilm", "--mode", "infer"]),
    "tune-infer": ("tune --mode infer, gpt2", ["tune", "gpt2", "--mode", "infer", "--candidates",
                                               "fp8-dyn-row,int8-wo,int4-wo", "--budget", "5m"]),
    "tune-train": ("tune --mode train, gpt2", ["tune", "gpt2", "--mode", "train", "--candidates", "amp-bf16",
                                               "--budget", "5m"]),
    "nproc1": ("bench --nproc 1 (NCCL), gpt2", ["bench", "gpt2", "--nproc", "1", "--policies", "fp32,amp-bf16"]),
}


def gpu_folder() -> str:
    """benchmarks/results/<the GPU's name, as a folder name>."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no-gpu"
    return os.path.join(OUT, re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower())


def run(name: str, folder: str, timeout_s: float, steps: int | None = None) -> int:
    what, args = RUNS[name]
    if steps and args[0] == "bench":
        args = [*args, "--steps", str(steps)]
    record, log = os.path.join(folder, f"{name}.json"), os.path.join(folder, f"{name}.log")
    cmd = ["dtypelab", *args, "--json", record]
    print(f"[{name}] {what}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env={**os.environ, "COLUMNS": "200"}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    kept = record if os.path.exists(record) else "(none)"
    print(f"[{name}] exit {rc} after {time.perf_counter() - start:.0f} s; record {kept}", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help=f"comma-separated runs of: {', '.join(RUNS)}")
    ap.add_argument("--fresh", action="store_true", help="run again even where a record exists")
    ap.add_argument("--list", action="store_true", help="list the runs and stop")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--steps", type=int, default=None, help="training/inference steps of the bench runs [task's]")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(RUNS)}")
    folder = gpu_folder()
    if args.list:
        for n in RUNS:
            done = os.path.exists(os.path.join(folder, f"{n}.json"))
            print(f"{n:11s} {'recorded' if done else 'missing ':8s}  {RUNS[n][0]}")
        return 0
    if not torch.cuda.is_available():
        sys.exit("gpu_records: no CUDA GPU here; these records are measured on a GPU (the CPU ones are in docs/)")
    os.makedirs(folder, exist_ok=True)
    failed = []
    for n in names:
        if not args.fresh and os.path.exists(os.path.join(folder, f"{n}.json")):
            print(f"[{n}] recorded already (--fresh runs it again)")
            continue
        if run(n, folder, args.timeout, args.steps) != 0:
            failed.append(n)
    print(f"records in {folder}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
