"""decoder: a Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, untied output
head, no biases) on gpt2's generated corpus. Two shapes:

- ``decoder``: 4 layers, d=128, small enough to train on two CPU cores (what the forecast is checked against);
- ``llama2-7b``: Llama-2-7B's shape (32 layers, d=4096, 32 heads, SwiGLU width 11008, 32,000-token vocabulary,
  4096 tokens): 6,738,415,616 parameters, as Meta's checkpoint has. Built from its shape alone, with no weights to
  download: for ``dtypelab forecast``, which builds it on the meta device. Training it needs about 100 GiB in
  float32 (16 bytes per parameter with AdamW), so ``bench`` runs it only where that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.task import Task
from dtypelab.core.tasks.gpt2 import chain_task


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int  # the SwiGLU width
    seq: int
    batch: int
    steps: int
    lr: float

    @property
    def parameters(self) -> int:
        """Embeddings and head (untied), per layer attention (q, o: d²; k, v: d·kv) + SwiGLU (3·d·hidden) + two norms,
        the final norm."""
        head_dim = self.dim // self.heads
        attention = 2 * self.dim**2 + 2 * self.dim * self.kv_heads * head_dim
        return 2 * self.vocab * self.dim + self.layers * (attention + 3 * self.dim * self.hidden + 2 * self.dim) \
            + self.dim


SMALL = Shape("decoder", vocab=512, dim=128, layers=4, heads=4, kv_heads=2, hidden=352, seq=64, batch=16, steps=150,
              lr=3e-3)
LLAMA2_7B = Shape("llama2-7b", vocab=32000, dim=4096, layers=32, heads=32, kv_heads=32, hidden=11008, seq=4096,
                  batch=1, steps=100, lr=3e-4)


def rotary(seq: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """cos and sin of the rotary angles, (2, seq, head_dim / 2): real buffers (a complex one would lose its imaginary
    part when a policy casts the model to bfloat16)."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.stack((angles.cos(), angles.sin()))


def rotate(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim), in pairs of adjacent features."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = turns[:, : x.shape[-2]].to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.dim // s.heads
        self.q = nn.Linear(s.dim, s.heads * self.head_dim, bias=False)
        self.k = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(s.heads * self.head_dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, turns), rotate(k, turns)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(s.dim, eps=1e-5), nn.RMSNorm(s.dim, eps=1e-5)
        self.attn = Attention(s)
        self.gate = nn.Linear(s.dim, s.hidden, bias=False)
        self.up = nn.Linear(s.dim, s.hidden, bias=False)
        self.down = nn.Linear(s.hidden, s.dim, bias=False)

    def forward(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), turns)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        self.register_buffer("turns", rotary(s.seq, s.dim // s.heads), persistent=False)
        for name, p in self.named_parameters():  # scaled normal init; residual outputs scaled down by depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * s.layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, self.turns)
        return self.head(self.norm(x))


def _task(s: Shape, where: str) -> Task:
    shape = (f"Llama-style decoder: {s.layers} layers, d={s.dim}, {s.heads} heads ({s.kv_heads} for keys and values), "
             f"SwiGLU {s.hidden}, {s.seq} tokens, {s.vocab:,}-token vocabulary, untied head "
             f"({s.parameters:,} parameters); {where}")
    return chain_task(s.name, s.vocab, s.seq, lambda: Decoder(s),
                      lambda p: torch.optim.AdamW(p, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1), s.steps, s.batch,
                      shape, eval_chunk=64 if s is SMALL else 1)


def make_task() -> Task:
    return _task(SMALL, "small enough to train on a CPU")


def make_llama2_7b() -> Task:
    return _task(LLAMA2_7B, "Llama-2-7B's shape, built from its shape alone (no weights): for forecasts; training it "
                            "needs about 100 GiB in float32")
