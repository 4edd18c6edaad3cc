"""Harness overhead: `dtypelab bench` step time vs a minimal hand-written training loop, in one run.

    python benchmarks/overhead.py [--task digits] [--policies fp32,amp-bf16,bf16] [--rounds 5]
    python benchmarks/overhead.py --null     # the harness's own cost per step, with a near-empty model

Both run in fresh processes (dtypelab: its child; the hand loop: a subprocess of this script), and
they alternate round by round so that drift in machine speed hits both alike.
Goal: dtypelab's median step time within 3% of the hand loop's. Policies the hand loop does not implement
(tf32, quantized inference, per-module plans) are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time

import torch

from dtypelab import bench, get_policy, load_task, probe
from dtypelab.core.policies import Autocast, Cast


def hand_plan(name: str) -> tuple[torch.dtype, torch.dtype | None, bool]:
    """(parameter dtype, autocast dtype or None, GradScaler) of a policy the hand loop implements; SystemExit
    with the reason for any other (tf32, quantized inference, per-module plans): comparing them against a
    hand loop that silently ran fp32 would be a wrong figure."""
    plan = get_policy(name)
    config = plan.default
    if plan.rules or not isinstance(config, (Cast, Autocast)):
        raise SystemExit(f"overhead.py: the hand loop implements pure casts and autocast only, not {name} "
                         f"({plan.describe()})")
    if isinstance(config, Cast):
        return getattr(torch, config.dtype), None, False
    return torch.float32, getattr(torch, config.dtype), config.scaler


def hand_loop(task_name: str, policy: str, steps: int, warmup: int) -> float:
    """What a user would write: the same model, batches and optimizer, each step timed."""
    dtype, amp_dtype, scaled = hand_plan(policy)
    task = load_task(task_name)
    torch.manual_seed(0)
    model = task.make_model().to(dtype)
    opt = task.make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    times = []
    for step in range(steps):
        x, y = task.train_batch(step, task.batch_size)
        t0 = time.perf_counter()
        x = x.to(dtype) if x.is_floating_point() else x
        y = y.to(dtype) if y.is_floating_point() else y
        opt.zero_grad(set_to_none=True)
        amp = torch.autocast("cpu", dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with amp:
            loss = task.loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        times.append(time.perf_counter() - t0)
        loss.item()
    return statistics.median(times[warmup:])


def null_overhead(steps: int = 3000, rounds: int = 7) -> tuple[float, float, float]:
    """Per-step cost of dtypelab's loop itself, in seconds: its train loop vs the hand loop on a model
    so small that the step is almost all harness. Both in this process, alternating rounds."""
    import tempfile

    from torch import nn

    from dtypelab import Task
    from dtypelab.sweep.job import Job, run_job

    x, y = torch.randn(4, 1), torch.randn(4, 1)
    task = Task("null", lambda: nn.Linear(1, 1), lambda s, b: (x, y), nn.functional.mse_loss,
                lambda predict: {"m": 0.0}, "m", True, make_optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the harness is single-threaded Python; keep OpenMP out of it
    hand, tool = [], []
    with tempfile.TemporaryDirectory() as wd:
        job = Job("null", "fp32", "train", steps, 4, 100, 0, "cpu", wd)
        for _ in range(rounds):
            torch.manual_seed(0)
            model = task.make_model()
            opt = task.make_optimizer(model.parameters())
            times = []
            for step in range(steps):
                xb, yb = task.train_batch(step, 4)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = task.loss_fn(model(xb), yb)
                loss.backward()
                opt.step()
                times.append(time.perf_counter() - t0)
                loss.item()
            hand.append(statistics.median(times[100:]))
            tool.append(run_job(job, task=task).timing.median)
    torch.set_num_threads(threads)
    return statistics.median(tool) - statistics.median(hand), statistics.median(hand), statistics.median(tool)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits")
    ap.add_argument("--policies", default="fp32,amp-bf16,bf16")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hand", help=argparse.SUPPRESS)  # internal: run the hand loop for one policy
    ap.add_argument("--null", action="store_true", help="measure the harness's own per-step cost")
    args = ap.parse_args()
    if args.null:
        extra, hand, tool = null_overhead()
        print(f"null model: hand loop {hand * 1e6:.1f} us/step, dtypelab loop {tool * 1e6:.1f} us/step: "
              f"harness adds {extra * 1e6:+.1f} us per step")
        for task in ("digits", "charlm"):
            ms = hand_loop(task, "fp32", 100, 10)
            print(f"  = {100 * extra / ms:+.2f}% of a {task} fp32 step ({ms * 1e3:.2f} ms, hand loop)")
        return
    warmup = max(1, min(10, args.steps // 10))
    if args.hand:
        print(hand_loop(args.task, args.hand, args.steps, warmup))
        return
    policies = args.policies.split(",")
    for policy in policies:
        hand_plan(policy)  # refuse what the hand loop does not implement before measuring anything
    hw = probe("cpu")
    for policy in policies:
        hand, tool = [], []
        for _ in range(args.rounds):
            cmd = [sys.executable, __file__, "--hand", policy, "--task", args.task, "--steps", str(args.steps)]
            hand.append(float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
            rep = bench(args.task, [policy], steps=args.steps, hardware=hw)
            tool.append(rep.result(policy).timing.median)
        h, t = statistics.median(hand), statistics.median(tool)
        print(f"{args.task} {policy:9s} hand {h * 1e3:7.3f} ms  dtypelab {t * 1e3:7.3f} ms  "
              f"overhead {100 * (t / h - 1):+5.1f}%   rounds: hand {[round(x * 1e3, 2) for x in hand]} "
              f"dtypelab {[round(x * 1e3, 2) for x in tool]}", flush=True)


if __name__ == "__main__":
    main()
