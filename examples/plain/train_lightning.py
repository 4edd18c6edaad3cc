"""A LightningModule and a Trainer: a small MLP on scikit-learn's digits, validation accuracy logged every epoch.
examples/plain/train_lightning.py is it as written; examples/train_lightning.py is the same with the lines
dtypelab needs (`dtypelab bench examples/train_lightning.py -- --epochs 2`; needs dtypelab[lightning])."""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-3)


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

pl.seed_everything(args.seed)
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
train = DataLoader(TensorDataset(x[:1500], y[:1500]), batch_size=32, shuffle=True)
val = DataLoader(TensorDataset(x[1500:], y[1500:]), batch_size=256)

trainer = pl.Trainer(max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False)
trainer.fit(Classifier(), train, val)
print(f"val_acc {trainer.callback_metrics['val_acc']:.6f}")
