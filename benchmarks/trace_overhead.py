"""Armed trace step time / plain step time, against torch.autograd.detect_anomaly, in one run.
Goal: armed <= 1.1x plain on digits and charlm, and faster than detect_anomaly.

Cycles through blocks of plain steps, guarded steps (dtypelab's Guard: loss and weight check every step,
checkpoints at the automatically chosen interval) and steps under detect_anomaly, all on one model, so
drift hits all three alike. Reports the medians and the ratios, plus the checkpoint interval and cost.

    python benchmarks/trace_overhead.py [--tasks digits,charlm] [--rounds 5] [--block 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from dtypelab.core.loop import train_step
from dtypelab.core.policies import Precision, get_policy
from dtypelab.core.task import load_task
from dtypelab.tracing.guard import Guard


def measure(task_name: str, rounds: int, block: int) -> dict[str, float]:
    task = load_task(task_name)
    torch.manual_seed(0)
    policy = Precision(get_policy("fp32"), "cpu")
    model = task.make_model().train()
    optimizer = task.make_optimizer(model.parameters())
    guard = Guard(model, optimizer)
    step = 0

    def one(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return train_step(task, model, policy, optimizer, inputs, target)

    def run(mode: str) -> list[float]:
        nonlocal step
        times = []
        for _ in range(block):
            batch = task.train_batch(step, task.batch_size)
            start = time.perf_counter()
            if mode == "plain":
                float(one(*batch).detach())  # every loop reads the loss; the guard's check includes this
            elif mode == "armed":
                guard.step(one, *batch)
            else:
                with torch.autograd.detect_anomaly(check_nan=True):
                    float(one(*batch).detach())
            times.append(time.perf_counter() - start)
            step += 1
        return times[1:]  # the first step of a block re-warms caches

    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    modes = ("plain", "armed", "anomaly")
    for m in modes:
        run(m)  # warm-up
    samples: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            samples[m] += run(m)
    med = {m: statistics.median(v) for m, v in samples.items()}
    return {**med, "every": guard.every, "checkpoint_ms": guard.checkpoint_s * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="digits,charlm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=20)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.tasks.split(","):
        m = measure(name, args.rounds, args.block)
        print(f"{name:8s} plain {m['plain'] * 1e3:7.2f} ms  armed {m['armed'] * 1e3:7.2f} ms "
              f"({m['armed'] / m['plain']:.3f}x)  detect_anomaly {m['anomaly'] * 1e3:7.2f} ms "
              f"({m['anomaly'] / m['plain']:.3f}x)  checkpoint every {m['every']} steps, "
              f"{m['checkpoint_ms']:.2f} ms each")


if __name__ == "__main__":
    main()
