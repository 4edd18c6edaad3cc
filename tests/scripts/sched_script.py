"""A training script for the script-mode tests, written the ways users write them: an LR scheduler built before or
after ``lab.setup`` (--order before / after), or chained schedulers with an EMA helper (--order chain); gradient
accumulation (--accumulate N, each micro-batch's loss divided by N); its own seed (--seed). It reports its final
accuracy, LR and the true loss of its last optimizer step (the mean of that step's micro-batch losses).

--slow-under NAME sleeps in each step under that policy; --nan-under NAME makes the loss NaN from step 3 under it;
--steps N stops after N optimizer steps."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dtypelab

parser = argparse.ArgumentParser()
parser.add_argument("--order", choices=("before", "after", "chain"), default="after")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--seed", type=int, default=7)
parser.add_argument("--steps", type=int, default=0)
parser.add_argument("--slow-under", default="")
parser.add_argument("--nan-under", default="")
args = parser.parse_args()

torch.manual_seed(args.seed)
lab = dtypelab.session()
x = torch.randn(512, 8)
y = (x.sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
total = len(loader) // args.accumulate
if args.order == "before":
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total + 1)
    model, optimizer = lab.setup(model, optimizer)
elif args.order == "after":
    model, optimizer = lab.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total + 1)
else:
    model, optimizer = lab.setup(model, optimizer)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[4])
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))

pending, last_loss, step = [], float("nan"), 0
for i, (xb, yb) in enumerate(loader):
    loss = F.cross_entropy(model(xb), yb)
    if lab.plan.name == args.nan_under and step >= 3:
        loss = loss * float("nan")
    pending.append(float(loss))
    lab.backward(loss / args.accumulate)
    if (i + 1) % args.accumulate == 0:
        if lab.plan.name == args.slow_under:
            time.sleep(0.25)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if args.order == "chain":
            ema.update_parameters(model)
        last_loss, pending, step = sum(pending) / len(pending), [], step + 1
        if step == args.steps:
            break

with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
lr = optimizer.param_groups[0]["lr"]
print(f"accuracy {accuracy:.6f} lr {lr:.6g} last_loss {last_loss:.6f}")
lab.finish(accuracy=accuracy, lr=lr, last_loss=last_loss)
