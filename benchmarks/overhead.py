"""Harness overhead: `dtypelab bench` step time vs a minimal hand-written training loop, in one run.

    python benchmarks/overhead.py [--task digits] [--policies fp32,amp-bf16] [--steps 300] [--rounds 3]

The hand loop and dtypelab's isolated child alternate (round-robin) so that machine drift hits both.
Goal: dtypelab's median step time within 3% of the hand loop's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from dtypelab import bench, load_task, probe
from dtypelab.policies import policy_class


def hand_loop(task_name: str, policy: str, steps: int, warmup: int) -> float:
    """What a user would write: the same model, batches and optimizer, timed per step."""
    task = load_task(task_name)
    torch.manual_seed(0)
    model = task.make_model()
    ctx = contextlib.nullcontext
    if policy == "bf16":
        model = model.to(torch.bfloat16)
    opt = task.make_optimizer(model.parameters())
    times = []
    for step in range(steps):
        x, y = task.train_batch(step, task.batch_size)
        t0 = time.perf_counter()
        if policy == "bf16":
            x = x.to(torch.bfloat16) if x.is_floating_point() else x
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if policy == "amp-bf16" else ctx():
            loss = task.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        loss.item()
    return statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits")
    ap.add_argument("--policies", default="fp32,amp-bf16,bf16")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    hw = probe("cpu")
    warmup = max(1, min(10, args.steps // 10))
    for policy in args.policies.split(","):
        policy_class(policy)
        hand, tool = [], []
        for _ in range(args.rounds):
            hand.append(hand_loop(args.task, policy, args.steps, warmup))
            rep = bench(args.task, [policy], steps=args.steps, hardware=hw)
            tool.append(rep.result(policy).timing.median)
        h, t = statistics.median(hand), statistics.median(tool)
        print(f"{args.task} {policy:9s} hand {h * 1e3:7.3f} ms  dtypelab {t * 1e3:7.3f} ms  "
              f"overhead {100 * (t / h - 1):+5.1f}%  (medians of {args.rounds} rounds; "
              f"rounds hand {[round(x * 1e3, 2) for x in hand]} dtypelab {[round(x * 1e3, 2) for x in tool]})")


if __name__ == "__main__":
    main()
