"""A training script for the script-mode tests. --crash-under NAME raises under that policy (--multiline-under NAME:
with a message of several lines); --keep-own-model ignores what lab.setup returns; --no-finish and
--no-session leave out the calls dtypelab needs; the first batch's sample indices are reported as a metric so
a test can check that every policy saw the same shuffle."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dtypelab

parser = argparse.ArgumentParser()
parser.add_argument("--crash-under", default="")
parser.add_argument("--no-finish", action="store_true")
parser.add_argument("--no-session", action="store_true")
parser.add_argument("--multiline-under", default="")  # raises an error whose message runs over several lines
parser.add_argument("--keep-own-model", action="store_true")  # ignores what lab.setup returns: nothing is timed
args = parser.parse_args()

if args.no_session:
    raise SystemExit(0)
lab = dtypelab.session()
x = torch.randn(256, 8)
y = (x.sum(1) > 0).long()
loader = DataLoader(TensorDataset(torch.arange(256), x, y), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.keep_own_model:
    lab.setup(model, optimizer)
else:
    model, optimizer = lab.setup(model, optimizer)
first = None
for idx, xb, yb in loader:
    first = float(idx.sum()) if first is None else first
    if lab.plan.name == args.crash_under:
        raise RuntimeError(f"planted failure under {args.crash_under}")
    if lab.plan.name == args.multiline_under:
        raise ValueError("the first line says what\nthe second line adds detail\n\nCheck the documentation to "
                         "learn more")
    loss = F.cross_entropy(model(xb), yb)
    lab.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
if not args.no_finish:
    lab.finish(accuracy=accuracy, first_batch=first)
