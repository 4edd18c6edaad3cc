"""Models with planted NaN/Inf origins, for the trace tests. Each names where its origin is."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab import Task


class LogLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # PLANTED: log of a negative


class ExpLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)  # PLANTED: exp overflows float16 above 11.09


class Attention(nn.Module):
    """Hand-written attention with an optional causal −inf mask (intentional infinities)."""

    def __init__(self, dim: int, mask: bool = True, scale: float = 1.0) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mask, self.scale = mask, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x) * self.scale, self.k(x) * self.scale, self.v(x)
        scores = q @ k.transpose(-2, -1)  # PLANTED: overflows float16 when scale is large
        if self.mask:
            t = x.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
        return F.softmax(scores, dim=-1) @ v


class SafeNorm(nn.Module):
    """x / ‖x‖: fine forward, but the gradient of sqrt at an all-zero row is 0/0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.sqrt((x * x).sum(-1, keepdim=True))  # PLANTED: NaN in backward only
        return x / (norm + 1e-6)


class Net(nn.Module):
    def __init__(self, middle: nn.Module, dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, bias=False)
        self.body = nn.Sequential(nn.Linear(dim, dim), middle, nn.Linear(dim, dim))  # body.2 only propagates
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.inp(x)))


class SeqNet(nn.Module):
    def __init__(self, attn: Attention, dim: int = 8) -> None:
        super().__init__()
        self.attn, self.head = attn, nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x)).mean(1)


def batch(step: int, batch_size: int, dim: int = 8, seq: int | None = None, big: float = 1.0,
          zero_row_at: int | None = None, bad_step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shape = (batch_size, seq, dim) if seq else (batch_size, dim)
    x = torch.rand(shape, generator=g) * big
    if bad_step is not None and step == bad_step:
        x = x * 50.0  # only this batch drives the planted op out of range
    if zero_row_at is not None and step >= zero_row_at:
        x[0] = 0.0
    y = torch.randint(0, 2, (batch_size,), generator=g)
    return x, y


def task(name: str, model_fn, steps: int = 20, lr: float = 0.01, **batch_kw) -> Task:
    return Task(name=name, make_model=model_fn, train_batch=lambda s, b: batch(s, b, **batch_kw),
                loss_fn=F.cross_entropy, evaluate=lambda predict: {"accuracy": 0.0}, metric="accuracy",
                higher_is_better=True, steps=steps, batch_size=16,
                make_optimizer=lambda p: torch.optim.SGD(p, lr=lr))


class Shift(nn.Module):
    """Subtracts a constant so that log sees negatives only when the input is large."""

    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.middle = middle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.middle(5.0 - x.abs())


def log_task() -> Task:
    """log of a negative in body.1.middle at step 7 only (the batch of step 7 is 50x larger)."""
    return task("lognet", lambda: Net(Shift(LogLayer())), bad_step=7)


def exp_task() -> Task:
    """exp overflow in float16 at body.1 (inputs up to ~16), fine in float32 (a tiny learning rate keeps the
    huge activations from blowing the weights up)."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        net = Net(ExpLayer())
        with torch.no_grad():
            net.body[0].weight.fill_(1.0)
            net.body[0].bias.fill_(0.0)
            net.inp.weight.copy_(torch.eye(8) * 2)
        return net
    return task("expnet", make, lr=1e-12)


def attention_task(scale: float = 1.0, mask: bool = True) -> Task:
    return task("attn", lambda: SeqNet(Attention(8, mask=mask, scale=scale)), seq=6, big=30.0)


def norm_task() -> Task:
    """NaN created in backward only, in the backward of the sqrt in body.1, from step 3."""
    def make() -> nn.Module:
        net = Net(SafeNorm())
        net.body[0] = nn.Linear(8, 8, bias=False)  # an all-zero input row stays zero up to SafeNorm
        return net
    return task("normnet", make, zero_row_at=3)


class FullyMasked(nn.Module):
    """Masks every position of the first query row: softmax over an all −inf row is NaN."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[:, 0, :] = True
        return F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)  # PLANTED: fully masked row


class MaskNet(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj, self.attn, self.head = nn.Linear(dim, dim), FullyMasked(), nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.head(self.attn(h @ h.transpose(-2, -1)) @ h).mean(1)


def fully_masked_task() -> Task:
    return task("masked", MaskNet, seq=6)


class MaskStyles(nn.Module):
    """−inf masks written three other ways (where, full + triu, an additive SDPA mask): none is an error."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(dim, dim), nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        s = torch.where(causal, float("-inf"), h @ h.transpose(-2, -1))
        a = F.softmax(s, dim=-1) @ h
        additive = torch.full((t, t), float("-inf")).triu(1)
        b = F.softmax(h @ h.transpose(-2, -1) + additive, dim=-1) @ h
        c = F.scaled_dot_product_attention(h, h, h, attn_mask=additive)
        return self.head(a + b + c).mean(1)


def mask_styles_task() -> Task:
    return task("maskstyles", MaskStyles, seq=6)
