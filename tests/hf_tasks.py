"""Task API gaps: a model that computes its own loss (Hugging Face style) and returns a ModelOutput, and an
inference-only task with no training fields."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput

import dtypelab

IDS = torch.randint(10, 100, (256, 16), generator=torch.Generator().manual_seed(0))
LABELS = (IDS == 7).any(1).long()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=2,
                                                    max_position_embeddings=32))


def batch(step: int, batch_size: int) -> dict[str, torch.Tensor]:
    idx = torch.randint(0, 256, (batch_size,), generator=torch.Generator().manual_seed(step))
    return {"input_ids": IDS[idx], "labels": LABELS[idx]}


def evaluate(predict) -> dict[str, float]:
    out = predict({"input_ids": IDS})
    assert isinstance(out, SequenceClassifierOutput) and out.logits.dtype == torch.float32
    return {"accuracy": (out.logits.argmax(-1) == LABELS).float().mean().item()}


def own_loss_task() -> dtypelab.Task:
    return dtypelab.Task(name="own-loss", make_model=model, train_batch=batch,
                         compute_loss=lambda m, b: m(**b).loss, evaluate=evaluate, metric="accuracy", steps=6,
                         batch_size=16)


def inference_task() -> dtypelab.Task:
    return dtypelab.InferenceTask("bert-infer", model, lambda n: {"input_ids": IDS[:n]}, evaluate, "accuracy",
                                  steps=4, batch_size=8)
