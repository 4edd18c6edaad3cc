"""checkerboard: learn a checkerboard image from pixel coordinates with a 1×1-convolution network.

Every pixel is an independent sample (a 1×1 conv is a per-pixel MLP); a batch is a random set of
pixels laid out as a 1-pixel-high image so the model stays a plain Conv2d/BatchNorm2d stack.
"""

from __future__ import annotations

import torch
from torch import nn

from dtypelab.core.task import Task

SIZE, SQUARES = 64, 4  # a 64×64 image of 4×4 squares


def coords_and_board(size: int = SIZE, squares: int = SQUARES) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinates in [0, 1) of shape (2, size, size) and the 0/1 board of shape (1, size, size)."""
    r = torch.arange(size) / size
    ys, xs = torch.meshgrid(r, r, indexing="ij")
    board = ((xs * squares).floor() + (ys * squares).floor()) % 2
    return torch.stack([xs, ys]), board.unsqueeze(0)


def make_model(width: int = 128) -> nn.Module:
    layers: list[nn.Module] = []
    ch = 2
    for _ in range(3):
        layers += [nn.Conv2d(ch, width, 1), nn.BatchNorm2d(width), nn.ReLU()]
        ch = width
    return nn.Sequential(*layers, nn.Conv2d(width, 1, 1))


def make_task() -> Task:
    coords, board = coords_and_board()
    pix_x, pix_y = coords.reshape(2, -1), board.reshape(1, -1)

    def train_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, pix_x.shape[1], (batch_size,), generator=torch.Generator().manual_seed(step))
        return pix_x[:, idx].reshape(1, 2, 1, -1), pix_y[:, idx].reshape(1, 1, 1, -1)

    def evaluate(predict) -> dict[str, float]:
        out = predict(coords.unsqueeze(0))  # the whole image at once
        return {"pixel_accuracy": ((out > 0.5).float() == board).float().mean().item(),
                "mse": nn.functional.mse_loss(out, board.unsqueeze(0)).item()}

    return Task(
        name="checkerboard", make_model=make_model, train_batch=train_batch, loss_fn=nn.functional.mse_loss,
        evaluate=evaluate, metric="pixel_accuracy", higher_is_better=True,
        make_optimizer=lambda p: torch.optim.Adam(p, lr=3e-3), steps=400, batch_size=1024,
        infer_batch=lambda n: coords.unsqueeze(0),
        description=f"{SIZE}×{SIZE} checkerboard of {SQUARES}×{SQUARES} squares from pixel coordinates; "
                    "1×1-conv net with BatchNorm; pixel accuracy of the full image",
    )
