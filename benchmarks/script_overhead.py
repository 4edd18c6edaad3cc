"""Harness cost per step in script mode: the same training step plain and through dtypelab.session().

    python benchmarks/script_overhead.py [--steps 400] [--policy fp32]

For a tiny MLP (where any per-step cost shows most) and the CNN of examples/train_loop.py, it times steps of a
plain loop (forward, loss, backward, optimizer step, zero_grad) and of the same loop through a driven session
(wrapped forward and step, the step timer, the loss record, the progress messages over the launcher's channel),
interleaved in blocks so drift hits both alike, and prints the median per-step times and their difference in
microseconds. The plain loop runs in fp32: under another --policy the difference includes that policy's own cost
(casts, autocast), not only the harness's. Never run it beside
another torch process: two of them on 2 cores slow each other 10-30x.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import dtypelab
from dtypelab.run.channel import Channel


def models() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    cnn = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10))
    return {"tiny MLP, batch 32": (mlp, torch.randn(32, 16), torch.randint(0, 4, (32,))),
            "examples/train_loop.py CNN, batch 32": (cnn, torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,)))}


def timed(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def compare(label: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, job: dict, steps: int,
            policy: str) -> None:
    plain_opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def plain_step() -> None:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()

    lab_model = copy.deepcopy(model)  # the same weights, wrapped by the session
    channel = Channel(job)  # the launcher's end, as the script launcher holds it
    os.environ.update(channel.env)
    lab = dtypelab.session()
    lab_opt = torch.optim.SGD(lab_model.parameters(), lr=1e-3)
    lab_model, lab_opt = lab.setup(lab_model, lab_opt)

    def lab_step() -> None:
        loss = F.cross_entropy(lab_model(x), y)
        lab.backward(loss)
        lab_opt.step()
        lab_opt.zero_grad()

    for _ in range(20):  # warm-up both
        plain_step()
        lab_step()
    plain, through = [], []
    for _ in range(10):  # interleaved blocks
        plain += timed(plain_step, steps // 10)
        through += timed(lab_step, steps // 10)
    lab.finish(accuracy=0.0)
    channel.close()
    for key in channel.env:
        del os.environ[key]
    p, t = statistics.median(plain), statistics.median(through)
    print(f"{label}: plain {p * 1e6:.1f} µs, through the session {t * 1e6:.1f} µs per step: "
          f"+{(t - p) * 1e6:.1f} µs ({(t / p - 1) * 100:+.1f}%) under {policy}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--policy", default="fp32")
    args = ap.parse_args()
    hw = dtypelab.probe(budget_s=0.02)
    print(f"{hw.cpu_name}; flags {' '.join(hw.cpu_flags)}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads")
    job = {"plan": dtypelab.get_policy(args.policy).to_dict(), "seed": 0, "device": "cpu"}
    for label, (model, x, y) in models().items():
        compare(label, model, x, y, job, args.steps, args.policy)


if __name__ == "__main__":
    main()
