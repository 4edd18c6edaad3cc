"""``hf:ORG/NAME`` or ``hf:PATH``: a Hugging Face model as a task (found and built by ``hub``).

- A causal language model (``*ForCausalLM``): sequences of ``seq`` tokens (``hf:PATH#seq=N``, what ``--seq-len``
  writes; default 512, at most the model's context) from gpt2's generated corpus over the model's vocabulary, the
  model's own causal-LM loss (``labels=input_ids``), held-out loss and perplexity. Its decoder layers are a stack of
  identical blocks (``Task.with_blocks``): a forecast traces three and four of them.
- An encoder (BERT-like): fine-tuned on sentence pairs (``pairs``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.backends import quiet
from dtypelab.core.errors import TaskError
from dtypelab.core.policies.loss import HeadInputs, language_model
from dtypelab.core.task import Task
from dtypelab.core.tasks.gpt2 import EVAL_SEQUENCES, HELD_OUT_SEED, Chain
from dtypelab.core.tasks.hub import (
    DEFAULT_SEQ,
    at_depth,
    causal,
    config_of,
    factory,
    has_weights,
    hushed,
    locate,
    logits,
    split_spec,
)
from dtypelab.core.tasks.pairs import pairs_task


def make_task(spec: str) -> Task:
    """The task for ``hf:WHERE[#seq=N]``."""
    where, seq = split_spec(spec)
    path = locate(where)
    config = config_of(path)
    name = (path.name if where.endswith("config.json") else where.rstrip("/").rpartition("/")[2]) or where
    if causal(config):
        return _causal_task(name, path, config, seq)
    not_text = _not_a_text_encoder(config)
    if not_text:
        raise TaskError(f"hf:{where}: {not_text}; hf: tasks are causal language models and text encoders (BERT-like, "
                        "fine-tuned on sentence pairs): write a task of your own for it (docs: Tasks)")
    if seq is not None:
        raise TaskError(f"--seq-len: {where} is not a causal language model (its sequences are the task's own)")
    return pairs_task(name, path, config)


def head_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> HeadInputs:
    """A causal language model's loss inputs (``policies.loss``): its last hidden states at every position but the
    last, the output projection with what the model does to its logits after it (Gemma-2's soft-capping, Cohere's
    scale), and the next token of each position: what its own loss (``labels=input_ids``) computes from. The model is
    called whole (its wrappers' and FSDP2's hooks run, as they would for its own loss), projecting no position."""
    ids = batch["input_ids"]
    lm = language_model(model)
    if lm is None:
        raise TaskError(f"{type(model).__name__}: no causal language model with an output projection inside it")
    none = torch.empty(0, dtype=torch.long, device=ids.device)  # no position projected: no logits made here
    out = model(input_ids=ids, output_hidden_states=True, logits_to_keep=none)
    hidden = out.hidden_states[-1][:, :-1]  # after the final norm, as the output projection takes it
    del out  # the other layers' outputs: what the backward keeps of them is kept anyway
    head = lm.get_output_embeddings()
    cap = getattr(lm.config, "final_logit_softcapping", None)
    scale = getattr(lm, "logit_scale", None)

    def project(h: torch.Tensor) -> torch.Tensor:
        out = head(h)
        out = out * scale if isinstance(scale, (int, float)) else out
        return torch.tanh(out / cap) * cap if cap else out

    return HeadInputs(hidden, project, ids[:, 1:])


def _not_a_text_encoder(config: Any) -> str | None:
    """Why a model that is no causal language model is no text encoder either, or None."""
    if getattr(config, "is_encoder_decoder", False):
        return f"{config.model_type} is an encoder-decoder model"
    if getattr(config, "vocab_size", None) is None:
        return f"{config.model_type} has no vocabulary (a vision or audio model)"
    return None


def _causal_task(name: str, path: Path, config: Any, seq: int | None) -> Task:
    from transformers import AutoModelForCausalLM

    context = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ
    seq = seq or min(DEFAULT_SEQ, context)
    if seq > context:
        raise TaskError(f"--seq-len {seq}: {name} takes at most {context} tokens (max_position_embeddings)")
    vocab = config.vocab_size
    chain = Chain(vocab, seq)
    held = chain.sample(EVAL_SEQUENCES // 4, seed=HELD_OUT_SEED)

    def train_batch(step: int, batch_size: int) -> dict[str, torch.Tensor]:
        return {"input_ids": chain.sample(batch_size, seed=step)[:, :-1]}

    def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def evaluate(predict: Any) -> dict[str, float]:
        nats = 0.0
        for i in range(len(held)):
            x = held[i:i + 1, :-1]
            out = logits(predict({"input_ids": x}))
            nats += F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(), x[:, 1:].reshape(-1)).item()
        nats /= len(held)
        return {"val_loss": nats, "perplexity": math.exp(min(nats, 50.0))}

    return Task(
        name=name, make_model=factory(path, config, AutoModelForCausalLM), train_batch=train_batch,
        blocks=getattr(config, "num_hidden_layers", 0) or 0, with_blocks=lambda n: _with_blocks(config, n),
        compute_loss=compute_loss, head_inputs=head_inputs, evaluate=evaluate, metric="val_loss",
        higher_is_better=False, make_optimizer=lambda p: torch.optim.AdamW(p, lr=2e-4, weight_decay=0.0), steps=20,
        batch_size=4,
        infer_batch=lambda n: {"input_ids": held[:n, :-1]}, text=held_out_text(path, vocab), context=context,
        description=f"{config.model_type} causal language model from {path}"
                    + f", {seq} tokens per sequence; "
                    + ("its weights" if has_weights(path) else "no weights there: its config's initialization")
                    + "; gpt2's generated corpus over its vocabulary; held-out loss and perplexity")


def held_out_text(path: Path, vocab: int) -> Any:
    """``text(n, length)`` for serving: the CPython docstrings the charlm task ships, through the model's own
    tokenizer when its folder has one; else gpt2's generated corpus over its vocabulary (no real text without a
    tokenizer)."""
    from dtypelab.core.tasks.charlm import _corpus

    ids: list[torch.Tensor] = []

    def tokenized() -> torch.Tensor | None:
        if not ids and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            try:
                from transformers import AutoTokenizer

                with quiet(), hushed():
                    tok = AutoTokenizer.from_pretrained(str(path))
                ids.append(torch.tensor(tok(_corpus())["input_ids"], dtype=torch.long))
            except Exception:  # a tokenizer that cannot load here: the generated corpus, as without one
                ids.append(torch.empty(0, dtype=torch.long))
        return ids[0] if ids and len(ids[0]) else None

    def text(n: int, length: int) -> torch.Tensor:
        data = tokenized()
        if data is not None and len(data) >= length:
            count = min(n, len(data) // length)
            stride = len(data) // count
            return torch.stack([data[i * stride:i * stride + length] for i in range(count)])
        return Chain(vocab, length - 1).sample(n, seed=HELD_OUT_SEED)

    return text


def _with_blocks(config: Any, n: int) -> nn.Module:
    """The model with ``n`` of its decoder layers, from its config (untrained: what a forecast traces)."""
    from transformers import AutoModelForCausalLM

    with quiet(), hushed():
        return AutoModelForCausalLM.from_config(at_depth(config, n), dtype=torch.float32)


__all__ = ["make_task"]
