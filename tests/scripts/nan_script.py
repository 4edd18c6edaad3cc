"""A training script whose loss goes non-finite: log of a softmax that underflows, at a learning rate that
sharpens the logits fast. For `dtypelab trace tests/scripts/nan_script.py`."""

import torch
import torch.nn.functional as F
from torch import nn

import dtypelab

lab = dtypelab.session()
x = torch.randn(64, 8) * 30
y = torch.randint(0, 4, (64,))
model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
model, optimizer = lab.setup(model, optimizer)
for _ in range(40):
    probs = torch.softmax(model(x), dim=-1)
    loss = F.nll_loss(torch.log(probs), y)  # log of a softmax: -inf once a probability underflows
    lab.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
lab.finish(loss=float(loss))
