"""MPT as llm-foundry trains it in its throughput tables (mosaicml/llm-foundry, scripts/train/benchmarking/README.md):
learned positional embeddings (no ALiBi: the tables' parameter counts grow by d·seq with the sequence), LayerNorm
without bias, one fused Wqkv projection, GELU MLP of 4·d, no biases, embeddings tied to the head, flash attention.
Built from the shape alone (scripts/train/yamls/pretrain/mpt-1b.yaml, mpt-3b.yaml), for forecasts; the case file names
a size and sequence (``mpt.py:make_3b_32k``); the micro batch is the forecast's ``-b``."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab import Task

VOCAB = 50368  # the gpt-neox-20b tokenizer, padded to a multiple of 64


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.norm_1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down_proj(F.gelu(self.up_proj(self.norm_2(x)), approximate="tanh"))


class MPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm_f = nn.LayerNorm(dim, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm_f(x), self.wte.weight)  # tied head


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def make(layers: int, dim: int, heads: int, seq: int, batch: int) -> Task:
    def train_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    def evaluate(predict) -> dict[str, float]:  # forecasts never evaluate; a task must say how it would
        x, y = train_batch(0, 1)
        return {"val_loss": float(_loss(predict(x), y))}

    return Task(name=f"mpt-{layers}x{dim}-{seq}", make_model=lambda: MPT(layers, dim, heads, seq),
                train_batch=train_batch, loss_fn=_loss, evaluate=evaluate, metric="val_loss", higher_is_better=False,
                batch_size=batch, steps=10,
                make_optimizer=lambda p: torch.optim.AdamW(p, lr=2e-4, betas=(0.9, 0.95), weight_decay=0.0),
                description=f"MPT-shaped decoder: {layers} layers, d={dim}, {heads} heads, {seq} tokens, "
                            f"{VOCAB:,}-token vocabulary, tied head (llm-foundry's throughput tables)")


MPT_1B, MPT_3B = (24, 2048, 16), (32, 2560, 20)  # layers, d_model, heads (d_head 128, as the yamls set it)
# each table row's shape, sequence and micro batch (the forecast's -b overrides the batch)
make_3b_32k = functools.partial(make, *MPT_3B, 32768, 3)
make_3b_8k = functools.partial(make, *MPT_3B, 8192, 3)
make_3b_512 = functools.partial(make, *MPT_3B, 512, 40)
make_1b_32k = functools.partial(make, *MPT_1B, 32768, 1)
make_1b_8k = functools.partial(make, *MPT_1B, 8192, 3)
make_1b_512 = functools.partial(make, *MPT_1B, 512, 56)
