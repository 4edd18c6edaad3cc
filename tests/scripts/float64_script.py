"""pytorch/examples' time_sequence_prediction in miniature: the model is built in float64 (``.double()``), its LSTM
states are made inside ``forward`` with ``dtype=torch.double``, and LBFGS steps it with a closure. Run alone it
trains in float64; under a policy that changes the model's dtype, those states meet weights of another dtype."""

import math

import torch
from torch import nn

import dtypelab


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTMCell(1, 12)
        self.linear = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.size(0), 12, dtype=torch.double)
        c = torch.zeros(x.size(0), 12, dtype=torch.double)
        outputs = []
        for x_t in x.split(1, dim=1):
            h, c = self.lstm(x_t, (h, c))
            outputs.append(self.linear(h))
        return torch.cat(outputs, dim=1)


torch.manual_seed(0)
t = torch.arange(40, dtype=torch.float64)
phase = torch.rand(16, 1, dtype=torch.float64) * 2 * math.pi
data = torch.sin(t / 4 + phase)
x, y = data[4:, :-1], data[4:, 1:]
seq = Sequence().double()
optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.5, max_iter=4)
lab = dtypelab.session()
seq, optimizer = lab.setup(seq, optimizer)
criterion = nn.MSELoss()
for _ in range(3):
    def closure():
        optimizer.zero_grad()
        loss = criterion(seq(x), y)
        loss.backward()
        return loss
    optimizer.step(closure)
with torch.no_grad():
    test_loss = criterion(seq(data[:4, :-1]), data[:4, 1:]).item()
print(f"test loss {test_loss:.6g}")
lab.finish(test_loss=test_loss)
