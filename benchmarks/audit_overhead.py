"""Audited step time / plain step time for `dtypelab audit` (goal: <= 2.0x on digits and charlm).

Alternates blocks of plain steps (no hooks installed) and audited steps (every tensor measured against
fp16, bf16, fp8 e4m3 and e5m2) on one model, so drift hits both alike. Prints medians and their ratio.

    python benchmarks/audit_overhead.py [--tasks digits,charlm] [--rounds 5] [--block 10] [--micro]

--micro also times RangeCounter on single tensors against the obvious alternative: cast to each format
and count inf / zero / subnormal results (four casts and a dozen reductions per tensor).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtypelab.core.loop import train_step
from dtypelab.core.policies import Precision, get_policy
from dtypelab.core.task import load_task
from dtypelab.numerics import AUDIT_FORMATS, Recorder, install_hooks
from dtypelab.numerics.rangestats import RangeCounter


def measure(task_name: str, rounds: int, block: int) -> tuple[float, float, int]:
    task = load_task(task_name)
    torch.manual_seed(0)
    policy = Precision(get_policy("fp32"), "cpu")
    model = task.make_model().train()
    optimizer = task.make_optimizer(model.parameters())
    rec = Recorder(RangeCounter(AUDIT_FORMATS))
    params = list(model.named_parameters())
    step = 0

    def run(audited: bool) -> list[float]:
        nonlocal step
        handles = install_hooks(model, rec, None) if audited else []
        after = (lambda: [rec.record(n, "parameter", "param_grad", p.grad) for n, p in params]) if audited else None
        times = []
        for _ in range(block):
            rec.new_step(audited)
            inputs, target = task.train_batch(step, task.batch_size)
            start = time.perf_counter()
            train_step(task, model, policy, optimizer, inputs, target, after_backward=after)
            times.append(time.perf_counter() - start)
            step += 1
        for h in handles:
            h.remove()
        return times[1:]  # the first step of a block re-warms caches

    run(False), run(True)  # warm-up
    plain, audited = [], []
    for _ in range(rounds):
        plain += run(False)
        audited += run(True)
    return statistics.median(plain), statistics.median(audited), len(rec.entries)


def naive(x: torch.Tensor) -> list[int]:
    out = []
    for name in AUDIT_FORMATS:
        y = x.to(getattr(torch, name)).float()
        tiny = torch.finfo(getattr(torch, name)).smallest_normal
        out += [int((~torch.isfinite(y)).sum()), int(((y == 0) & (x != 0)).sum()),
                int(((y != 0) & (y.abs() < tiny)).sum())]
    return out


def micro() -> None:
    counter = RangeCounter(AUDIT_FORMATS)
    for n in (4096, 65536, 1 << 20):
        x = torch.randn(n) * 1e-4
        for label, fn in (("RangeCounter", lambda x=x: counter(x)), ("cast and count", lambda x=x: naive(x))):
            fn()
            reps = max(5, 2_000_000 // n)
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            print(f"  {n:>9,} values  {label:15s} {(time.perf_counter() - start) / reps * 1e6:9.0f} µs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="digits,charlm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--micro", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.micro:
        micro()
    for name in args.tasks.split(","):
        plain, audited, tensors = measure(name, args.rounds, args.block)
        print(f"{name:10s} plain {plain * 1e3:7.2f} ms  audited {audited * 1e3:7.2f} ms  "
              f"ratio {audited / plain:.2f}x  ({tensors} tensor families)")


if __name__ == "__main__":
    main()
