"""gpt2: a GPT-2-small-shaped decoder (124M parameters: 12 layers, d=768, 12 heads, 1024 tokens, 50304-token
vocabulary, tied embeddings) trained on a generated corpus; held-out loss and perplexity.

Sized for one GPU: its matmuls are large enough that tensor-core formats pay. Where no CUDA GPU is present it runs
*reduced* (2 layers, d=64, 64 tokens, 512-token vocabulary) so that it can be tested on a CPU; the task's
description says which. ``DTYPELAB_GPT2_SIZE=full`` or ``reduced`` overrides the choice.

The corpus is generated, never downloaded: a seeded Markov chain in which each token has 16 successors drawn with
Zipf weights, and each sequence repeats one earlier span of itself (what induction heads learn). Fresh sequences
every step, so the model does not overfit a small file, and the loss has a known floor: the chain's entropy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.errors import TaskError
from dtypelab.core.task import Task
from dtypelab.core.tasks.charlm import Block

SUCCESSORS = 16  # per token: the chain's branching
EVAL_SEQUENCES = 64
HELD_OUT_SEED = 2**31 - 1  # a seed no training step uses


@dataclass(frozen=True)
class Size:
    name: str
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int
    steps: int
    lr: float

    @property
    def parameters(self) -> int:
        """Embeddings, per block 12·d² + 13·d (attention, MLP, biases, two norms), the last norm; the head is tied."""
        return self.vocab * self.dim + self.seq * self.dim + self.layers * (12 * self.dim**2 + 13 * self.dim) + \
            2 * self.dim


# GPT-2 small's shape; the vocabulary padded to a multiple of 64, as nanoGPT does, for the tensor cores.
FULL = Size("full", vocab=50304, dim=768, heads=12, layers=12, seq=1024, batch=16, steps=200, lr=3e-4)
REDUCED = Size("reduced", vocab=512, dim=64, heads=4, layers=2, seq=64, batch=16, steps=150, lr=3e-3)


def size_here() -> Size:
    """Full where CUDA is, reduced elsewhere; ``DTYPELAB_GPT2_SIZE`` (full / reduced) decides when set."""
    asked = os.environ.get("DTYPELAB_GPT2_SIZE", "").strip().lower()
    if asked and asked not in ("full", "reduced"):
        raise TaskError(f"DTYPELAB_GPT2_SIZE={asked!r}: use full or reduced")
    if asked:
        return FULL if asked == "full" else REDUCED
    return FULL if torch.cuda.is_available() else REDUCED


class GPT(nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.dim), nn.Embedding(s.seq, s.dim)
        self.blocks = nn.Sequential(*(Block(s.dim, s.heads) for _ in range(s.layers)))
        self.norm = nn.LayerNorm(s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's are
        for name, p in self.named_parameters():  # GPT-2's initialisation: N(0, 0.02), residual outputs scaled down
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * s.layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.norm(self.blocks(self.tok(idx) + self.pos(pos))))


class Chain:
    """The corpus's generator: sequences of ``seq + 1`` tokens over ``vocab`` tokens, deterministic in their seed."""

    def __init__(self, vocab: int, seq: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq = vocab, seq
        self.successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
        w = 1.0 / torch.arange(1, SUCCESSORS + 1, dtype=torch.float64)
        self.weights = (w / w.sum()).float()
        # the chain's entropy per token (nats), outside the repeated span: the loss no model can beat there
        self.entropy = float(-(self.weights * self.weights.log()).sum())

    def sample(self, n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        length = self.seq + 1
        choice = torch.multinomial(self.weights, n * length, replacement=True, generator=g).view(n, length)
        out = torch.empty(n, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
        for t in range(1, length):
            out[:, t] = self.successors[out[:, t - 1], choice[:, t]]
        # one span of each sequence repeats an earlier one: predictable only by looking back at it
        span = max(4, length // 8)
        src = torch.randint(0, length // 2 - span, (n,), generator=g)
        dst = torch.randint(length // 2, length - span, (n,), generator=g)
        rows = torch.arange(n)[:, None]
        out[rows, dst[:, None] + torch.arange(span)] = out[rows, src[:, None] + torch.arange(span)]
        return out


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def chain_task(name: str, vocab: int, seq: int, make_model: Callable[[], nn.Module],
               make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], steps: int, batch: int,
               shape: str, eval_chunk: int = 64) -> Task:
    """A language-model task on the generated corpus (``vocab`` tokens, ``seq``-token windows): fresh sequences
    every step, held-out loss and perplexity. ``shape`` says what the model is, for the description."""
    chain = Chain(vocab, seq)
    held = chain.sample(EVAL_SEQUENCES, seed=HELD_OUT_SEED)
    eval_x, eval_y = held[:, :-1], held[:, 1:]

    def train_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = chain.sample(batch_size, seed=step)
        return seqs[:, :-1], seqs[:, 1:]

    def evaluate(predict) -> dict[str, float]:
        nats = sum(_loss(predict(eval_x[i:i + eval_chunk]), eval_y[i:i + eval_chunk]).item()
                   * len(eval_x[i:i + eval_chunk]) for i in range(0, len(eval_x), eval_chunk)) / len(eval_x)
        return {"val_loss": nats, "perplexity": math.exp(min(nats, 50.0))}

    return Task(
        name=name, make_model=make_model, train_batch=train_batch, loss_fn=_loss, evaluate=evaluate,
        metric="val_loss", higher_is_better=False, make_optimizer=make_optimizer, steps=steps, batch_size=batch,
        infer_batch=lambda n: eval_x[:n],
        description=f"{shape}; generated corpus (a {SUCCESSORS}-successor Zipf Markov chain with one repeated span per "
                    f"sequence, entropy {chain.entropy:.2f} nats/token outside it); held-out loss and perplexity",
    )


def _gpt2(s: Size, name: str, where: str) -> Task:
    shape = (f"{s.layers}-layer decoder, d={s.dim}, {s.heads} heads, {s.seq} tokens, {s.vocab:,}-token vocabulary, "
             f"tied embeddings ({s.parameters / 1e6:.3g}M parameters); {where}")
    return chain_task(name, s.vocab, s.seq, lambda: GPT(s),
                      lambda p: torch.optim.AdamW(p, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1),
                      s.steps, s.batch, shape, eval_chunk=8 if s is FULL else 64)


def make_task() -> Task:
    s = size_here()
    return _gpt2(s, "gpt2", "GPT-2-small shape" if s is FULL else
                 "reduced for a machine without CUDA (the full GPT-2-small shape runs where CUDA is; "
                 "DTYPELAB_GPT2_SIZE=full forces it, and the task gpt2-full is always full)")


def make_full_task() -> Task:
    """The GPT-2-small shape wherever it runs (``gpt2-full``): for forecasts, and for a GPU."""
    return _gpt2(FULL, "gpt2-full", "GPT-2-small shape")
