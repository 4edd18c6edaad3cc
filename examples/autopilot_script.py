"""A plain training script whose inputs drift past fp16's range in one layer (autopilot_tasks.py's drift case, as a
script). Run on its own it trains with the autopilot on (the `--autopilot` flag); `dtypelab autopilot
examples/autopilot_script.py --force` drives it from outside, and `dtypelab bench examples/autopilot_script.py`
measures it like any script. `--case calm` keeps the scale at 1; `--case log-zero` takes log(relu(x)), a NaN no
wider format fixes; `--no-finish` never calls lab.finish (the record says there is no metric)."""

import argparse

import torch
import torch.nn.functional as F
from autopilot_tasks import STEPS, Drifting, LogOfZero, X, Y, drift_scale

import dtypelab

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=("drift", "calm", "log-zero"), default="drift")
parser.add_argument("--autopilot", default="", help="run on its own with the autopilot from this start (amp-fp16, …)")
parser.add_argument("--no-finish", action="store_true")
args = parser.parse_args()
torch.manual_seed(0)
lab = dtypelab.session(autopilot=args.autopilot or False)

scale = drift_scale if args.case == "drift" else (lambda step: 1.0)
model = LogOfZero() if args.case == "log-zero" else Drifting()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model, optimizer = lab.setup(model, optimizer)

for step in range(STEPS):
    idx = torch.randint(0, len(X), (32,), generator=torch.Generator().manual_seed(step))
    loss = F.cross_entropy(model(X[idx] * scale(step)), Y[idx])
    lab.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

model.eval()
with torch.no_grad():
    accuracy = (model(X * scale(STEPS - 1)).argmax(1) == Y).float().mean().item()
print(f"accuracy {accuracy:.4f}")
if not args.no_finish:
    lab.finish(accuracy=accuracy)
