"""What is served: a causal language model, its config (the cache's shape), held-out text and its positions.

- ``tinylm``: the small pretrained model shipped (real text);
- ``hf:ORG/NAME`` or ``hf:DIR``: a Hugging Face causal LM from the local cache or a config directory (its weights
  when there; its tokenizer's view of real text when it has one);
- ``decoder``, ``llama2-7b``: the built-in decoder shapes, as transformers' Llama (the same architecture: RMSNorm,
  rotary positions, grouped-query attention, SwiGLU), untrained: for forecasts and speed, not for quality;
- a task file whose ``make_task()`` returns a ``Task`` with ``text`` and ``context`` (``dtypelab.Task``) and a model
  that takes transformers' call (``input_ids``, ``past_key_values``, ``use_cache``, ``logits_to_keep``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import TaskError
from dtypelab.core.task import HF_PREFIX, Task, load_task
from dtypelab.core.tasks.hub import split_spec

SHAPES = ("decoder", "llama2-7b")  # built-in decoder shapes, served as transformers' Llama


@dataclass(frozen=True)
class Served:
    name: str
    make_model: Callable[[], nn.Module]
    text: Callable[[int, int], torch.Tensor]
    context: int  # the model's positions
    trained: bool  # its weights are trained (quality means something)
    description: str
    task: Task | None = None  # the task it came from
    config: Any = None  # a transformers model's config, when known without building it (a forecast builds at depth)
    folder: str | None = None  # tinylm's or an hf: model's folder (its tokenizer, for calibration text)


def _shape(name: str) -> Served:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dtypelab.core.tasks.decoder import LLAMA2_7B, SMALL
    from dtypelab.core.tasks.gpt2 import HELD_OUT_SEED, Chain

    s = {"decoder": SMALL, "llama2-7b": LLAMA2_7B}[name]
    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.dim, intermediate_size=s.hidden, num_hidden_layers=s.layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=s.seq,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)

    def make() -> nn.Module:
        return LlamaForCausalLM(config)

    return Served(name, make, lambda n, length: Chain(s.vocab, length - 1).sample(n, seed=HELD_OUT_SEED), s.seq,
                  False, f"{name}'s shape as transformers' Llama ({s.layers} layers, d={s.dim}, {s.heads} heads over "
                         f"{s.kv_heads} key/value heads), untrained", config=config)


def load_served(spec: str) -> Served:
    """The model ``spec`` names, ready to serve; a one-line error for one that cannot generate."""
    if spec in SHAPES:
        return _shape(spec)
    config, weights, path = None, False, None
    if spec.startswith(HF_PREFIX) or spec == "tinylm":
        from dtypelab.core.tasks.hub import causal, has_weights, locate
        from dtypelab.core.tasks.hub import config_of as hub_config
        from dtypelab.core.tasks.tinylm import folder

        path = folder() if spec == "tinylm" else locate(split_spec(spec[len(HF_PREFIX):])[0])
        config, weights = hub_config(path), has_weights(path)
        if not causal(config):
            raise TaskError(f"{spec} is a {getattr(config, 'model_type', 'model')} model, not a causal language model: "
                            "--mode generate serves one (tinylm, hf:MODEL, decoder, llama2-7b, or a task file whose "
                            "Task gives text= and context=)")
    task = load_task(spec)
    if task.text is None or not task.context:
        raise TaskError(f"{task.name} is not a causal language model with held-out text: --mode generate serves "
                        "one (tinylm, hf:MODEL, decoder, llama2-7b, or a task file whose Task gives text= and "
                        "context=)")
    return Served(task.name, task.make_model, task.text, task.context, task.pretrained or weights,
                  task.description, task, config, None if path is None else str(path))


def encode(served: Served, text: str) -> torch.Tensor:
    """``text`` in the served model's tokens: tinylm's are UTF-8 bytes; an hf: model's, its tokenizer's (read from
    its folder: no code runs)."""
    if served.name == "tinylm":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    from pathlib import Path

    if served.folder is None or not any((Path(served.folder) / f).exists()
                                        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise TaskError(f"{served.name} has no tokenizer here to read --calibration text with (tinylm, or an hf: "
                        "model whose folder holds one)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served.folder, trust_remote_code=False)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def config_of(model: nn.Module) -> Any:
    """The model's transformers config (what its cache is shaped from)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise TaskError(f"{type(model).__name__} has no transformers config (num_hidden_layers, num_attention_heads): "
                        "--mode generate serves transformers' causal language models")
    return config


__all__ = ["SHAPES", "Served", "config_of", "encode", "load_served"]
