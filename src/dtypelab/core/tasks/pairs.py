"""An encoder fine-tuned to tell paraphrases from other sentences: each pair dtypelab ships (``data/paraphrases.tsv``)
as a positive, its first sentence beside the next pair's paraphrase as a negative, a new two-way head (``classifier``,
trained in full), held-out accuracy. ``minilm-ft`` is the pretrained MiniLM the ``minilm`` task ships, fine-tuned so,
offline; an encoder named ``hf:ORG/NAME`` or ``hf:PATH`` is too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.errors import TaskError
from dtypelab.core.task import Task
from dtypelab.core.tasks.hub import config_of, factory, has_weights, logits

PAIR_SEQ = 64
PAIR_EVAL_SHARE = 3  # every third pair is held out


def _pair_data(path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(train inputs, labels, held-out inputs, labels): each shipped pair as a positive, and its first sentence beside
    the next pair's paraphrase as a negative (the same topic often: not separable by words alone)."""
    from dtypelab.core.tasks.minilm import pairs

    if not (path / "tokenizer.json").is_file():
        raise TaskError(f"{path}: an encoder ({path.name}) is trained here on tokenized sentence pairs, so it needs "
                        "its tokenizer.json beside config.json (a config alone is enough for a causal language model)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_truncation(PAIR_SEQ)
    tok.enable_padding(length=PAIR_SEQ, pad_id=0, pad_token="[PAD]")
    p = pairs()
    rows = [(a, b, 1) for a, b in p] + [(a, p[(i + 1) % len(p)][1], 0) for i, (a, _) in enumerate(p)]
    held = [i for i in range(len(rows)) if (i % len(p)) % PAIR_EVAL_SHARE == 0]
    train = [i for i in range(len(rows)) if i not in set(held)]

    def encode(index: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        enc = tok.encode_batch([(rows[i][0], rows[i][1]) for i in index])
        inputs = {"input_ids": torch.tensor([e.ids for e in enc]),
                  "attention_mask": torch.tensor([e.attention_mask for e in enc]),
                  "token_type_ids": torch.tensor([e.type_ids for e in enc])}
        return inputs, torch.tensor([rows[i][2] for i in index])

    return (*encode(train), *encode(held))


def pairs_task(name: str, path: Path, config: Any, task_name: str | None = None) -> Task:
    """Fine-tuning an encoder (with a new two-way head, ``classifier``) to tell paraphrases from other sentences."""
    from transformers import AutoModelForSequenceClassification

    x, y, hx, hy = _pair_data(path)

    def train_batch(step: int, batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, len(y), (batch_size,), generator=g)
        return {k: v[idx] for k, v in x.items()}, y[idx]

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits(out).float(), target)

    def evaluate(predict: Any) -> dict[str, float]:
        scores = torch.cat([logits(predict({k: v[i:i + 32] for k, v in hx.items()})).float()
                            for i in range(0, len(hy), 32)])
        return {"accuracy": (scores.argmax(-1) == hy).float().mean().item(),
                "val_loss": F.cross_entropy(scores, hy).item()}

    make = factory(path, config, AutoModelForSequenceClassification, num_labels=2)

    def make_model() -> nn.Module:
        torch.manual_seed(0)  # the new head's initialization: the same for every policy
        return make()

    return Task(
        name=task_name or name, make_model=make_model, train_batch=train_batch, loss_fn=loss_fn, evaluate=evaluate,
        metric="accuracy", make_optimizer=lambda p: torch.optim.AdamW(p, lr=2e-4, weight_decay=0.0), steps=60,
        batch_size=16, infer_batch=lambda n: {k: v[:n] for k, v in hx.items()},
        description=f"{config.model_type} encoder from {path} fine-tuned with a new two-way head to tell paraphrases "
                    f"from other sentences ({len(y)} training pairs, {len(hy)} held out, {PAIR_SEQ} tokens); held-out "
                    "accuracy" + ("" if has_weights(path) else "; no weights there: its config's initialization"))


def make_minilm_finetune() -> Task:
    """``minilm-ft``: the pretrained MiniLM the ``minilm`` task ships, fine-tuned on the paraphrase pairs."""
    from dtypelab.core.tasks.minilm import model_dir

    path = model_dir()
    return pairs_task("minilm", path, config_of(path), task_name="minilm-ft")


__all__ = ["make_minilm_finetune", "pairs_task"]
