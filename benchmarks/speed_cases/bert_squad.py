"""BERT fine-tuned on SQuAD v1.1 (question answering: a start and an end logit per token), at 384 tokens a sequence:
the shape of NVIDIA DeepLearningExamples' PyTorch BERT recipe (``run_squad.py``, ``max_seq_length`` 384), which both
its own README's tables and Lambda's GPU benchmark (lambdal/deeplearning-benchmark, which runs those scripts) time.
Built from the shape alone (Hugging Face's BERT with eager attention, as that recipe computes it: matmul, softmax,
matmul), for forecasts. The case file names the size: ``bert_squad.py:make_large`` or ``:make_base``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab import Task

SEQ = 384
VOCAB = 30522  # bert-base/large-uncased's WordPiece vocabulary


class QA(nn.Module):
    """BERT with SQuAD's head; the output is (batch, seq, 2): the start and end logits."""

    def __init__(self, layers: int, dim: int, heads: int) -> None:
        super().__init__()
        from transformers import BertConfig, BertForQuestionAnswering

        config = BertConfig(vocab_size=VOCAB, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=4 * dim, max_position_embeddings=512)
        config._attn_implementation = "eager"
        self.bert = BertForQuestionAnswering(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.bert(input_ids=ids)
        return torch.stack([out.start_logits, out.end_logits], dim=-1)


def _loss(logits: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """SQuAD's loss: the mean of the start's and the end's cross-entropy over the sequence's positions."""
    return (F.cross_entropy(logits[..., 0], spans[:, 0]) + F.cross_entropy(logits[..., 1], spans[:, 1])) / 2


def _task(name: str, layers: int, dim: int, heads: int) -> Task:
    def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, SEQ, (n, 2), generator=g)

    def evaluate(predict) -> dict[str, float]:  # forecasts never evaluate; a task must say how it would
        x, y = batch(0, 2)
        return {"val_loss": float(_loss(predict(x), y))}

    return Task(name=name, make_model=lambda: QA(layers, dim, heads), train_batch=batch, loss_fn=_loss,
                evaluate=evaluate, metric="val_loss", higher_is_better=False, batch_size=32, steps=10,
                make_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-5),
                description=f"{name} on SQuAD's shape ({SEQ} tokens), NVIDIA DeepLearningExamples' recipe")


def make_large() -> Task:
    return _task("bert-large-squad", 24, 1024, 16)


def make_base() -> Task:
    return _task("bert-base-squad", 12, 768, 12)
