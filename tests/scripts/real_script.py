"""A training script written the way public projects write theirs, for the tests that run it alone and under
dtypelab: it must behave the same both ways. Every pattern checks itself (an ``assert``), so a pattern that breaks
under dtypelab crashes the script.

- ``--optimizer adamw|lbfgs|none|two``: AdamW; LBFGS with ``step(closure)`` (pytorch/examples
  time_sequence_prediction); no optimizer, weights updated by hand with ``p.data.add_`` (word_language_model's
  default); two optimizers, one per half of the model.
- ``--save PATH``: ``torch.save(model, f)`` at the end of each epoch and ``torch.load(f)`` with ``weights_only=True``
  and ``safe_globals`` (word_language_model), the loaded model evaluated.
- ``--ema``: a timm-style EMA made with ``copy.deepcopy(model)`` after setup; its zeroed copy must output zeros.
- ``--compile``: ``torch.compile(model)`` after setup.
- ``--dtype float32|bfloat16|float16``: nanoGPT's own precision handling: ``ctx = torch.autocast(..., dtype)`` around
  the forward and ``GradScaler(enabled=(dtype == 'float16'))`` with ``scale / unscale_ / step / update``;
  ``--scaler-to-setup`` hands that scaler to ``lab.setup``.
- ``--no-lab``: the same script without dtypelab at all (the plain reference).
"""

import argparse
import contextlib
import copy
import io
import os
import pickle

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", choices=("adamw", "lbfgs", "none", "two"), default="adamw")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save", default="")
parser.add_argument("--ema", action="store_true")
parser.add_argument("--compile", action="store_true")
parser.add_argument("--dtype", default="float32")
parser.add_argument("--scaler-to-setup", action="store_true")
parser.add_argument("--no-lab", action="store_true")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 2)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale

    def predict(self, x: torch.Tensor) -> torch.Tensor:  # a method of the user's own that calls self(...)
        return self(x).argmax(1)


torch.manual_seed(3)
x = torch.randn(256, 8)
y = (x[:, 0] * x[:, 1] > 0).long()
model = Net()
keys = list(model.state_dict())
hooked: list[int] = []


def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
    hooked.append(1)


model.head.register_forward_hook(hook)  # a hook registered before setup

if args.optimizer == "adamw":
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
elif args.optimizer == "lbfgs":
    optimizers = [torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)]
elif args.optimizer == "two":
    optimizers = [torch.optim.SGD(model.body.parameters(), lr=0.1), torch.optim.Adam(model.head.parameters(), lr=1e-2)]
else:
    optimizers = []
scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], 5) if args.optimizer in ("adamw", "two") else None
scaler = torch.amp.GradScaler("cpu", enabled=(args.dtype == "float16"))
ctx = (torch.autocast("cpu", dtype=getattr(torch, args.dtype)) if args.dtype != "float32"
       else contextlib.nullcontext())

if args.no_lab:
    lab = None
else:
    import dtypelab

    lab = dtypelab.session()
    extra = [scaler] if args.scaler_to_setup else []
    if optimizers or extra:
        model, *objs = lab.setup(model, *optimizers, *extra)
    else:
        model, objs = lab.setup(model), []
    optimizers = objs[:len(optimizers)]
    scaler = objs[-1] if args.scaler_to_setup else scaler

assert list(model.state_dict()) == keys, list(model.state_dict())  # state_dict keys unchanged
assert isinstance(model, Net) and isinstance(model.head, nn.Linear) and model.scale == 1.0
assert [n for n, _ in model.named_parameters()] == [n for n, _ in Net().named_parameters()]
for opt in optimizers:
    assert isinstance(opt, torch.optim.Optimizer)
if args.compile:
    model = torch.compile(model)
ema = copy.deepcopy(model) if args.ema else None

lr = 0.5
for _epoch in range(args.epochs):
    model.train()
    for i in range(args.steps):
        xb, yb = x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]
        if args.optimizer == "lbfgs":
            def closure(xb=xb, yb=yb):
                optimizers[0].zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                return loss
            optimizers[0].step(closure)
            continue
        for opt in optimizers:
            opt.zero_grad()
        model.zero_grad()
        with ctx:
            loss = F.cross_entropy(model(xb), yb)
        if lab is not None and args.dtype == "float32":
            lab.backward(loss)
        else:
            scaler.scale(loss).backward()
        if optimizers:
            for opt in optimizers:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in optimizers:
                scaler.step(opt)
            scaler.update()
            if scheduler is not None:
                scheduler.step()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        if ema is not None:
            with torch.no_grad():
                for e, m in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
                    e.copy_(0.9 * e + 0.1 * m)
    model.eval()
    with torch.no_grad():
        val = F.cross_entropy(model(x[200:]), y[200:]).item()
    if args.save:
        with open(args.save, "wb") as f:
            torch.save(model, f)
        allowed = [Net, nn.Linear, nn.Sequential, nn.Tanh, hook]
        with open(args.save, "rb") as f, torch.serialization.safe_globals(allowed):
            loaded = torch.load(f)
        assert type(loaded) is Net, type(loaded)
        with torch.no_grad():  # the loaded model runs as plain PyTorch (word_language_model tests with it)
            assert torch.isfinite(loaded(x[200:])).all()
        pickle.loads(pickle.dumps(model))

assert hooked  # the hook registered before setup ran
if ema is not None:  # the copy computes with its own weights
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
        assert float(ema(x[:4]).abs().max()) == 0.0, "the EMA copy computed with the live model's weights"
        assert float(model(x[:4]).abs().max()) > 0.0
buf = io.BytesIO()
torch.save(model.state_dict(), buf)
with torch.no_grad():
    accuracy = (model.predict(x[200:]) == y[200:]).float().mean().item()
print(f"val_loss {val:.6f} accuracy {accuracy:.6f}")
if lab is not None:
    lab.finish(val_loss=val)
if args.save and os.path.exists(args.save):
    os.remove(args.save)
