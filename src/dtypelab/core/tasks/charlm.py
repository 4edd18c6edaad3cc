"""charlm: a tiny decoder-only transformer; character-level language model, held-out bits per char."""

from __future__ import annotations

import math
from importlib import resources

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.task import Task

SEQ = 64


def _corpus() -> str:
    text = resources.files("dtypelab.core.tasks").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return text.split("\n", 1)[1]  # drop the licence header line


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 128, heads: int = 4, layers: int = 2, seq: int = SEQ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.out(self.norm(self.blocks(self.tok(idx) + self.pos(pos))))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_task() -> Task:
    text = _corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]
    # Fixed, non-overlapping held-out windows: the same evaluation for every policy.
    starts = torch.arange(0, len(held) - SEQ - 1, SEQ)[:192]
    eval_x = torch.stack([held[s:s + SEQ] for s in starts])
    eval_y = torch.stack([held[s + 1:s + SEQ + 1] for s in starts])

    def train_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        s = torch.randint(0, len(train) - SEQ - 1, (batch_size,), generator=g)
        offs = s[:, None] + torch.arange(SEQ)
        return train[offs], train[offs + 1]

    def evaluate(predict) -> dict[str, float]:
        losses = [_loss(predict(eval_x[i:i + 64]), eval_y[i:i + 64]).item() * len(eval_x[i:i + 64])
                  for i in range(0, len(eval_x), 64)]
        nats = sum(losses) / len(eval_x)
        return {"bits_per_char": nats / math.log(2), "test_loss": nats}

    return Task(
        name="charlm", make_model=lambda: CharLM(len(chars)), train_batch=train_batch, loss_fn=_loss,
        evaluate=evaluate, metric="bits_per_char", higher_is_better=False,
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=4e-3, weight_decay=0.01),
        steps=300, batch_size=32, infer_batch=lambda n: eval_x[:n],
        description=f"2-layer transformer (d=128), {len(chars)}-char vocabulary, {len(text):,}-char "
                    "corpus of CPython docstrings; held-out bits per character",
    )
