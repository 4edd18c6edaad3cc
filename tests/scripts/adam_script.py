"""A training script with AdamW, written as nanoGPT writes its schedule: each step assigns a number to every
group's ``lr`` (torchao's optimizers keep it as a tensor), optionally with a torch LR scheduler made before
``lab.setup`` (--scheduler). Its layers are big enough for torchao's low-bit state (4096 elements and up). It
reports its accuracy and the learning rate its optimizer ended with (as the script reads it)."""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import dtypelab

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--scheduler", action="store_true")
args = parser.parse_args()

torch.manual_seed(3)
lab = dtypelab.session()
x = torch.randn(1024, 64)
y = (x[:, :32].sum(1) > x[:, 32:].sum(1)).long()
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.5) if args.scheduler else None
model, optimizer = lab.setup(model, optimizer)

for step in range(args.steps):
    if scheduler is None:  # nanoGPT: a cosine schedule, assigned by hand
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
    idx = torch.randint(0, 1024, (64,), generator=torch.Generator().manual_seed(step))
    loss = F.cross_entropy(model(x[idx]), y[idx])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()

with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
lr = float(optimizer.param_groups[0]["lr"])
print(f"accuracy {accuracy:.6f} lr {lr:.6g}")
lab.finish(accuracy=accuracy, lr=lr)
