"""A training script: a small CNN on scikit-learn's digits, with a shuffling DataLoader, an LR scheduler, gradient
accumulation and gradient clipping. examples/plain/train_loop.py is it as written; examples/train_loop.py is the
same script with the 6 lines dtypelab needs (`dtypelab bench examples/train_loop.py -- --epochs 2`)."""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
torch.manual_seed(args.seed)

digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)
train = DataLoader(TensorDataset(x[:1500], y[:1500]), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                      nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3,
                                                total_steps=args.epochs * len(train) // args.accumulate + 1)

for _epoch in range(args.epochs):
    for i, (xb, yb) in enumerate(train):
        loss = F.cross_entropy(model(xb), yb) / args.accumulate
        loss.backward()
        if (i + 1) % args.accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

model.eval()
with torch.no_grad():
    accuracy = (model(x[1500:]).argmax(1) == y[1500:]).float().mean().item()
print(f"accuracy {accuracy:.6f}")
