"""A training script with the precision hazards `dtypelab lint` looks for (it is not meant to be run).

    dtypelab lint examples/unstable_training.py
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.cuda.amp import GradScaler


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1)
    weights = torch.exp(scores) / torch.exp(scores).sum(-1, keepdim=True)
    return weights @ v


def loss_fn(logits, target):
    return F.nll_loss(torch.log(F.softmax(logits, dim=-1)), target)


def regression_loss(pred, target):
    return F.mse_loss(pred.view(-1, 1), target.squeeze())  # (N, 1) against (N,): N² terms


class_weights = torch.from_numpy(np.linspace(0.5, 2.0, 10))  # float64: promotes whatever it multiplies


model = nn.Sequential(nn.Linear(16, 1), nn.Sigmoid()).half()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.BCELoss()
scaler = GradScaler()

for x, y in []:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = criterion(model(x), y)
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if loss == float("nan"):
        break
