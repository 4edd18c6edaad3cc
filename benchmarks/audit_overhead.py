"""Audited step time / plain step time for `dtypelab audit` (goal: <= 2.0x on digits and charlm).

Alternates blocks of plain steps (no hooks installed) and audited steps (every tensor measured against
fp16, bf16, fp8 e4m3 and e5m2) on one model, so drift hits both alike. Prints medians and their ratio.

    python benchmarks/audit_overhead.py [--tasks digits,charlm] [--rounds 5] [--block 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtypelab.audit import _install, _Recorder
from dtypelab.formats import AUDIT_FORMATS
from dtypelab.policies import policy_class
from dtypelab.rangestats import RangeCounter
from dtypelab.task import load_task
from dtypelab.worker import _train_step


def measure(task_name: str, rounds: int, block: int) -> tuple[float, float, int]:
    task = load_task(task_name)
    torch.manual_seed(0)
    policy = policy_class("fp32")("cpu")
    model = task.make_model().train()
    optimizer = task.make_optimizer(model.parameters())
    rec = _Recorder(RangeCounter(AUDIT_FORMATS))
    params = list(model.named_parameters())
    step = 0

    def run(audited: bool) -> list[float]:
        nonlocal step
        handles = _install(model, rec, None) if audited else []
        after = (lambda: [rec.record(n, "parameter", "param_grad", p.grad) for n, p in params]) if audited else None
        times = []
        for _ in range(block):
            rec.new_step(audited)
            inputs, target = task.train_batch(step, task.batch_size)
            start = time.perf_counter()
            _train_step(task, model, policy, optimizer, inputs, target, after_backward=after)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="digits,charlm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=10)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.tasks.split(","):
        plain, audited, tensors = measure(name, args.rounds, args.block)
        print(f"{name:10s} plain {plain * 1e3:7.2f} ms  audited {audited * 1e3:7.2f} ms  "
              f"ratio {audited / plain:.2f}x  ({tensors} tensor families)")


if __name__ == "__main__":
    main()
