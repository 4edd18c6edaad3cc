"""Will it fit, checked: the forecast against the same steps run for real, and how long a forecast takes where the
model could never run.

    python benchmarks/forecast.py [--part checked,far,fsdp] [--out DIR]

checked: for digits, charlm, gpt2 (reduced), the small Llama-style decoder, and minilm (inference), each policy's
    forecast peak (traced on fake tensors from one step) beside (a) the peak of three real steps on this CPU, every
    storage counted by the same ledger (exact tensor bytes), and (b) the process peak as ``bench`` measures it
    (peak RSS above the pre-build baseline: tensors plus the allocator's slack and the runtime's own memory), and
    for two policies a task (c) the same with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_=65536: freed large
    blocks go back to the system instead of staying in the heap), which leaves the tensors and the runtime.
far: ``dtypelab forecast gpt2-full --device H100`` and ``llama2-7b --device H100`` end to end (the default policies,
    the largest batch searched), timed as a user runs them; the 7B's parameters and its fp32 arithmetic.
fsdp: ``--nproc 2`` FSDP2 forecasts per rank beside two real ranks (torchrun, gloo) counted by the same ledger.

Run it alone: nothing else may use the CPU. Say which CPU (``dtypelab hardware``) with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dtypelab

ROOT = Path(__file__).resolve().parents[1]
STATE = "fp32,bf16,amp-bf16,bf16-sr,bf16-kahan,amp-bf16+adam8bit,bf16-sr+adam8bit"
CHECKED = {  # task -> (policies, batch size): batches large enough that tensors, not the runtime, fill the process
    "digits": (STATE, 1024),
    "charlm": (STATE, 64),
    "gpt2": (STATE, 64),
    "decoder": (STATE, 32),
    "minilm": ("fp32,bf16,int8-dyn,int8-wo,fp8-wo", 64),
}
GLIBC = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # a fixed threshold: glibc returns freed large blocks to the system


def fixed_threshold(task: str, policies: str, batch: int, out: Path) -> dict[str, int | None]:
    """The process peaks of ``policies`` with glibc's mmap threshold fixed (it must be set before the processes
    start: the command runs as a subprocess, and its workers inherit it)."""
    path = out / f"glibc-{task}.json"
    subprocess.run([sys.executable, "-m", "dtypelab", "forecast", task, "-p", policies, "--device", "cpu", "--check",
                    "--no-batch-search", "-b", str(batch), "--json", str(path)], capture_output=True, text=True,
                   env={**os.environ, **GLIBC})
    report = dtypelab.load_record(str(path))
    return {p.policy: p.check.process_peak_bytes for p in report.policies if p.check is not None}


def mb(n: int | None) -> str:
    return f"{n / 1e6:.2f}" if n is not None else "—"


def ratio(a: int | None, b: int | None) -> str:
    return f"{a / b:.3f}" if a and b else "—"


def checked(out: Path) -> None:
    print("## Forecast vs the same steps run here\n")
    print("| task | policy | forecast MB | measured MB (tensors) | forecast/measured | process peak MB | "
          "forecast/process | process peak, fixed mmap threshold | forecast/that |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = worst_fixed = 0.0
    for task, (policies, batch) in CHECKED.items():
        report = dtypelab.forecast(task, policies=policies, device="cpu", check=True, batch_search=False,
                                   batch_size=batch, json_path=str(out / f"checked-{task}.json"))
        two = policies.split(",")[0] + "," + policies.split(",")[-1]
        fixed = fixed_threshold(task, two, batch, out)
        for p in report.policies:
            if p.status != "ok" or p.check is None:
                print(f"| {task} | {p.policy} | {p.status}: {p.reason or '; '.join(p.notes)} | | | | | | |")
                continue
            fc = (p.train or p.infer).peak_bytes
            measured = p.check.train_peak_bytes if p.train else p.check.infer_peak_bytes
            worst = max(worst, abs(fc / measured - 1))
            if fixed.get(p.policy):
                worst_fixed = max(worst_fixed, abs(fc / fixed[p.policy] - 1))
            print(f"| {task} (batch {batch}) | {p.policy} | {mb(fc)} | {mb(measured)} | {ratio(fc, measured)} | "
                  f"{mb(p.check.process_peak_bytes)} | {ratio(fc, p.check.process_peak_bytes)} | "
                  f"{mb(fixed.get(p.policy))} | {ratio(fc, fixed.get(p.policy))} |")
    print(f"\nlargest forecast/measured deviation (tensor bytes): {worst:.2%}; against the process peak with a fixed "
          f"mmap threshold: {worst_fixed:.2%}\n")


def far(out: Path) -> None:
    print("## Where it cannot run: the whole command, timed\n")
    for task in ("gpt2-full", "llama2-7b"):
        path = out / f"far-{task}.json"
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "dtypelab", "forecast", task, "--device", "H100", "--json",
                              str(path)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
        wall = time.monotonic() - start
        if run.returncode:
            print(f"{task}: exit {run.returncode}: {run.stderr[-500:]}")
            continue
        report = dtypelab.load_record(str(path))
        print(f"- {task}: {len(report.policies)} policies in {wall:.1f} s (the record says {report.seconds:.1f} s); "
              f"{report.config.parameters:,} parameters; {report.answer}")
        fp32 = report.result("fp32").train
        if fp32 is not None:
            b = fp32.breakdown
            state = b["parameters"] + b["gradients"] + b["optimizer_state"]
            print(f"  fp32: weights {fp32.parameter_bytes:,} B ({fp32.parameter_bytes / report.config.parameters:g} "
                  f"per parameter); at the peak, weights + gradients (so far) + AdamW state "
                  f"{state / 1e9:.1f} GB ({state / report.config.parameters:.3f} B per parameter); "
                  f"peak {fp32.peak_bytes / 1e9:.1f} GB in the {fp32.phase}; "
                  f"fits: {report.result('fp32').train_fit.fits}")
    print()


RANK = r"""
import json, os, sys, torch, torch.distributed as dist
from dtypelab.core.task import load_task
from dtypelab.core.policies import get_policy
from dtypelab.distributed import wrap_fsdp
from dtypelab.forecasting.fake_step import Run, Target
task_name, policy, batch, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
task, plan = load_task(task_name), get_policy(policy)
torch.manual_seed(0)
model = task.make_model()
per = batch // world

def data(step):
    x, y = task.train_batch(step, batch)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]

run = Run(task, plan, model, Target("cpu"), fake=False,
          wrap=lambda m: wrap_fsdp(m, plan.distributed, torch.device("cpu")))
traced = run.train(data, per, steps=3)
# a file per rank: two ranks printing at once can interleave their lines on torchrun's stdout
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"rank": rank, "peak": traced.peak.total, "parameters": traced.parameter_bytes}, f)
dist.destroy_process_group()
"""


def fsdp(out: Path) -> None:
    print("## FSDP2 on 2 ranks: the forecast per rank vs real ranks (torchrun, gloo)\n")
    print("| task | policy | forecast per rank MB | rank 0 MB | rank 1 MB | forecast/largest rank |")
    print("|---|---|---|---|---|---|")
    script = out / "fsdp_rank.py"
    script.write_text(RANK)
    for task, batch in (("charlm", 32), ("gpt2", 16)):
        for policy in ("fp32+fsdp", "amp-bf16+fsdp", "fp32+fsdp-bf16-params-fp32-reduce"):
            report = dtypelab.forecast(task, policies=policy, nproc=2, batch_size=batch, device="cpu",
                                       batch_search=False)
            fc = report.result(policy).train.peak_bytes
            for old in out.glob("rank*.json"):
                old.unlink()
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "2", str(script), task, policy, str(batch), str(out)], capture_output=True,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
            if len(ranks) != 2:
                print(f"| {task} | {policy} | {mb(fc)} | failed: {run.stderr[-300:]} | | |")
                continue
            print(f"| {task} (batch {batch}) | {policy} | {mb(fc)} | {mb(ranks[0]['peak'])} | {mb(ranks[1]['peak'])} | "
                  f"{ratio(fc, max(r['peak'] for r in ranks))} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="checked,far,fsdp")
    parser.add_argument("--out", default="forecast-bench")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = {"checked": checked, "far": far, "fsdp": fsdp}
    for name in args.part.split(","):
        parts[name](out)


if __name__ == "__main__":
    main()
